"""What elasticity did and what it cost: a pure function from a run's event log and
metrics to a frozen :class:`~raylastic.reporting.records.RunReport`.

Every number is derived from ``events.jsonl`` and ``metrics.jsonl`` alone (see
docs/events.md for the schema and docs/report.md for every formula). Times in the report
are seconds since the run's first event. Nothing here imports Ray or torch. The passes
run in order, each over plain records: sessions and the membership walk (``_walk``),
step times (``_steps``), node-hours and the cost series (``_nodes``), the cost against
the on-demand baseline here, the bill by phase (``bill``), then the checkpoint statistics.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

from raylastic.events import EventKind
from raylastic.reporting import _nodes, _steps, _walk, bill
from raylastic.reporting._walk import kind_of
from raylastic.reporting.loading import NotARunError
from raylastic.reporting.prices import Prices, effective_prices
from raylastic.reporting.records import NodeTypeUsage, RunReport, Series

# The run's status from its last session boundary: a run_started after the last
# run_finished/run_failed means a resumed run that has not ended (yet).
_SESSION_ENDS: Dict[Optional[EventKind], str] = {
    EventKind.RUN_FINISHED: "finished",
    EventKind.RUN_FAILED: "failed",
    EventKind.RUN_STARTED: "incomplete",
}


def build_report(
    events: Sequence[Mapping[str, Any]],
    metrics: Sequence[Mapping[str, Any]],
    prices: Optional[Prices] = None,
    *,
    run_path: str = "",
    on_demand_type: Optional[str] = None,
    loss_key: str = "loss",
    notes: Sequence[str] = (),
) -> RunReport:
    """The report of one run. ``prices`` (e.g. from --prices) override the event log's."""
    events = [e for e in events if isinstance(e.get("ts"), (int, float))]
    if not events:
        raise NotARunError(f"{run_path or 'run'}: no events")
    notes = list(notes)
    t0 = float(events[0]["ts"])
    sessions = _walk.sessions(events, metrics)
    wall_s = sum(end - start for start, end in sessions)
    walk = _walk.walk(events, metrics, sessions, t0)
    steps_info = _steps.step_times(metrics, walk.groups)
    nodes = _nodes.node_intervals(events, sessions)
    if nodes.approximated:
        notes.append(
            "no worker_ready events (older run): node-hours are approximated from group membership (group_formed.nodes)"
        )
    effective = effective_prices(events, prices)
    cost = _cost(nodes, effective, steps_info.productive_worker_s, on_demand_type, notes)
    bill_split = bill.bill_by_phase(
        events, nodes, {t: u.usd_per_hour for t, u in cost.usage.items()}, priced=effective is not None
    )
    if nodes.intervals and not bill.has_states(events):
        notes.append(
            "no state events (older run): the bill's phases are inferred from "
            "group_formed / first_step / worker_lost / resize"
        )
    last_finish = next((e for e in reversed(events) if kind_of(e) in _SESSION_ENDS), None)
    status = _SESSION_ENDS.get(kind_of(last_finish) if last_finish else None, "incomplete")
    error = (
        str(last_finish.get("message") or last_finish.get("error"))
        if status == "failed" and last_finish is not None
        else None
    )
    if status == "incomplete":
        notes.append(
            "the run has no run_finished/run_failed event: it is still running or "
            "crashed; numbers cover up to its last event"
        )
    final_index = max((m["index"] for m, kept in zip(metrics, steps_info.kept) if kept), default=None)
    if status == "finished" and last_finish is not None and last_finish.get("index") is not None:
        final_index = last_finish["index"]
    steps = {
        "final_index": final_index,
        "kept": sum(steps_info.kept),
        "reported": len(metrics),
        "retrained": len(metrics) - sum(steps_info.kept),
        "lost": sum(r.lost_steps for r in walk.resizes),
    }
    series = Series(
        loss=tuple(
            (float(m["ts"]) - t0, int(m["index"]), loss, kept)
            for m, kept in zip(metrics, steps_info.kept)
            if (loss := _finite((m.get("metrics") or {}).get(loss_key))) is not None
        ),
        cost=_nodes.cost_series(nodes, cost.price_of, steps_info, cost.od_worker_usd_h, t0, sessions),
        loss_key=loss_key,
    )
    productive = steps_info.productive_s
    return RunReport(
        run_path=run_path,
        status=status,
        error=error,
        start_ts=t0,
        end_ts=sessions[-1][1],
        wall_s=wall_s,
        productive_step_s=productive,
        goodput=(productive / wall_s) if wall_s > 0 and metrics else None,
        steps=steps,
        world_size_timeline=tuple(walk.segments),
        recoveries=tuple(walk.recoveries),
        resizes=tuple(walk.resizes),
        checkpoints=_checkpoints(events, t0),
        node_hours=cost.usage,
        prices=cost.prices_json,
        cost_usd=cost.total,
        on_demand_type=cost.od_type,
        on_demand_cost_usd=cost.baseline,
        savings_usd=cost.savings,
        savings_pct=(cost.savings / cost.baseline * 100.0) if cost.savings is not None and cost.baseline else None,
        productive_worker_s=steps_info.productive_worker_s,
        notes=tuple(notes),
        bill=bill_split,
        series=series,
    )


