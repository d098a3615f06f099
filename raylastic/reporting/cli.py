"""``raylastic report RUN_PATH [--json] [--plots DIR] [--prices JSON_OR_PATH] ...``

Exit codes: 0 report printed (warnings, e.g. a truncated last line or an unknown price,
go to stderr and into the report's notes); 2 bad input (not a run, unreadable prices,
a corrupt event log, storage errors). Never a traceback for bad input.
"""

from __future__ import annotations

import argparse
import json
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
                    "goodput. See docs/report.md.")
    p.add_argument("run_path", metavar="RUN_PATH",
                   help="the run directory <storage_path>/<name>: a local path, file://, "
                        "s3://, gs://, abfs:// or az:// URI")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (stable keys) instead of text")
    p.add_argument("--plots", metavar="DIR",
                   help="write world_size.png, loss.png and cost.png into DIR")
    p.add_argument("--prices", metavar="JSON_OR_PATH",
                   help="USD per node-hour by node type, inline JSON or a JSON file, e.g. "
                        "'{\"spot\": 0.9, \"on_demand\": 3.0}' (or a price_table record with "
                        "usd_per_hour/markets/on_demand_type); overrides the event log's prices")
    p.add_argument("--on-demand-type", metavar="NAME",
                   help="node type whose price is the on-demand baseline (default: the price "
                        "table's on_demand_type, else the cheapest on-demand type)")
    p.add_argument("--metric", default="loss", metavar="KEY",
                   help="metric plotted as the loss (default: loss)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``raylastic report``; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help (0) or a usage error (2, message already printed)
        return int(e.code or 0)
    try:
        return _run(args)
    except BrokenPipeError:  # `raylastic report ... | head`
        return EXIT_OK


def _error(msg: str) -> int:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
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
    except NotARunError as e:
        return _error(str(e))
    except (StorageError, ValueError, OSError) as e:
        return _error(f"cannot read {args.run_path}: {e}")
    report = build_report(data.events, data.metrics, prices, run_path=args.run_path,
                          on_demand_type=args.on_demand_type, loss_key=args.metric,
                          notes=data.notes)
    for note in _warnings(report.notes):
        print(f"{PROG}: warning: {note}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json(), indent=2, sort_keys=False, default=str))
    else:
        sys.stdout.write(render_text(report))
    if args.plots:
        try:
            paths = write_plots(report, args.plots)
        except (RuntimeError, OSError) as e:
            return _error(f"--plots {args.plots}: {e}")
        print(f"{PROG}: wrote {', '.join(paths)}", file=sys.stderr)
    return EXIT_OK


def _warnings(notes: Sequence[str]) -> List[str]:
    """Notes that need attention (the rest are explanations shown in the report)."""
    keys = ("truncated", "no hourly price", "no price table", "baseline unknown", "no metrics")
    return [n for n in notes if any(k in n for k in keys)]
