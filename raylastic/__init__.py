"""raylastic: elastic, fault-tolerant distributed PyTorch training on Ray.

The public API is what ``__all__`` lists; everything else may change.
"""

from ray.train import Checkpoint

from raylastic.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from raylastic.errors import (
    ConfigError,
    InsufficientCapacityError,
    RaylasticError,
    TrainingAborted,
    TrainingFailedError,
)
from raylastic.session import get_checkpoint, get_context, report
from raylastic.trainer import ElasticTrainer, Result

__version__ = "0.1.0"

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "ConfigError",
    "ElasticTrainer",
    "FailureConfig",
    "InsufficientCapacityError",
    "RaylasticError",
    "Result",
    "RunConfig",
    "ScalingConfig",
    "TrainingAborted",
    "TrainingFailedError",
    "get_checkpoint",
    "get_context",
    "report",
]
