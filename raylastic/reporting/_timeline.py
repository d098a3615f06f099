"""The passes over the event log behind :func:`raylastic.reporting.model.build_report`:
controller sessions, the membership-epoch walk (segments, recoveries, resizes), step
times and which steps were kept, and per-node holding intervals. Pure functions."""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from raylastic.reporting.model import DEFAULT_NODE_TYPE, _SKEW_S, Recovery, Resize, Segment

Event = Mapping[str, Any]


def sessions(events: Sequence[Event], metrics: Sequence[Event]) -> List[Tuple[float, float]]:
    """(start_ts, end_ts) of each controller session: a ``run_started`` starts one (a resumed
    run appends a second). The idle gap between a crash and a resume is not wall time."""
    starts = [i for i, e in enumerate(events) if e["kind"] == "run_started" and i > 0]
    bounds = [0] + starts + [len(events)]
    out = []
    for a, b in zip(bounds, bounds[1:]):
        start, end = float(events[a]["ts"]), float(events[b - 1]["ts"])
        nxt = float(events[b]["ts"]) if b < len(events) else float("inf")
        end = max([end] + [float(m["ts"]) for m in metrics if start <= float(m["ts"]) < nxt])
        out.append((start, end))
    return out


@dataclass
class _Group:
    epoch: int
    world_size: int
    start_ts: float
    restore_index: int
    end_ts: Optional[float] = None
    ended_by: str = ""


@dataclass
class _OpenRecovery:
    at_ts: float
    cause: str
    nodes: List[str] = field(default_factory=list)
    failure_ts: Optional[float] = None
    steps_lost: int = 0
    reached_index: Optional[int] = None
    restore_index: Optional[int] = None
    world_size_before: Optional[int] = None
    world_size_after: Optional[int] = None
    reason: str = ""


@dataclass
class Walk:
    groups: List[_Group]
    segments: List[Segment]
    recoveries: List[Recovery]
    resizes: List[Resize]


def walk(events: Sequence[Event], metrics: Sequence[Event], sess: List[Tuple[float, float]],
         t0: float) -> Walk:
    """One pass over the events: membership epochs, recoveries and resizes."""
    groups: List[_Group] = []
    recoveries: List[Recovery] = []
    resizes: List[dict] = []
    cur: Optional[_Group] = None
    rec: Optional[_OpenRecovery] = None
    session_no = 0
    last_report_ts = _last_report_lookup(metrics)

    def end_group(ts: float, why: str) -> None:
        nonlocal cur
        if cur is not None:
            cur.end_ts, cur.ended_by, cur = ts, why, None

    def close(recovered_ts: Optional[float]) -> None:
        nonlocal rec
        if rec is None:
            return
        recoveries.append(Recovery(
            at_s=rec.at_ts - t0, cause=rec.cause, nodes=tuple(rec.nodes),
            detection_s=max(0.0, rec.failure_ts - rec.at_ts) if rec.failure_ts else 0.0,
            recovery_s=(recovered_ts - rec.at_ts) if recovered_ts is not None else None,
            steps_lost=rec.steps_lost, reached_index=rec.reached_index,
            restore_index=rec.restore_index, world_size_before=rec.world_size_before,
            world_size_after=rec.world_size_after, reason=rec.reason))
        rec = None

    def open_rec(e: Event, cause: str) -> _OpenRecovery:
        nonlocal rec
        if rec is None:
            rec = _OpenRecovery(at_ts=float(e["ts"]), cause=cause,
                                world_size_before=cur.world_size if cur else None)
        return rec

    for i, e in enumerate(events):
        kind, ts = e["kind"], float(e["ts"])
        if kind == "run_started" and i > 0:
            session_end = sess[session_no][1]
            end_group(session_end, "controller stopped")
            close(None)
            session_no += 1
        elif kind == "worker_lost":
            cause = str(e.get("cause") or "lost")
            r = open_rec(e, cause)
            if cause not in r.cause.split("+"):
                r.cause += "+" + cause
            if e.get("node_id") and e["node_id"] not in r.nodes:
                r.nodes.append(str(e["node_id"]))
            end_group(ts, cause)
        elif kind == "failure":
            r = open_rec(e, str(e.get("failure_kind") or "error"))
            if r.failure_ts is None:
                r.failure_ts = ts
                r.reason = str(e.get("reason") or e.get("message") or "")
                r.reached_index = e.get("reached_index")
            end_group(ts, r.cause)
        elif kind == "resize":
            graceful = bool(e.get("graceful"))
            lost = int(e.get("lost_steps") or 0)
            resizes.append({"e": e, "from": cur.world_size if cur else None, "to": None,
                            "pause": None, "stop_ts": last_report_ts(e.get("reached_index"), ts)})
            if not graceful or rec is not None:
                r = open_rec(e, "resize")
                r.steps_lost += lost
                r.restore_index = e.get("restore_index")
                if r.reached_index is None:
                    r.reached_index = e.get("reached_index")
            end_group(ts, "resize" if graceful else (rec.cause if rec else "failure"))
        elif kind == "group_formed":
            end_group(ts, "regrouped")
            cur = _Group(int(e.get("epoch") or 0), int(e.get("world_size") or 0), ts,
                         int(e.get("restore_index") or 0))
            groups.append(cur)
            if rec is not None:
                rec.world_size_after = cur.world_size
            for rz in resizes:
                if rz["to"] is None:
                    rz["to"] = cur.world_size
        elif kind == "first_step":
            report_ts = float(e.get("report_ts") or ts)
            close(report_ts)
            for rz in resizes:
                if rz["pause"] is None:
                    rz["pause"] = report_ts - rz["stop_ts"]
        elif kind in ("run_finished", "run_failed"):
            end_group(ts, "finished" if kind == "run_finished" else "failed")
            close(None)
    end_group(sess[-1][1], "end of log")
    close(None)
    segments = [Segment(g.epoch, g.world_size, g.start_ts - t0, (g.end_ts or g.start_ts) - t0,
                        g.restore_index, g.ended_by) for g in groups]
    return Walk(groups, segments, recoveries, [_resize(rz, t0) for rz in resizes])


def _resize(rz: dict, t0: float) -> Resize:
    e = rz["e"]
    return Resize(at_s=float(e["ts"]) - t0, graceful=bool(e.get("graceful")),
                  from_world_size=rz["from"], to_world_size=rz["to"],
                  lost_steps=int(e.get("lost_steps") or 0), resize_s=e.get("resize_s"),
                  pause_s=rz["pause"], reached_index=e.get("reached_index"),
                  reason=str(e.get("reason") or e.get("message") or ""))


def _last_report_lookup(metrics: Sequence[Event]):
    """ts of the last report of ``index`` made before ``ts`` (the step a group stopped at)."""
    by_index: Dict[int, List[float]] = defaultdict(list)
    for m in metrics:
        by_index[m["index"]].append(float(m["ts"]))

    def find(index: Optional[int], ts: float) -> float:
        cands = [t for t in by_index.get(index, []) if t <= ts + _SKEW_S] if index is not None else []
        return max(cands) if cands else ts
    return find


# ----------------------------------------------------------------------------- steps

@dataclass
class StepTimes:
    durations: List[float]  # per metrics record
    kept: List[bool]  # per metrics record: not re-trained later
    world_sizes: List[int]
    productive_s: float
    productive_worker_s: float
    ts: List[float]


def step_times(metrics: Sequence[Event], groups: List[_Group]) -> StepTimes:
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
    ws = [int(m.get("world_size") or (groups[g].world_size if g is not None else 1) or 1)
          for m, g in zip(metrics, owner)]
    prod = sum(d for d, k in zip(durations, kept) if k)
    prod_w = sum(d * w for d, k, w in zip(durations, kept, ws) if k)
    return StepTimes(durations, kept, ws, prod, prod_w, [float(m["ts"]) for m in metrics])


def _owners(metrics: Sequence[Event], groups: List[_Group]) -> List[Optional[int]]:
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
        k = bisect.bisect_right(starts, float(m["ts"]) + _SKEW_S)
        out.append(positions[k - 1] if k else positions[0])
    return out


# ----------------------------------------------------------------------------- nodes

@dataclass
class NodeIntervals:
    intervals: List[Tuple[str, float, float]]  # (node_type, start_ts, end_ts)
    hours: Dict[str, float]
    count: Dict[str, int]
    slots: Dict[str, int]  # peak workers held at once on one node of the type
    markets: Dict[str, Optional[str]]
    approximated: bool = False


def node_intervals(events: Sequence[Event], sess: List[Tuple[float, float]]) -> NodeIntervals:
    """Per node and controller session: from a worker_ready on an unheld node until the
    run holds no worker there any more (worker_lost/released), or the session's end while
    one of its workers is still held. A node given back and used again later counts twice,
    not for the gap in between."""
    approximated = not any(e["kind"] == "worker_ready" for e in events) and any(
        e["kind"] == "group_formed" and e.get("nodes") for e in events)
    intervals, slots, markets, nodes_of = [], defaultdict(int), {}, defaultdict(set)
    session_no, state = 0, {}

    def flush(session_end: float) -> None:
        for node, st in state.items():
            end = session_end if st["held"] else (st["last_end"] or session_end)
            intervals.append((st["type"], st["start"], max(st["start"], end)))
        state.clear()

    for i, e in enumerate(events):
        kind, ts = e["kind"], float(e["ts"])
        if kind == "run_started" and i > 0:
            flush(sess[session_no][1])
            session_no += 1
            continue
        for node, wid, ntype, market in _ready(e, approximated):
            ntype = ntype or DEFAULT_NODE_TYPE
            st = state.setdefault(node, {"type": ntype, "start": ts, "held": set(), "last_end": None})
            st["held"].add(wid)
            slots[st["type"]] = max(slots[st["type"]], len(st["held"]))
            nodes_of[st["type"]].add(node)
            if market and markets.get(st["type"]) is None:
                markets[st["type"]] = market
            markets.setdefault(st["type"], None)
        if kind in ("worker_lost", "worker_released") and e.get("node_id") in state:
            st = state[e["node_id"]]
            wid = e.get("wid")
            if wid in st["held"]:
                st["held"].discard(wid)
                if not st["held"]:  # the run gave the node back: a later worker starts a new interval
                    intervals.append((st["type"], st["start"], max(st["start"], ts)))
                    del state[e["node_id"]]
                    continue
            elif approximated or wid is None:
                st["held"].clear()
            st["last_end"] = ts
        if approximated and kind in ("run_finished", "run_failed"):
            for st in state.values():
                st["held"].clear()
                st["last_end"] = st["last_end"] if st["last_end"] else ts
    flush(sess[-1][1])
    hours, count = defaultdict(float), {}
    for ntype, start, end in intervals:
        hours[ntype] += (end - start) / 3600.0
    for ntype, nodes in nodes_of.items():
        count[ntype] = len(nodes)
    return NodeIntervals(intervals, dict(hours), count, dict(slots), markets, approximated)


def _ready(e: Event, approximated: bool):
    """(node, worker key, node_type, market) for each worker this event makes ready."""
    if e["kind"] == "worker_ready" and e.get("node_id"):
        yield e["node_id"], e.get("wid", e["node_id"]), e.get("node_type"), e.get("market")
    elif approximated and e["kind"] == "group_formed":
        for rank, node in enumerate(e.get("nodes") or []):
            yield node, f"{node}/{rank}", None, None


# ----------------------------------------------------------------------------- cost series

def cost_series(nodes: NodeIntervals, price_of: Dict[str, float], steps: StepTimes,
                od_worker_usd_h: Optional[float], t0: float, sess, points: int = 300):
    """(t_s, node-hours, cost USD or None, baseline USD or None) on a grid over the run."""
    end = sess[-1][1]
    if end <= t0:
        return ()
    grid = sorted({t0 + (end - t0) * k / (points - 1) for k in range(points)}
                  | {s for _, s, _ in nodes.intervals} | {e for _, _, e in nodes.intervals})
    order = sorted(range(len(steps.ts)), key=lambda k: steps.ts[k])
    ts_sorted = [steps.ts[k] for k in order]
    cum_w, acc = [], 0.0
    for k in order:
        acc += steps.durations[k] * steps.world_sizes[k] if steps.kept[k] else 0.0
        cum_w.append(acc)
    out = []
    for t in grid:
        nh, usd = 0.0, 0.0
        for ntype, s, e in nodes.intervals:
            h = max(0.0, min(e, t) - s) / 3600.0
            nh += h
            usd += h * price_of.get(ntype, 0.0)
        j = bisect.bisect_right(ts_sorted, t)
        worker_s = cum_w[j - 1] if j else 0.0
        out.append((t - t0, nh, usd if price_of else None,
                    worker_s / 3600.0 * od_worker_usd_h if od_worker_usd_h is not None else None))
    return tuple(out)
