"""What elasticity did and what it cost: a pure function from a run's event log and
metrics to a frozen :class:`RunReport`, plus loading them from any storage path.

Every number is derived from ``events.jsonl`` and ``metrics.jsonl`` alone (see
docs/events.md for the schema and docs/report.md for every formula). Times in the report
are seconds since the run's first event. Nothing here imports Ray or torch.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from raylastic.events import EVENTS_FILE, METRICS_FILE, read_jsonl

__all__ = [
    "SCHEMA_VERSION", "JSON_KEYS", "NotARunError", "Prices", "RunData", "RunReport",
    "build_report", "load_run", "parse_prices", "read_prices_arg",
]

SCHEMA_VERSION = 1
DEFAULT_NODE_TYPE = "default"  # node-hours of workers whose worker_ready has no node_type
PRICE_KINDS = ("price_table", "prices")  # "prices" is PriceTable.to_record()'s kind
_SKEW_S = 2.0  # tolerated clock skew between rank 0 (metrics ts) and the controller

JSON_KEYS = (
    "schema_version", "run_path", "status", "error", "start_ts", "end_ts", "wall_s",
    "productive_step_s", "goodput", "steps", "world_size_timeline", "recoveries", "resizes",
    "checkpoints", "node_hours", "prices", "cost_usd", "on_demand_type", "on_demand_cost_usd",
    "savings_usd", "savings_pct", "productive_worker_s", "notes",
)


class NotARunError(ValueError):
    """The path holds no raylastic run (no readable events.jsonl)."""


# ----------------------------------------------------------------------------- prices

@dataclass(frozen=True)
class Prices:
    """USD per node-hour per node type, each type's market, and the baseline's type."""

    usd_per_hour: Dict[str, float] = field(default_factory=dict)
    markets: Dict[str, str] = field(default_factory=dict)
    on_demand_type: Optional[str] = None
    source: str = ""

    def merged(self, override: Optional["Prices"]) -> "Prices":
        """``override`` (e.g. --prices) wins key by key."""
        if override is None:
            return self
        return Prices({**self.usd_per_hour, **override.usd_per_hour},
                      {**self.markets, **override.markets},
                      override.on_demand_type or self.on_demand_type,
                      " + ".join(s for s in (self.source, override.source) if s))


def parse_prices(obj: Any, source: str) -> Prices:
    """A flat ``{node_type: usd_per_hour}`` mapping, or a ``price_table`` record
    (``usd_per_hour``, ``markets``, ``on_demand_type``). ValueError names the bad entry."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"{source}: prices must be a JSON object (node type -> USD per hour)")
    record = "usd_per_hour" in obj
    table = obj.get("usd_per_hour") if record else obj
    if not isinstance(table, Mapping):
        raise ValueError(f"{source}: usd_per_hour must be an object (node type -> USD per hour)")
    usd = {}
    for name, price in table.items():
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not (
                math.isfinite(price) and price >= 0):
            raise ValueError(f"{source}: price for node type {name!r} is {price!r}; "
                             "use a finite number of USD per hour >= 0")
        usd[str(name)] = float(price)
    markets = dict(obj.get("markets") or {}) if record else {}
    for name, market in markets.items():
        if market not in ("spot", "on_demand"):
            raise ValueError(f"{source}: market of {name!r} is {market!r}; use 'spot' or 'on_demand'")
    od = obj.get("on_demand_type") if record else None
    return Prices(usd, markets, od, str(obj.get("source") or source) if record else source)


def read_prices_arg(arg: str) -> Prices:
    """``--prices``: inline JSON (starts with ``{``) or a path to a JSON file."""
    text, source = arg, "--prices"
    if not arg.lstrip().startswith("{"):
        try:
            with open(arg, encoding="utf-8") as fh:
                text, source = fh.read(), arg
        except OSError as e:
            raise ValueError(f"--prices {arg!r}: not inline JSON and not a readable file "
                             f"({e.strerror or e})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--prices ({source}) is not valid JSON: {e}") from None
    return parse_prices(obj, source)


# ----------------------------------------------------------------------------- loading

@dataclass(frozen=True)
class RunData:
    path: str
    events: List[Dict[str, Any]]
    metrics: List[Dict[str, Any]]
    notes: Tuple[str, ...] = ()


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def _captured_warnings() -> Iterator[List[str]]:
    """read_jsonl warns through the 'raylastic' logger; keep those as report notes."""
    log, handler = logging.getLogger("raylastic"), _Capture()
    log.addHandler(handler)
    try:
        yield handler.messages
    finally:
        log.removeHandler(handler)


