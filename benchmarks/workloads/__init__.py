"""Train functions the benchmarks run (not part of the installed package).

A benchmark runs as ``python benchmarks/<name>.py``, so ``benchmarks/`` is on the driver's
``sys.path`` but not on the Ray workers': :func:`by_value` registers a workload module with
cloudpickle so its functions travel with the train function instead of being imported by
name on the workers (Ray does the same for ``__main__``).
"""

from __future__ import annotations

import types


def by_value(module: types.ModuleType) -> types.ModuleType:
    """Ship ``module``'s functions to Ray workers by value; returns ``module``."""
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(module)
    return module
