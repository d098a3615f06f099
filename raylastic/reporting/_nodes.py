"""Node-hours: how long each node was billed to the run (per node type), and the cost
series plotted against the on-demand baseline. Pure functions of the event log.

A node is billed while the run holds a worker on it, and, once the run released it, until
its ``node_gone`` (the autoscaler's idle timeout: the cloud bills the node until it is
gone). Logs without ``node_gone`` events bill only the held time."""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, DefaultDict, Dict, List, Optional, Sequence, Set, Tuple

from raylastic.events import EventKind, LossCause
from raylastic.reporting._steps import StepTimes
from raylastic.reporting._walk import Event, kind_of

DEFAULT_NODE_TYPE = "default"  # node-hours of workers whose worker_ready has no node_type


Interval = Tuple[str, float, float]  # (node_type, start_ts, end_ts)


@dataclass
class NodeIntervals:
    intervals: List[Interval]  # held: a worker of the run was on the node
    hours: Dict[str, float]  # billed (held + released) node-hours
    count: Dict[str, int]
    slots: Dict[str, int]  # peak workers held at once on one node of the type
    markets: Dict[str, Optional[str]]
    approximated: bool = False
    released: List[Interval] = field(default_factory=list)  # released, until node_gone

    @property
    def billed(self) -> List[Interval]:
        """Every billed interval: the held ones, then the released-but-billed ones."""
        return self.intervals + self.released


def node_intervals(events: Sequence[Event], sess: List[Tuple[float, float]]) -> NodeIntervals:
    """Per node and controller session: from a worker_ready on an unheld node until the
    run holds no worker there any more (worker_lost/released), or the session's end while
    one of its workers is still held. A node given back and used again later counts twice,
    not for the gap in between. A ``node_gone`` after a node's interval ended by a release
    (:func:`_released`; before a new worker_ready there) adds the released interval from
    that release to the node_gone; after a loss it adds nothing. A ``node_gone`` for a node
    the log still shows held ends its interval there."""
    approximated = not any(kind_of(e) is EventKind.WORKER_READY for e in events) and any(
        kind_of(e) is EventKind.GROUP_FORMED and e.get("nodes") for e in events
    )
    intervals: List[Tuple[str, float, float]] = []  # (node type, start ts, end ts)
    slots: DefaultDict[str, int] = defaultdict(int)
    markets: Dict[str, Optional[str]] = {}
    nodes_of: DefaultDict[str, Set[str]] = defaultdict(set)
    session_no = 0
    state: Dict[str, Dict[str, Any]] = {}  # node -> its open interval
    released: List[Tuple[str, float, float]] = []
    gone_after: Dict[str, Tuple[str, float]] = {}  # node -> (node_type, ts of the release that ended it)

    def flush(session_end: float) -> None:
        for st in state.values():
            end = session_end if st["held"] else (st["last_end"] or session_end)
            intervals.append((st["type"], st["start"], max(st["start"], end)))
        state.clear()

    for i, e in enumerate(events):
        kind, ts = kind_of(e), float(e["ts"])
        if kind is EventKind.RUN_STARTED and i > 0:
            flush(sess[session_no][1])
            session_no += 1
            continue
        if kind is EventKind.NODE_GONE and e.get("node_id") in gone_after:
            ntype, released_ts = gone_after.pop(e["node_id"])
            released.append((ntype, released_ts, max(released_ts, ts)))
            continue
        if kind is EventKind.NODE_GONE and e.get("node_id") in state:
            # the node left the cluster while the log still shows a worker there (a worker
            # on a drained node that was not in the group leaves no worker_lost): its billed
            # time ends here, not at the session's end
            st = state.pop(e["node_id"])
            intervals.append((st["type"], st["start"], max(st["start"], ts)))
            continue
        for node, wid, ntype, market in _ready(e, approximated):
            ntype = ntype or DEFAULT_NODE_TYPE
            gone_after.pop(node, None)  # used again: the gap is not billed
            st = state.setdefault(node, {"type": ntype, "start": ts, "held": set(), "last_end": None})
            st["held"].add(wid)
            slots[st["type"]] = max(slots[st["type"]], len(st["held"]))
            nodes_of[st["type"]].add(node)
            if market and markets.get(st["type"]) is None:
                markets[st["type"]] = market
            markets.setdefault(st["type"], None)
        if kind in (EventKind.WORKER_LOST, EventKind.WORKER_RELEASED) and e.get("node_id") in state:
            st = state[e["node_id"]]
            wid = e.get("wid")
            if wid in st["held"]:
                st["held"].discard(wid)
                if not st["held"]:  # the run gave the node back: a later worker starts a new interval
                    intervals.append((st["type"], st["start"], max(st["start"], ts)))
                    del state[e["node_id"]]
                    if _released(e):  # the node is billed on until its node_gone
                        gone_after[e["node_id"]] = (st["type"], max(st["start"], ts))
                    continue
            elif approximated or wid is None:
                st["held"].clear()
            st["last_end"] = ts
        if approximated and kind in (EventKind.RUN_FINISHED, EventKind.RUN_FAILED):
            for st in state.values():
                st["held"].clear()
                st["last_end"] = st["last_end"] if st["last_end"] else ts
    flush(sess[-1][1])
    hours: DefaultDict[str, float] = defaultdict(float)
    count: Dict[str, int] = {}
    for ntype, start, end in intervals + released:
        hours[ntype] += (end - start) / 3600.0
    for ntype, nodes in nodes_of.items():
        count[ntype] = len(nodes)
    return NodeIntervals(intervals, dict(hours), count, dict(slots), markets, approximated, released)


