"""``raylastic report RUN_PATH``: what elasticity did to a run and what it saved.

:func:`build_report` turns a run's event log and metrics into a :class:`RunReport`
(world-size timeline, recoveries, checkpoints, node-hours, cost vs the on-demand baseline,
goodput); :func:`load_run` reads them from any storage path. See docs/report.md.

Name clash, handled: ``raylastic.report`` is also the public ``report(metrics, checkpoint)``
function that train functions call. Importing this package makes Python set the
``raylastic.report`` attribute to this module, so the module is made callable and forwards
calls to :func:`raylastic.session.report`; ``raylastic.report({...})`` keeps working
whichever of the two the attribute holds.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from raylastic.report.model import (
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


class _CallableReportModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from raylastic.session import report

        return report(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableReportModule
