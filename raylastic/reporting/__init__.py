"""``raylastic report RUN_PATH``: what elasticity did to a run and what it saved.

:func:`build_report` turns a run's event log and metrics into a :class:`RunReport`
(world-size timeline, recoveries, checkpoints, node-hours, cost vs the on-demand baseline,
the bill by phase, goodput); :func:`load_run` reads them from any storage path. See
docs/report.md.

Modules, each importing only those before it: ``records`` (the frozen values),
``prices``, ``loading``, ``_walk`` / ``_steps`` / ``_nodes`` / ``bill`` (the passes),
``model`` (:func:`build_report`), then ``render``, ``plots`` and ``cli``.
"""

from __future__ import annotations

from raylastic.reporting.loading import NotARunError, RunData, load_run
from raylastic.reporting.model import build_report
from raylastic.reporting.prices import Prices, parse_prices, read_prices_arg
from raylastic.reporting.records import JSON_KEYS, RunReport

__all__ = [
    "JSON_KEYS",
    "NotARunError",
    "Prices",
    "RunData",
    "RunReport",
    "build_report",
    "load_run",
    "parse_prices",
    "read_prices_arg",
]