def _released(e: Event) -> bool:
    """The run gave the worker's slot back on purpose: ``worker_released``, or a worker
    moved off by a capacity policy (``worker_lost`` cause ``released``). Not a loss: a
    lost, crashed, hung or preempted worker's node is not "released" by the run."""
    return kind_of(e) is EventKind.WORKER_RELEASED or (
        kind_of(e) is EventKind.WORKER_LOST and e.get("cause") == LossCause.RELEASED.value
    )


def _ready(e: Event, approximated: bool):
    """(node, worker key, node_type, market) for each worker this event makes ready."""
    if kind_of(e) is EventKind.WORKER_READY and e.get("node_id"):
        yield e["node_id"], e.get("wid", e["node_id"]), e.get("node_type"), e.get("market")
    elif approximated and kind_of(e) is EventKind.GROUP_FORMED:
        for rank, node in enumerate(e.get("nodes") or []):
            yield node, f"{node}/{rank}", None, None


def cost_series(
    nodes: NodeIntervals,
    price_of: Dict[str, float],
    steps: StepTimes,
    od_worker_usd_h: Optional[float],
    t0: float,
    sess,
    points: int = 300,
):
    """(t_s, node-hours, cost USD or None, baseline USD or None) on a grid over the run
    and the released nodes' billed time after it."""
    billed = nodes.billed
    end = max([sess[-1][1]] + [e for _, _, e in billed])
    if end <= t0:
        return ()
    grid = sorted(
        {t0 + (end - t0) * k / (points - 1) for k in range(points)}
        | {s for _, s, _ in billed}
        | {e for _, _, e in billed}
    )
    order = sorted(range(len(steps.ts)), key=lambda k: steps.ts[k])
    ts_sorted = [steps.ts[k] for k in order]
    cum_w, acc = [], 0.0
    for k in order:
        acc += steps.durations[k] * steps.world_sizes[k] if steps.kept[k] else 0.0
        cum_w.append(acc)
    out = []
    for t in grid:
        nh, usd = 0.0, 0.0
        for ntype, s, e in billed:
            h = max(0.0, min(e, t) - s) / 3600.0
            nh += h
            usd += h * price_of.get(ntype, 0.0)
        j = bisect.bisect_right(ts_sorted, t)
        worker_s = cum_w[j - 1] if j else 0.0
        out.append(
            (
                t - t0,
                nh,
                usd if price_of else None,
                worker_s / 3600.0 * od_worker_usd_h if od_worker_usd_h is not None else None,
            )
        )
    return tuple(out)
