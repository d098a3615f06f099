"""raylastic: elastic, fault-tolerant distributed PyTorch training on Ray.

The public API is what ``__all__`` lists; everything else may change. Names are
imported lazily so that light entry points (``torchrun --rdzv-backend=azure-table``,
``raylastic report``) do not pay for importing Ray Train and torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Checkpoint": "ray.train",
    "CheckpointConfig": "raylastic.config",
    "FailureConfig": "raylastic.config",
    "RunConfig": "raylastic.config",
    "ScalingConfig": "raylastic.config",
    "ConfigError": "raylastic.errors",
    "InsufficientCapacityError": "raylastic.errors",
    "RaylasticError": "raylastic.errors",
    "RunInUseError": "raylastic.errors",
    "CapacityTimeoutError": "raylastic.policies.capacity_decisions",
    "DeadlineUnreachableError": "raylastic.policies.capacity_decisions",
    "TrainingAborted": "raylastic.errors",
    "TrainingFailedError": "raylastic.errors",
    "get_checkpoint": "raylastic.session",
    "get_context": "raylastic.session",
    "get_dataset_shard": "raylastic.session",
    "report": "raylastic.session",
    "ElasticTrainer": "raylastic.trainer",
    "ElasticState": "raylastic.state",
    "Result": "raylastic.trainer",
    "TorchTrainer": "raylastic.ray_train",
}
_SUBMODULES = {"data", "testing", "sim"}

__all__ = sorted(_EXPORTS) + ["data"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"raylastic.{name}")
    raise AttributeError(f"module 'raylastic' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