def load_run(path: str) -> RunData:
    """Read a run directory (local path, file://, s3://, gs://, abfs://, az://).

    NotARunError when there is no event log (naming runs found one level below);
    ValueError for a corrupt line that is not the last one; StorageError from the store."""
    from raylastic.checkpoint.storage import Storage

    storage = Storage(path)
    try:
        raw = storage.read_bytes(EVENTS_FILE)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise NotARunError(_not_a_run_message(storage, path)) from None
    try:
        metrics_raw = storage.read_bytes(METRICS_FILE)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        metrics_raw = b""
    with _captured_warnings() as notes:
        events = [e for e in read_jsonl(raw.decode("utf-8", "replace"), f"{path}/{EVENTS_FILE}")
                  if isinstance(e, dict) and "ts" in e and "kind" in e]
        metrics = [m for m in read_jsonl(metrics_raw.decode("utf-8", "replace"),
                                         f"{path}/{METRICS_FILE}")
                   if isinstance(m, dict) and "ts" in m and "index" in m]
    if not events:
        raise NotARunError(f"{path}: {EVENTS_FILE} holds no events (the run never started, "
                           "or the file is not a raylastic event log)")
    if not metrics_raw:
        notes.append(f"no {METRICS_FILE} in {path}: steps and goodput are unknown")
    return RunData(path, events, metrics, tuple(notes))


def _not_a_run_message(storage, path: str) -> str:
    head = f"{path} is not a raylastic run directory: it has no {EVENTS_FILE}"
    try:
        children = storage.list_dir("")
    except Exception:  # noqa: BLE001 - the hint is best effort
        children = []
    if not children and not storage.exists(""):
        return f"{path} does not exist (expected a run directory <storage_path>/<name>)"
    runs = [c for c in children[:50] if _safe_exists(storage, f"{c}/{EVENTS_FILE}")]
    if runs:
        shown = ", ".join(runs[:10]) + (" ..." if len(runs) > 10 else "")
        return (f"{head}; it looks like a storage_path holding runs: {shown}. "
                f"Try: raylastic report {path.rstrip('/')}/{runs[0]}")
    return f"{head} (expected <storage_path>/<name>/{EVENTS_FILE}, written by fit())"


def _safe_exists(storage, rel: str) -> bool:
    try:
        return storage.exists(rel)
    except Exception:  # noqa: BLE001
        return False


# ----------------------------------------------------------------------------- report values

@dataclass(frozen=True)
class Segment:
    """One membership epoch: ``world_size`` workers trained from ``start_s`` to ``end_s``."""
    epoch: int
    world_size: int
    start_s: float
    end_s: float
    restore_index: int
    ended_by: str


@dataclass(frozen=True)
class Recovery:
    """Workers lost (or a rank failed) -> training resumed. Losses before training resumed
    are merged into one recovery."""
    at_s: float
    cause: str
    nodes: Tuple[str, ...]
    detection_s: float
    recovery_s: Optional[float]
    steps_lost: int
    reached_index: Optional[int]
    restore_index: Optional[int]
    world_size_before: Optional[int]
    world_size_after: Optional[int]
    reason: str


@dataclass(frozen=True)
class Resize:
    at_s: float
    graceful: bool
    from_world_size: Optional[int]
    to_world_size: Optional[int]
    lost_steps: int
    resize_s: Optional[float]
    pause_s: Optional[float]
    reached_index: Optional[int]
    reason: str


@dataclass(frozen=True)
class NodeTypeUsage:
    market: Optional[str]
    nodes: int
    hours: float
    usd_per_hour: Optional[float]
    cost_usd: Optional[float]


@dataclass(frozen=True)
class Series:
    """Plot data (not part of --json)."""
    loss: Tuple[Tuple[float, int, float, bool], ...]  # (t_s, index, value, kept)
    cost: Tuple[Tuple[float, float, Optional[float], Optional[float]], ...]  # t, node-h, cost, baseline
    loss_key: str = "loss"


