"""What a chaos run must still get right, computed from the files it leaves behind.

Shared by the chaos test and the chaos benchmark (``raylastic.testing.chaos``), so both
judge a run the same way:

- :func:`exactly_once_problems`: every sample trained exactly once per epoch, from the
  per-rank index logs of :func:`raylastic.testing.chaos_train.chaos_elastic`, counting only
  the steps the final model kept (steps rolled back by a restore do not count).
- :func:`weight_difference`: the largest relative difference between two runs' weights.
- :func:`partial_checkpoint_loads`: every checkpoint a group restored from storage had been
  committed (its manifest written) before; ``checkpoint_invalid`` events are listed too.
- :func:`goodput_from_steps`: raylastic's goodput definition (docs/report.md) applied to a
  per-step log, so a framework without raylastic's event log (Ray Train) is measured by
  the same formula.
"""

from __future__ import annotations

import glob
import os
import statistics
from typing import Any, Dict, List, Optional

from raylastic.testing.chaos import read_jsonl


def _group_order(log_dir: str) -> Dict[str, float]:
    first: Dict[str, float] = {}
    for m in read_jsonl(os.path.join(log_dir, "members.jsonl")):
        first[m["group"]] = min(first.get(m["group"], m["t"]), m["t"])
    return first


def effective_rows(log_dir: str, n: int, seed: int, global_batch: int) -> List[Dict[str, Any]]:
    """The rows of the steps the final model kept: a row (group g, step counter i) was rolled
    back iff a group that started after g trained a step counter <= i (it restored an older
    state), the rule ``raylastic report`` uses for ``kept``. A rank whose node died right after
    a step's all-reduce (so the step counted, and the survivors' snapshot of it was kept)
    never wrote its line: for the last kept step of each group, its slice of the global
    batch is filled in from the plan."""
    from raylastic.data import global_batch_indices, shard_for_rank

    order = _group_order(log_dir)
    rows = [r for f in glob.glob(os.path.join(log_dir, "idx-*.jsonl")) for r in read_jsonl(f)]
    first_index: Dict[str, int] = {}
    for r in rows:
        first_index[r["group"]] = min(first_index.get(r["group"], r["index"]), r["index"])
    later_min: Dict[str, float] = {}
    low = float("inf")
    for g in sorted(first_index, key=lambda g: order.get(g, 0.0), reverse=True):
        later_min[g] = low
        low = min(low, first_index[g])
    eff = [r for r in rows if r["index"] < later_min[r["group"]]]
    last_of_group: Dict[str, int] = {}
    for r in eff:
        last_of_group[r["group"]] = max(last_of_group.get(r["group"], r["index"]), r["index"])
    for group, index in last_of_group.items():
        have = [r for r in eff if r["group"] == group and r["index"] == index]
        world, epoch, step = have[0]["world"], have[0]["epoch"], have[0]["step"]
        for missing in sorted(set(range(world)) - {r["rank"] for r in have}):
            batch = global_batch_indices(n, seed, epoch, step, global_batch, True)
            eff.append(
                {
                    "group": group,
                    "rank": missing,
                    "world": world,
                    "index": index,
                    "epoch": epoch,
                    "step": step,
                    "indices": list(shard_for_rank(batch, missing, world)),
                    "filled_in": True,
                }
            )
    return eff


def exactly_once_problems(log_dir: str, *, n: int, seed: int, global_batch: int, epochs: int) -> List[str]:
    """Empty when every step of epochs ``0..epochs-1`` was trained by one whole group on
    exactly the planned samples, so every sample was trained exactly once per epoch (the
    partial tail batch is dropped by design)."""
    from raylastic.data import global_batch_indices, steps_per_epoch

    eff = effective_rows(log_dir, n, seed, global_batch)
    by_step: Dict[tuple, List[Dict[str, Any]]] = {}
    for r in eff:
        by_step.setdefault((r["epoch"], r["step"]), []).append(r)
    problems: List[str] = []
    per_epoch = steps_per_epoch(n, global_batch)
    for epoch in range(epochs):
        seen: List[int] = []
        for step in range(per_epoch):
            rows = by_step.get((epoch, step), [])
            if not rows:
                problems.append(f"epoch {epoch} step {step}: never trained")
                continue
            worlds = {r["world"] for r in rows}
            ranks = sorted(r["rank"] for r in rows)
            if len(worlds) != 1 or ranks != list(range(rows[0]["world"])) or len({r["group"] for r in rows}) != 1:
                problems.append(f"epoch {epoch} step {step}: ranks {ranks} of world(s) {sorted(worlds)}")
            union = sorted(i for r in rows for i in r["indices"])
            if union != sorted(global_batch_indices(n, seed, epoch, step, global_batch, True)):
                problems.append(f"epoch {epoch} step {step}: trained samples differ from the plan")
            seen += union
        if len(seen) != len(set(seen)):
            problems.append(f"epoch {epoch}: {len(seen) - len(set(seen))} sample(s) trained twice")
    extra = sorted(k for k in by_step if k[0] >= epochs)
    if extra:
        problems.append(f"steps kept beyond epoch {epochs - 1}: {extra[:5]}")
    return problems


