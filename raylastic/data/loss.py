"""Loss weighting and DDP gradient-sync helpers for gradient accumulation over uneven splits.

Why weights are needed: DDP averages gradients over the W ranks and accumulation sums them
over micro-batches. If every micro-batch loss is a per-sample *mean*, a micro-batch of ``m``
samples must be scaled by ``m * W / G`` (G = global batch size) so that

    (1/W) * sum_ranks sum_micro (m * W / G) * mean_micro(grad) = (1/G) * sum_all_samples(grad),

the gradient of the mean loss over the whole global batch, whatever the split (86/85/85,
micro-batches of 32/32/22, ...).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, ContextManager

import torch

__all__ = ["loss_weight", "maybe_no_sync", "scale_loss"]

_NO_OP = contextlib.nullcontext()  # stateless and reusable


def loss_weight(num_samples_in_micro: int, global_batch_size: int, world_size: int) -> float:
    """Weight ``m * W / G`` for a micro-batch whose loss is a per-sample mean."""
    for name, value in (
        ("num_samples_in_micro", num_samples_in_micro),
        ("global_batch_size", global_batch_size),
        ("world_size", world_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive int")
    return num_samples_in_micro * world_size / global_batch_size


def scale_loss(loss: torch.Tensor, num_samples_in_micro: int, global_batch_size: int, world_size: int) -> torch.Tensor:
    """``loss * m * W / G``: see the module docstring. ``loss`` must be a per-sample mean."""
    return loss * loss_weight(num_samples_in_micro, global_batch_size, world_size)


def maybe_no_sync(model: Any, enabled: bool) -> ContextManager[Any]:
    """``model.no_sync()`` when ``enabled`` and the model has it (DDP, FSDP1), else a no-op.

    Use it for every micro-batch but the last of a step, so gradients are all-reduced once per
    step. Forward and backward must both run inside the context.
    """
    if not enabled:  # the common last-micro-batch case skips the attribute lookup
        return _NO_OP
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if callable(no_sync) else _NO_OP


def micro_weights(sizes: Sequence[int], global_batch_size: int, world_size: int) -> tuple[float, ...]:
    """Weights of consecutive micro-batches of ``sizes`` samples (see :func:`loss_weight`)."""
    return tuple(loss_weight(m, global_batch_size, world_size) for m in sizes)
