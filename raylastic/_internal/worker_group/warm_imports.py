"""The slow imports a worker makes before it counts as ready: those the group's running
workers made in their train functions.

Why: a worker that joins a running group (a scale-up, a replacement) runs the train
function for the first time while the others wait for it at the first collective, so
every library that function imports lazily lengthens the whole group's pause. The
costliest are torch's own: the first optimizer built in a process imports
``torch._dynamo`` (1.3 s here), and DeepSpeed's first ``initialize`` also imports
``torch._inductor`` (2.6 s for a fresh process's first ZeRO-3 engine, 0.27 s for the next
one; 0.36 s with both imported before; measured 2026-12-08 on this 2-core VM). The running
workers report which of ``SLOW_IMPORTS`` they hold (``PollResult.imported``); the pool
starts new workers with that list, and they import it in their constructor, before
``info()`` answers and so before they can join.

Only torch's internals are listed: importing a user library (DeepSpeed, transformers)
before the train function would run its import-time setup before the train function's
own (an ``os.environ`` it sets first, an accelerator it picks).
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import Iterable, Tuple

logger = logging.getLogger(__name__)

# Slow to import, imported lazily by common train functions (see the module docstring).
SLOW_IMPORTS: Tuple[str, ...] = ("torch._dynamo", "torch._inductor.compile_fx")


def imported() -> Tuple[str, ...]:
    """Which of ``SLOW_IMPORTS`` this process has imported."""
    return tuple(m for m in SLOW_IMPORTS if m in sys.modules)


def warm(modules: Iterable[str]) -> None:
    """Import ``modules`` (those of ``SLOW_IMPORTS`` only: the list comes over the wire).
    An import that fails is left to the train function."""
    for name in modules:
        if name not in SLOW_IMPORTS or name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - a head start, never a failure
            logger.debug("could not import %s ahead of the train function: %s", name, e)


__all__ = ["SLOW_IMPORTS", "imported", "warm"]
