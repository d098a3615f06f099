"""``raylastic report RUN_PATH``: what elasticity did to a run and what it saved.

:func:`build_report` turns a run's event log and metrics into a :class:`RunReport`
(world-size timeline, recoveries, checkpoints, node-hours, cost vs the on-demand baseline,
goodput); :func:`load_run` reads them from any storage path. See docs/report.md.
"""

from __future__ import annotations

from raylastic.reporting.model import (
    JSON_KEYS,
    NotARunError,
    Prices,
    RunData,
    RunReport,
    build_report,
    load_run,
    parse_prices,
    read_prices_arg,
)

__all__ = ["JSON_KEYS", "NotARunError", "Prices", "RunData", "RunReport", "build_report",
           "load_run", "parse_prices", "read_prices_arg"]