@dataclass(frozen=True)
class RunReport:
    run_path: str
    status: str  # finished | failed | incomplete
    error: Optional[str]
    start_ts: float
    end_ts: float
    wall_s: float
    productive_step_s: float
    goodput: Optional[float]
    steps: Dict[str, Optional[int]]
    world_size_timeline: Tuple[Segment, ...]
    recoveries: Tuple[Recovery, ...]
    resizes: Tuple[Resize, ...]
    checkpoints: Dict[str, Any]
    node_hours: Dict[str, NodeTypeUsage]
    prices: Optional[Dict[str, Any]]
    cost_usd: Optional[float]
    on_demand_type: Optional[str]
    on_demand_cost_usd: Optional[float]
    savings_usd: Optional[float]
    savings_pct: Optional[float]
    productive_worker_s: float
    notes: Tuple[str, ...]
    series: Series = field(repr=False, compare=False, default=Series((), ()))

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict with the keys of :data:`JSON_KEYS`, in that order."""
        d = asdict(self)
        d.pop("series")
        d["schema_version"] = SCHEMA_VERSION
        d["notes"] = list(self.notes)
        return {k: d[k] for k in JSON_KEYS}


# ----------------------------------------------------------------------------- computing

def build_report(events: Sequence[Mapping[str, Any]], metrics: Sequence[Mapping[str, Any]],
                 prices: Optional[Prices] = None, *, run_path: str = "",
                 on_demand_type: Optional[str] = None, loss_key: str = "loss",
                 notes: Sequence[str] = ()) -> RunReport:
    """The report of one run. ``prices`` (e.g. from --prices) override the event log's."""
    from raylastic.reporting import _timeline as tl

    events = [e for e in events if isinstance(e.get("ts"), (int, float))]
    if not events:
        raise NotARunError(f"{run_path or 'run'}: no events")
    notes = list(notes)
    t0 = float(events[0]["ts"])
    sessions = tl.sessions(events, metrics)
    wall_s = sum(end - start for start, end in sessions)
    walk = tl.walk(events, metrics, sessions, t0)
    steps_info = tl.step_times(metrics, walk.groups)
    nodes = tl.node_intervals(events, sessions)
    if nodes.approximated:
        notes.append("no worker_ready events (older run): node-hours are approximated from "
                     "group membership (group_formed.nodes)")
    effective = _effective_prices(events, prices)
    cost = _cost(nodes, effective, steps_info.productive_worker_s, on_demand_type, notes)
    last_finish = next((e for e in reversed(events) if e["kind"] in ("run_finished", "run_failed",
                                                                     "run_started")), None)
    status = {"run_finished": "finished", "run_failed": "failed"}.get(
        last_finish["kind"] if last_finish else "", "incomplete")
    error = str(last_finish.get("message") or last_finish.get("error")) if status == "failed" else None
    if status == "incomplete":
        notes.append("the run has no run_finished/run_failed event: it is still running or "
                     "crashed; numbers cover up to its last event")
    final_index = max((m["index"] for m, kept in zip(metrics, steps_info.kept) if kept), default=None)
    if status == "finished" and last_finish.get("index") is not None:
        final_index = last_finish["index"]
    steps = {
        "final_index": final_index,
        "kept": sum(steps_info.kept),
        "reported": len(metrics),
        "retrained": len(metrics) - sum(steps_info.kept),
        "lost": sum(r.lost_steps for r in walk.resizes),
    }
    series = Series(
        loss=tuple((float(m["ts"]) - t0, int(m["index"]), float(m["metrics"][loss_key]), kept)
                   for m, kept in zip(metrics, steps_info.kept)
                   if isinstance((m.get("metrics") or {}).get(loss_key), (int, float))),
        cost=tl.cost_series(nodes, cost.price_of, steps_info, cost.od_worker_usd_h, t0,
                            sessions),
        loss_key=loss_key,
    )
    productive = steps_info.productive_s
    return RunReport(
        run_path=run_path, status=status, error=error, start_ts=t0, end_ts=sessions[-1][1],
        wall_s=wall_s, productive_step_s=productive,
        goodput=(productive / wall_s) if wall_s > 0 and metrics else None,
        steps=steps, world_size_timeline=tuple(walk.segments), recoveries=tuple(walk.recoveries),
        resizes=tuple(walk.resizes), checkpoints=_checkpoints(events, t0),
        node_hours=cost.usage, prices=cost.prices_json, cost_usd=cost.total,
        on_demand_type=cost.od_type, on_demand_cost_usd=cost.baseline,
        savings_usd=cost.savings,
        savings_pct=(cost.savings / cost.baseline * 100.0)
        if cost.savings is not None and cost.baseline else None,
        productive_worker_s=steps_info.productive_worker_s, notes=tuple(notes), series=series,
    )


def _effective_prices(events, override: Optional[Prices]) -> Optional[Prices]:
    recorded = None
    for e in events:
        if e["kind"] in PRICE_KINDS:
            try:
                recorded = parse_prices(e, f"{e['kind']} event")
            except ValueError:
                continue
    if recorded is None:
        return override
    return recorded.merged(override)


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


