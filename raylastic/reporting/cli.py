"""``raylastic report RUN_PATH [--json] [--plots DIR] [--prices JSON_OR_PATH] ...``

Exit codes: 0 report printed (warnings, e.g. a truncated last line or an unknown price,
go to stderr and into the report's notes); 2 bad input (not a run, unreadable prices,
a corrupt event log or a field of the wrong type in it, storage errors), one line on
stderr. Never a traceback: the logs are data from a store, possibly damaged. ``--json``
is strict JSON (no NaN/Infinity: a non-finite number is null). Text output escapes
control characters, so a log cannot send escape sequences to the terminal.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import List, Optional, Sequence

from raylastic.reporting.loading import NotARunError, load_run
from raylastic.reporting.model import build_report
from raylastic.reporting.plots import write_plots
from raylastic.reporting.prices import read_prices_arg
from raylastic.reporting.render import render_text

EXIT_OK, EXIT_BAD_INPUT = 0, 2
PROG = "raylastic report"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="What elasticity did in a run and what it saved: world-size timeline, "
        "recoveries, checkpoints, node-hours, cost vs the on-demand baseline, "
        "the bill by phase (training / waiting / recovering / released), "
        "goodput. See docs/report.md.",
    )
    p.add_argument(
        "run_path",
        metavar="RUN_PATH",
        help="the run directory <storage_path>/<name>: a local path, file://, s3://, gs://, abfs:// or az:// URI",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object (stable keys) instead of text")
    p.add_argument("--plots", metavar="DIR", help="write world_size.png, loss.png and cost.png into DIR")
    p.add_argument(
        "--prices",
        metavar="JSON_OR_PATH",
        help="USD per node-hour by node type, inline JSON or a JSON file, e.g. "
        '\'{"spot": 0.9, "on_demand": 3.0}\' (or a price_table record with '
        "usd_per_hour/markets/on_demand_type); overrides the event log's prices",
    )
    p.add_argument(
        "--on-demand-type",
        metavar="NAME",
        help="node type whose price is the on-demand baseline (default: the price "
        "table's on_demand_type, else the cheapest on-demand type)",
    )
    p.add_argument("--metric", default="loss", metavar="KEY", help="metric plotted as the loss (default: loss)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``raylastic report``; returns the exit code (0, or 2 with one line on
    stderr) and never raises: an unexpected error is a bug, reported in one line too."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return e.code if isinstance(e.code, int) else EXIT_OK if e.code is None else EXIT_BAD_INPUT
    try:
        return _run(args)
    except BrokenPipeError:  # `raylastic report ... | head`
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - never a traceback (module docstring)
        return _error(f"internal error (please report it): {type(e).__name__}: {e}")


# C0/C1 controls and lone surrogates (from "\udc80"-style escapes in a log): printed as
# escapes, so a log cannot move the cursor or recolour a terminal, nor fail the encoder.
_UNPRINTABLE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _printable(text: str, stream, *, one_line: bool = False) -> str:
    """``text`` as ``stream`` can print it: controls escaped (newlines too if
    ``one_line``), characters its encoding lacks backslash-escaped."""
    text = _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], text)
    if one_line:
        text = text.replace("\n", "\\n")
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        return text.encode(encoding, "backslashreplace").decode(encoding)
    except LookupError:
        return text.encode("ascii", "backslashreplace").decode("ascii")


def _error(msg: str) -> int:
    print(_printable(f"{PROG}: error: {msg}", sys.stderr, one_line=True), file=sys.stderr)
    return EXIT_BAD_INPUT


def _run(args: argparse.Namespace) -> int:
    # The storage seam imports pyarrow (~0.2 s): not for `--help` or a usage error.
    from raylastic.checkpoint.storage import StorageError

    prices = None
    if args.prices:
        try:
            prices = read_prices_arg(args.prices)
        except ValueError as e:
            return _error(str(e))
    try:
        data = load_run(args.run_path)
        report = build_report(
            data.events,
            data.metrics,
            prices,
            run_path=args.run_path,
            on_demand_type=args.on_demand_type,
            loss_key=args.metric,
            notes=data.notes,
        )
    except NotARunError as e:
        return _error(str(e))
    except (StorageError, ValueError, OSError) as e:  # CorruptLogError is a ValueError
        return _error(f"cannot read {args.run_path}: {e}")
    for note in _warnings(report.notes):
        print(_printable(f"{PROG}: warning: {note}", sys.stderr, one_line=True), file=sys.stderr)
    if args.json:  # strict JSON: to_json() has no NaN/Infinity, and allow_nan=False checks
        print(json.dumps(report.to_json(), indent=2, sort_keys=False, allow_nan=False, default=str))
    else:
        sys.stdout.write(_printable(render_text(report), sys.stdout))
    if args.plots:
        try:
            paths = write_plots(report, args.plots)
        except (RuntimeError, OSError, ValueError, OverflowError) as e:
            return _error(f"--plots {args.plots}: {e}")
        print(_printable(f"{PROG}: wrote {', '.join(paths)}", sys.stderr, one_line=True), file=sys.stderr)
    return EXIT_OK


def _warnings(notes: Sequence[str]) -> List[str]:
    """Notes that need attention (the rest are explanations shown in the report)."""
    keys = ("truncated", "no hourly price", "no price table", "baseline unknown", "no metrics")
    return [n for n in notes if any(k in n for k in keys)]
