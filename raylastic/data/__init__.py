"""Elastic data layer: global steps whose samples do not depend on the world size.

See docs/data.md for the guarantees, the loss-weighting math and the resume semantics.
"""

from raylastic.data.batch import StepBatch
from raylastic.data.loader import ElasticDataLoader
from raylastic.data.loss import loss_weight, maybe_no_sync, scale_loss
from raylastic.data.plan import (
    global_batch_indices,
    micro_batches,
    shard_for_rank,
    steps_per_epoch,
)
from raylastic.data.policy import BatchPolicy, LRScaling, apply_lr_scaling, lr_scale_factor

__all__ = [
    "BatchPolicy",
    "ElasticDataLoader",
    "LRScaling",
    "StepBatch",
    "apply_lr_scaling",
    "global_batch_indices",
    "loss_weight",
    "lr_scale_factor",
    "maybe_no_sync",
    "micro_batches",
    "scale_loss",
    "shard_for_rank",
    "steps_per_epoch",
]