@dataclass
class _Cost:
    usage: Dict[str, NodeTypeUsage]
    prices_json: Optional[Dict[str, Any]]
    total: Optional[float]
    od_type: Optional[str]
    baseline: Optional[float]
    savings: Optional[float]
    od_worker_usd_h: Optional[float]
    price_of: Dict[str, float]


def _cost(
    nodes, prices: Optional[Prices], productive_worker_s: float, od_override: Optional[str], notes: List[str]
) -> _Cost:
    table = dict(prices.usd_per_hour) if prices else {}
    markets = dict(prices.markets) if prices else {}
    for t, m in nodes.markets.items():
        markets.setdefault(t, m)
    usage = {}
    for t in sorted(nodes.hours):
        price = table.get(t)
        usage[t] = NodeTypeUsage(
            markets.get(t), nodes.count[t], nodes.hours[t], price, nodes.hours[t] * price if price is not None else None
        )
    missing = sorted(t for t in usage if t not in table)
    if prices is None:
        notes.append(
            "no price table in the event log: cost is unknown; pass --prices '{\"<node_type>\": <USD per hour>, ...}'"
        )
    elif missing:
        notes.append(
            f"no hourly price for node type(s) {missing} used by this run (prices from "
            f"{prices.source or '?'} cover {sorted(table)}): cost is unknown; pass "
            f"--prices '{{\"{missing[0]}\": <USD per hour>}}'"
        )
    costs = [u.cost_usd for u in usage.values() if u.cost_usd is not None]  # every type's, when none is missing
    total: Optional[float] = sum(costs) if usage and not missing and prices else None
    if prices is not None and not usage:
        total = 0.0
    od = od_override or (prices.on_demand_type if prices else None)
    if od is None:
        candidates = sorted((table[t], t) for t, m in markets.items() if m == "on_demand" and t in table)
        if candidates:
            od = candidates[0][1]
        elif (
            len(table) == 1
            and not any(m == "on_demand" for m in markets.values())
            and (not markets or all(m is None for m in markets.values()))
        ):
            od = next(iter(table))  # a run without node types: its one type is the baseline
    baseline = od_worker = None
    if od is not None and od in table:
        slots = nodes.slots.get(od) or max(nodes.slots.values(), default=1) or 1
        od_worker = table[od] / slots
        baseline = productive_worker_s / 3600.0 * od_worker
    elif prices is not None:
        notes.append(
            f"on-demand baseline unknown: {'no price for ' + repr(od) if od else 'no on-demand node type known'}"
            "; pass --on-demand-type NAME (and its price in --prices)"
        )
    savings = baseline - total if baseline is not None and total is not None else None
    prices_json = (
        None
        if prices is None
        else {
            "usd_per_hour": dict(table),
            "markets": dict(prices.markets),
            "on_demand_type": od,
            "source": prices.source,
        }
    )
    return _Cost(
        usage,
        prices_json,
        total,
        od,
        baseline,
        savings,
        od_worker,
        {t: table[t] for t in usage if t in table} if total is not None else {},
    )


def _finite(v: Any) -> Optional[float]:
    """``v`` as a finite float, else None: a metric is whatever the train function reported
    (a NaN loss, an int too large for a float), and the plots need finite numbers."""
    if not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _sync_s(e: Mapping[str, Any]) -> Optional[float]:
    """Time report() blocked the training loop for this checkpoint: staging the files
    locally plus waiting for the previous upload (``stage_s + wait_s``), or ``sync_s``."""
    if isinstance(e.get("sync_s"), (int, float)):
        return float(e["sync_s"])
    parts: List[float] = [e[k] for k in ("stage_s", "wait_s") if isinstance(e.get(k), (int, float))]
    return float(sum(parts)) if parts else None


def _checkpoints(events, t0: float) -> Dict[str, Any]:
    items = [
        {
            "index": e.get("index"),
            "epoch": e.get("epoch"),
            "at_s": float(e["ts"]) - t0,
            "bytes": e.get("bytes"),
            "sync_s": _sync_s(e),
            "async_s": e.get("async_s", e.get("upload_s")),
            "stage_s": e.get("stage_s"),
            "wait_s": e.get("wait_s"),
            "upload_s": e.get("upload_s"),
        }
        for e in events
        if kind_of(e) is EventKind.CHECKPOINT_COMMITTED
    ]

    def stat(key, fn):
        vals = [i[key] for i in items if isinstance(i[key], (int, float))]
        return fn(vals) if vals else None

    return {
        "count": len(items),
        "restored": sum(1 for e in events if kind_of(e) is EventKind.CHECKPOINT_RESTORED),
        "deleted": sum(1 for e in events if kind_of(e) is EventKind.CHECKPOINT_DELETED),
        "invalid": sum(1 for e in events if kind_of(e) is EventKind.CHECKPOINT_INVALID),
        "skipped": sum(1 for e in events if kind_of(e) is EventKind.CHECKPOINT_SKIPPED),
        "bytes_total": stat("bytes", sum),
        "bytes_last": items[-1]["bytes"] if items else None,
        "sync_s_mean": stat("sync_s", statistics.fmean),
        "sync_s_max": stat("sync_s", max),
        "sync_s_total": stat("sync_s", sum),
        "async_s_mean": stat("async_s", statistics.fmean),
        "async_s_max": stat("async_s", max),
        "items": items,
    }
