"""What the HF and Lightning node-loss tests share: reading the per-rank index logs their
train functions write (one row per optimizer step: membership epoch, rank, world size,
global step, sample ids) into the rows that count."""

from __future__ import annotations

import glob
import json
import os

from raylastic.data import global_batch_indices, shard_for_rank


def effective_rows(log_dir, n, seed, global_batch):
    """Per step, the rows of the last membership epoch that trained it (a failed group's
    steps after its last snapshot were rolled back and redone); and all rows."""
    spe = n // global_batch
    rows = [json.loads(line) for f in glob.glob(os.path.join(log_dir, "*.jsonl")) for line in open(f)]
    last = {}
    for r in rows:
        last[r["step"]] = max(last.get(r["step"], -1), r["m_epoch"])
    effective = [r for r in rows if r["m_epoch"] == last[r["step"]]]
    # A rank whose node died right after the step's all-reduce (the survivors committed the
    # step) never wrote its line: for the last step of a membership epoch only, fill in that
    # rank's slice of the global batch from the data plan.
    last_of_group = {}
    for r in effective:
        last_of_group[r["m_epoch"]] = max(last_of_group.get(r["m_epoch"], -1), r["step"])
    for m_epoch, step in last_of_group.items():
        group = [r for r in effective if (r["m_epoch"], r["step"]) == (m_epoch, step)]
        world = group[0]["world"]
        batch = global_batch_indices(n, seed, step // spe, step % spe, global_batch, True)
        for missing in sorted(set(range(world)) - {r["rank"] for r in group}):
            effective.append({**group[0], "rank": missing, "indices": shard_for_rank(batch, missing, world),
                              "filled": True})
    return effective, rows
