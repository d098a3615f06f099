"""Step times and which reports were kept: the productive time behind goodput and the
on-demand baseline (docs/report.md, Goodput). A report is kept unless a later group
restored from a checkpoint before it, i.e. the step was trained again."""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from raylastic.reporting._walk import SKEW_S, Event, Group


@dataclass
class StepTimes:
    durations: List[float]  # per metrics record
    kept: List[bool]  # per metrics record: not re-trained later
    world_sizes: List[int]
    productive_s: float
    productive_worker_s: float
    ts: List[float]


def step_times(metrics: Sequence[Event], groups: List[Group]) -> StepTimes:
    """Each report's step time and whether it was kept (see docs/report.md, Goodput)."""
    # Later groups' minimum restore index: a report of group g with index i was re-trained
    # iff a later group restored from a checkpoint before i.
    suffix_min = [float("inf")] * (len(groups) + 1)
    for p in range(len(groups) - 1, -1, -1):
        suffix_min[p] = min(suffix_min[p + 1], groups[p].restore_index)
    owner = _owners(metrics, groups)
    by_group: Dict[Optional[int], List[int]] = defaultdict(list)
    for k, g in enumerate(owner):
        by_group[g].append(k)
    durations = [0.0] * len(metrics)
    all_gaps = []
    firsts = []
    for g, ks in by_group.items():
        ks.sort(key=lambda k: float(metrics[k]["ts"]))
        gaps = []
        for a, b in zip(ks, ks[1:]):
            durations[b] = max(0.0, float(metrics[b]["ts"]) - float(metrics[a]["ts"]))
            gaps.append(durations[b])
        all_gaps += gaps
        firsts.append((g, ks[0], statistics.median(gaps) if gaps else None))
    overall = statistics.median(all_gaps) if all_gaps else 0.0
    for g, k, med in firsts:
        est = med if med is not None else overall
        if g is not None:  # never more than the time since the group formed
            est = min(est, max(0.0, float(metrics[k]["ts"]) - groups[g].start_ts))
        durations[k] = est
    kept = [g is None or m["index"] <= suffix_min[g + 1] for m, g in zip(metrics, owner)]
    ws = [
        int(m.get("world_size") or (groups[g].world_size if g is not None else 1) or 1) for m, g in zip(metrics, owner)
    ]
    prod = sum(d for d, k in zip(durations, kept) if k)
    prod_w = sum(d * w for d, k, w in zip(durations, kept, ws) if k)
    return StepTimes(durations, kept, ws, prod, prod_w, [float(m["ts"]) for m in metrics])


def _owners(metrics: Sequence[Event], groups: List[Group]) -> List[Optional[int]]:
    """The group (position) that made each report: same epoch, latest formed before it.
    Epoch numbers restart when a run is resumed, so the time decides between equals."""
    by_epoch: Dict[Any, Tuple[List[float], List[int]]] = {}
    for p, g in enumerate(groups):
        starts, positions = by_epoch.setdefault(g.epoch, ([], []))
        starts.append(g.start_ts)
        positions.append(p)
    out: List[Optional[int]] = []
    for m in metrics:
        found = by_epoch.get(m.get("epoch"))
        if found is None:
            out.append(None)
            continue
        starts, positions = found
        k = bisect.bisect_right(starts, float(m["ts"]) + SKEW_S)
        out.append(positions[k - 1] if k else positions[0])
    return out