def weight_difference(a: Dict[str, Any], b: Dict[str, Any]) -> float:
    """max over tensors of max|a - b| / max|a| (relative to the reference ``a``)."""
    if set(a) != set(b):
        raise ValueError(f"different tensors: {sorted(set(a) ^ set(b))}")
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


def partial_checkpoint_loads(events: List[Dict[str, Any]]) -> List[str]:
    """Problems found in the event log: a storage restore of a checkpoint that had not been
    committed (no ``checkpoint_committed`` for its path/index before it), or a committed
    checkpoint found damaged (``checkpoint_invalid`` without ``source: memory``)."""
    committed, problems = set(), []
    name = lambda e: str(e.get("path") or "").rstrip("/").rsplit("/", 1)[-1]  # noqa: E731
    for e in events:
        kind = e.get("kind")
        if kind == "checkpoint_committed":
            committed.add((e.get("index"), name(e)))
        elif kind == "checkpoint_restored" and e.get("source") == "storage":
            if (e.get("index"), name(e)) not in committed:
                problems.append(
                    f"restored checkpoint index {e.get('index')} ({e.get('path')}) that was never committed"
                )
        elif kind == "checkpoint_invalid" and e.get("source") != "memory":
            problems.append(f"committed checkpoint found damaged: {e.get('path')} ({e.get('problem')})")
    return problems


def goodput_from_steps(
    steps: List[Dict[str, Any]],
    t_start: float,
    t_end: float,
    group_start: Optional[Dict[str, float]] = None,
    max_step_s: Optional[float] = None,
) -> Dict[str, Any]:
    """docs/report.md's goodput on a step log (rows ``t``, ``step``, ``group``, ``world``):
    productive time = the step times of steps not trained again later (a step is trained
    again iff a later row has a step index <= it); a step's time is the time since the
    previous step of its group; a group's first step takes the group's median step time
    (the run's if it has one step), capped at the time since the group started; wall =
    ``t_end - t_start``.

    ``max_step_s``: a stricter variant. The report counts a step that blocked (e.g. on a
    checkpoint upload waiting out a storage outage) as productive; with a cap, the time a
    kept step took beyond ``max_step_s`` is ``stalled_s``, badput."""
    if not steps or t_end <= t_start:
        return {
            "goodput": None,
            "productive_s": 0.0,
            "wall_s": max(0.0, t_end - t_start),
            "kept": 0,
            "reported": len(steps),
            "retrained": 0,
        }
    steps = sorted(steps, key=lambda r: r["t"])
    gaps: Dict[str, List[float]] = {}
    prev: Dict[str, float] = {}
    for r in steps:
        if r["group"] in prev:
            gaps.setdefault(r["group"], []).append(r["t"] - prev[r["group"]])
        prev[r["group"]] = r["t"]
    all_gaps = [g for v in gaps.values() for g in v]
    run_median = statistics.median(all_gaps) if all_gaps else 0.0
    kept, productive, later_min = 0, 0.0, float("inf")
    times: List[float] = [0.0] * len(steps)
    prev = {}
    for i, r in enumerate(steps):
        g = r["group"]
        if g in prev:
            times[i] = r["t"] - prev[g]
        else:
            med = statistics.median(gaps[g]) if gaps.get(g) else run_median
            since = r["t"] - (group_start or {}).get(g, r["t"] - med)
            times[i] = max(0.0, min(med, since))
        prev[g] = r["t"]
    stalled = 0.0
    for i in range(len(steps) - 1, -1, -1):
        if steps[i]["step"] < later_min:
            kept += 1
            over = max(0.0, times[i] - max_step_s) if max_step_s is not None else 0.0
            productive += times[i] - over
            stalled += over
        later_min = min(later_min, steps[i]["step"])
    wall = t_end - t_start
    out = {
        "goodput": productive / wall,
        "productive_s": round(productive, 3),
        "wall_s": round(wall, 3),
        "kept": kept,
        "reported": len(steps),
        "retrained": len(steps) - kept,
    }
    if max_step_s is not None:
        out.update(max_step_s=round(max_step_s, 3), stalled_s=round(stalled, 3))
    return out


def group_starts(log_dir: str) -> Dict[str, float]:
    """When each group's first rank started (``members.jsonl``)."""
    return _group_order(log_dir)