def _cost(nodes, prices: Optional[Prices], productive_worker_s: float,
          od_override: Optional[str], notes: List[str]) -> _Cost:
    table = dict(prices.usd_per_hour) if prices else {}
    markets = dict(prices.markets) if prices else {}
    for t, m in nodes.markets.items():
        markets.setdefault(t, m)
    usage = {}
    for t in sorted(nodes.hours):
        price = table.get(t)
        usage[t] = NodeTypeUsage(markets.get(t), nodes.count[t], nodes.hours[t], price,
                                 nodes.hours[t] * price if price is not None else None)
    missing = sorted(t for t in usage if t not in table)
    if prices is None:
        notes.append("no price table in the event log: cost is unknown; pass --prices "
                     "'{\"<node_type>\": <USD per hour>, ...}'")
    elif missing:
        notes.append(f"no hourly price for node type(s) {missing} used by this run (prices from "
                     f"{prices.source or '?'} cover {sorted(table)}): cost is unknown; pass "
                     f"--prices '{{\"{missing[0]}\": <USD per hour>}}'")
    total = sum(u.cost_usd for u in usage.values()) if usage and not missing and prices else None
    if prices is not None and not usage:
        total = 0.0
    od = od_override or (prices.on_demand_type if prices else None)
    if od is None:
        candidates = sorted((table[t], t) for t, m in markets.items() if m == "on_demand" and t in table)
        if candidates:
            od = candidates[0][1]
        elif len(table) == 1 and not any(m == "on_demand" for m in markets.values()) and (
                not markets or all(m is None for m in markets.values())):
            od = next(iter(table))  # a run without node types: its one type is the baseline
    baseline = od_worker = None
    if od is not None and od in table:
        slots = nodes.slots.get(od) or max(nodes.slots.values(), default=1) or 1
        od_worker = table[od] / slots
        baseline = productive_worker_s / 3600.0 * od_worker
    elif prices is not None:
        notes.append(f"on-demand baseline unknown: {'no price for ' + repr(od) if od else 'no on-demand node type known'}"
                     "; pass --on-demand-type NAME (and its price in --prices)")
    savings = baseline - total if baseline is not None and total is not None else None
    prices_json = None if prices is None else {
        "usd_per_hour": dict(table), "markets": dict(prices.markets),
        "on_demand_type": od, "source": prices.source}
    return _Cost(usage, prices_json, total, od, baseline, savings, od_worker,
                 {t: table[t] for t in usage if t in table} if total is not None else {})


def _sync_s(e: Mapping[str, Any]) -> Optional[float]:
    """Time report() blocked the training loop for this checkpoint: staging the files
    locally plus waiting for the previous upload (``stage_s + wait_s``), or ``sync_s``."""
    if isinstance(e.get("sync_s"), (int, float)):
        return float(e["sync_s"])
    parts = [e.get(k) for k in ("stage_s", "wait_s") if isinstance(e.get(k), (int, float))]
    return float(sum(parts)) if parts else None


def _checkpoints(events, t0: float) -> Dict[str, Any]:
    items = [{
        "index": e.get("index"), "epoch": e.get("epoch"), "at_s": float(e["ts"]) - t0,
        "bytes": e.get("bytes"), "sync_s": _sync_s(e),
        "async_s": e.get("async_s", e.get("upload_s")),
        "stage_s": e.get("stage_s"), "wait_s": e.get("wait_s"), "upload_s": e.get("upload_s"),
    } for e in events if e["kind"] == "checkpoint_committed"]

    def stat(key, fn):
        vals = [i[key] for i in items if isinstance(i[key], (int, float))]
        return fn(vals) if vals else None

    return {
        "count": len(items),
        "restored": sum(1 for e in events if e["kind"] == "checkpoint_restored"),
        "deleted": sum(1 for e in events if e["kind"] == "checkpoint_deleted"),
        "invalid": sum(1 for e in events if e["kind"] == "checkpoint_invalid"),
        "bytes_total": stat("bytes", sum), "bytes_last": items[-1]["bytes"] if items else None,
        "sync_s_mean": stat("sync_s", statistics.fmean), "sync_s_max": stat("sync_s", max),
        "sync_s_total": stat("sync_s", sum),
        "async_s_mean": stat("async_s", statistics.fmean), "async_s_max": stat("async_s", max),
        "items": items,
    }
