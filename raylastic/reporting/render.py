"""Plain-text rendering of a :class:`~raylastic.reporting.model.RunReport` (fixed-width
tables, no colour, so it reads the same in a terminal, a CI log and an email)."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

from raylastic.reporting.records import PhaseCost, RunReport

# The bill table's columns: (bucket of records.Bill, header).
_BILL_COLUMNS = (
    ("training", "training"),
    ("waiting", "waiting"),
    ("recovering", "recovering"),
    ("released", "released-but-billed"),
)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> List[str]:
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]
    line = lambda cells: (
        indent
        + "  ".join(  # noqa: E731
            str(c).ljust(w) if i == len(widths) - 1 else str(c).rjust(w) if _numeric(c) else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()
    )
    return [line(headers)] + [line(r) for r in rows]


def _numeric(cell: object) -> bool:
    text = str(cell).replace(".", "", 1).replace("-", "", 1).replace("%", "").replace("$", "")
    return text.isdigit()


def fmt_s(seconds: Optional[float]) -> str:
    if seconds is None:
        return "-"
    if not math.isfinite(seconds):  # an overflowed sum: say so, never crash on it
        return str(seconds)
    if abs(seconds) < 120:
        return f"{seconds:.2f}" if abs(seconds) < 10 else f"{seconds:.1f}"
    m, s = divmod(int(round(seconds)), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def fmt_usd(usd: Optional[float]) -> str:
    if usd is None:
        return "unknown"
    sign = "-" if usd < 0 else ""
    return f"{sign}${abs(usd):,.2f}" if abs(usd) >= 100 else f"{sign}${abs(usd):.4f}"


def fmt_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return str(n)


def _short(text: str, n: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 3] + "..."


def render_text(r: RunReport, *, max_rows: int = 40) -> str:
    out: List[str] = [f"raylastic report: {r.run_path}"]
    status = r.status + (f" ({_short(r.error, 100)})" if r.error else "")
    steps = r.steps
    out += [
        f"  status            {status}",
        f"  wall time         {fmt_s(r.wall_s)} s",
        f"  productive steps  {fmt_s(r.productive_step_s)} s   goodput "
        + (f"{r.goodput * 100:.1f} %" if r.goodput is not None else "unknown"),
        f"  steps             final index {steps['final_index'] if steps['final_index'] is not None else '-'}: "
        f"{steps['kept']} kept of {steps['reported']} reported "
        f"({steps['retrained']} re-trained after a restore; resize events: {steps['lost']} lost)",
        "",
        "World size timeline (t = seconds since the run started)",
    ]
    seg_rows = [
        (fmt_s(s.start_s), fmt_s(s.end_s), s.epoch, s.world_size, s.restore_index, s.ended_by)
        for s in r.world_size_timeline
    ]
    out += (
        _limited(_table(["from", "to", "epoch", "world", "restored", "ended by"], seg_rows), max_rows)
        if seg_rows
        else ["  (no group was ever formed)"]
    )
    out += ["", f"Recoveries (failures / preemptions): {len(r.recoveries)}"]
    rows: List[Sequence[object]]
    if r.recoveries:
        rows = [
            (
                fmt_s(x.at_s),
                x.cause,
                ",".join(n[-8:] for n in x.nodes) or "-",
                fmt_s(x.detection_s),
                fmt_s(x.recovery_s) if x.recovery_s is not None else "not recovered",
                x.steps_lost,
                f"{_ws(x.world_size_before)} -> {_ws(x.world_size_after)}",
                _short(x.reason, 50),
            )
            for x in r.recoveries
        ]
        out += _limited(
            _table(["at", "cause", "nodes", "detect s", "recovery s", "steps lost", "world", "reason"], rows), max_rows
        )
    graceful = [z for z in r.resizes if z.graceful]
    out += ["", f"Graceful resizes: {len(graceful)}"]
    if graceful:
        rows = [
            (
                fmt_s(z.at_s),
                f"{_ws(z.from_world_size)} -> {_ws(z.to_world_size)}",
                z.reached_index if z.reached_index is not None else "-",
                fmt_s(z.resize_s),
                fmt_s(z.pause_s),
                z.lost_steps,
                _short(z.reason, 50),
            )
            for z in graceful
        ]
        out += _limited(
            _table(["at", "world", "at step", "resize s", "pause s", "steps lost", "reason"], rows), max_rows
        )
    out += ["", *_checkpoint_lines(r), "", "Node-hours and cost"]
    if r.node_hours:
        rows = [
            (
                t,
                u.market or "-",
                u.nodes,
                f"{u.hours:.4f}",
                f"{u.usd_per_hour:.3f}" if u.usd_per_hour is not None else "unknown",
                fmt_usd(u.cost_usd),
            )
            for t, u in r.node_hours.items()
        ]
        rows.append(
            (
                "total",
                "",
                sum(u.nodes for u in r.node_hours.values()),
                f"{sum(u.hours for u in r.node_hours.values()):.4f}",
                "",
                fmt_usd(r.cost_usd),
            )
        )
        out += _table(["node type", "market", "nodes", "node-hours", "USD/h", "cost"], rows)
    else:
        out.append("  (no worker held a slot)")
    out += _cost_lines(r)
    out += _bill_lines(r)
    if r.notes:
        out += ["", "Notes"] + [f"  - {n}" for n in r.notes]
    return "\n".join(out) + "\n"


def _ws(n: Optional[int]) -> str:
    return "-" if n is None else str(n)


def _limited(lines: List[str], max_rows: int) -> List[str]:
    if len(lines) <= max_rows + 1:
        return lines
    return lines[: max_rows + 1] + [f"  ... {len(lines) - max_rows - 1} more (see --json)"]


def _checkpoint_lines(r: RunReport) -> List[str]:
    c = r.checkpoints
    invalid = f", {c['invalid']} found damaged" if c.get("invalid") else ""
    invalid += f", {c['skipped']} skipped (upload busy)" if c.get("skipped") else ""
    if not c["count"]:
        return [f"Checkpoints: none committed ({c['restored']} restored{invalid})"]
    lines = [
        f"Checkpoints: {c['count']} committed, {c['restored']} restored, {c['deleted']} "
        f"deleted by retention{invalid}; size {fmt_bytes(c['bytes_last'])} (last), "
        f"{fmt_bytes(c['bytes_total'])} written"
    ]
    if c["sync_s_mean"] is not None:
        lines.append(
            f"  sync (training blocked)  mean {fmt_s(c['sync_s_mean'])} s, max "
            f"{fmt_s(c['sync_s_max'])} s, total {fmt_s(c['sync_s_total'])} s"
        )
    if c["async_s_mean"] is not None:
        lines.append(f"  async (upload)           mean {fmt_s(c['async_s_mean'])} s, max {fmt_s(c['async_s_max'])} s")
    return lines


def _bill_lines(r: RunReport) -> List[str]:
    """Billed node-seconds (and USD) by what the nodes were doing, per node type."""
    if not r.bill.by_node_type:
        return []
    lines = [*r.bill.by_node_type.items(), ("total", r.bill.total)]
    cells = [p for _, phases in lines for p in phases.values()]
    s_w = max(len(f"{p.node_s:.1f}") for p in cells)
    usd_w = max(len(fmt_usd(p.usd)) for p in cells)
    rows = [(t, *(_bill_cell(phases[b], s_w, usd_w) for b, _ in _BILL_COLUMNS)) for t, phases in lines]
    return ["", "Bill by phase (node-seconds, USD)"] + _table(["node type", *(h for _, h in _BILL_COLUMNS)], rows)


def _bill_cell(p: PhaseCost, s_w: int, usd_w: int) -> str:
    return f"{p.node_s:.1f}".rjust(s_w) + " s" + (f"  {fmt_usd(p.usd).rjust(usd_w)}" if p.usd is not None else "")


def _cost_lines(r: RunReport) -> List[str]:
    out = ["", f"  cost                 {fmt_usd(r.cost_usd)}"]
    if r.on_demand_type is not None or r.on_demand_cost_usd is not None:
        out.append(
            f"  on-demand baseline   {fmt_usd(r.on_demand_cost_usd)}  "
            f"({r.productive_worker_s / 3600:.4f} productive worker-hours on "
            f"{r.on_demand_type or '?'})"
        )
    else:
        out.append("  on-demand baseline   unknown")
    if r.savings_usd is not None:
        pct = f" ({r.savings_pct:.1f} % of the baseline)" if r.savings_pct is not None else ""
        out.append(f"  savings              {fmt_usd(r.savings_usd)}{pct}")
    else:
        out.append("  savings              unknown")
    return out
