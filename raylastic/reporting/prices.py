"""Prices for the report's cost: the table the run recorded in its event log, overridden
key by key by ``--prices``. Validation names the bad entry, because a typo in a price
should say which node type it broke, not produce a wrong cost."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence

from raylastic.events import EventKind

# The kinds of event that carry a price table: the capacity driver's ``price_table``, and
# ``prices``, the kind of ``PriceTable.to_record()`` (not an EventKind: users append it).
PRICE_KINDS = (EventKind.PRICE_TABLE.value, "prices")


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
        return Prices(
            {**self.usd_per_hour, **override.usd_per_hour},
            {**self.markets, **override.markets},
            override.on_demand_type or self.on_demand_type,
            " + ".join(s for s in (self.source, override.source) if s),
        )


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
        if (
            isinstance(price, bool) or not isinstance(price, (int, float)) or not (0 <= price <= sys.float_info.max)
        ):  # NaN, inf and ints beyond floats fail
            raise ValueError(
                f"{source}: price for node type {name!r} is {shown_value(price)}; "
                "use a finite number of USD per hour >= 0"
            )
        usd[str(name)] = float(price)
    markets = (obj.get("markets") or {}) if record else {}
    if not isinstance(markets, Mapping):
        raise ValueError(f"{source}: markets must be an object (node type -> 'spot' or 'on_demand')")
    markets = {str(name): market for name, market in markets.items()}
    for name, market in markets.items():
        if not isinstance(market, str) or market not in ("spot", "on_demand"):
            raise ValueError(f"{source}: market of {name!r} is {shown_value(market)}; use 'spot' or 'on_demand'")
    od = obj.get("on_demand_type") if record else None
    if od is not None and not isinstance(od, str):
        raise ValueError(f"{source}: on_demand_type is {shown_value(od)}; use a node type name")
    recorded = obj.get("source") if record else None
    return Prices(usd, markets, od, recorded if isinstance(recorded, str) and recorded else source)


def shown_value(value: Any) -> str:
    """A value read from a file, for an error message: its repr cut at 60 characters, and
    never a RecursionError (a JSON value can nest deeper than repr() can go)."""
    try:
        text = repr(value)
    except RecursionError:
        return "(a value nested too deep)"
    return text if len(text) <= 60 else text[:57] + "..."


def read_prices_arg(arg: str) -> Prices:
    """``--prices``: inline JSON (starts with ``{``) or a path to a JSON file."""
    text, source = arg, "--prices"
    if not arg.lstrip().startswith("{"):
        try:
            with open(arg, encoding="utf-8") as fh:
                text, source = fh.read(), arg
        except OSError as e:
            raise ValueError(f"--prices {arg!r}: not inline JSON and not a readable file ({e.strerror or e})") from None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError; too deep; too many digits
        raise ValueError(f"--prices ({source}) is not valid JSON: {e}") from None
    return parse_prices(obj, source)


def effective_prices(events: Sequence[Mapping[str, Any]], override: Optional[Prices]) -> Optional[Prices]:
    """The last valid price table recorded in the log, with ``override`` on top (a broken
    recorded table is skipped: the one before it, or ``--prices``, still prices the run)."""
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
