"""``StepBatch``: what the elastic loader yields for one global step on one rank."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ContextManager

from raylastic.data.loss import maybe_no_sync, micro_weights

__all__ = ["StepBatch"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepBatch:
    """This rank's micro-batches for global step ``step`` of ``epoch``.

    Iterating yields the collated micro-batches in order (gradient accumulation). The
    weighting that turns the accumulated, DDP-averaged gradient into the gradient of the mean
    loss over the whole global batch is ``micro_weights[i]`` (see :mod:`raylastic.data.loss`).

    Typical use::

        for micro, weight in step_batch.accumulate(model):   # no_sync on all but the last
            (loss_fn(model(micro)) * weight).backward()
        optimizer.step(); optimizer.zero_grad()
    """

    step: int
    epoch: int
    indices: list[int]
    global_batch_size: int
    world_size: int
    rank: int
    micro_batches: list[Any]
    micro_sizes: tuple[int, ...]

    @property
    def num_samples(self) -> int:
        """Samples this rank trains on in this step."""
        return len(self.indices)

    @property
    def micro_weights(self) -> tuple[float, ...]:
        """Per-micro-batch loss weights ``m * W / G`` for per-sample-mean losses."""
        return micro_weights(self.micro_sizes, self.global_batch_size, self.world_size)

    def loss_weight(self, micro_index: int) -> float:
        """Weight for the loss of micro-batch ``micro_index`` (a per-sample mean)."""
        return self.micro_sizes[micro_index] * self.world_size / self.global_batch_size

    def no_sync(self, model: Any, micro_index: int) -> ContextManager[Any]:
        """DDP ``no_sync()`` for every micro-batch but the last; a no-op for other models."""
        return maybe_no_sync(model, micro_index < len(self.micro_batches) - 1)

    def accumulate(self, model: Any = None) -> Iterator[tuple[Any, float]]:
        """Yield ``(micro_batch, weight)``; the loop body runs inside :meth:`no_sync`.

        Works because a generator suspended inside a ``with`` block keeps the context open
        while the caller's loop body runs: forward and backward of all but the last
        micro-batch skip DDP's all-reduce, the last one triggers it.
        """
        for i, micro in enumerate(self.micro_batches):
            with self.no_sync(model, i):
                yield micro, self.loss_weight(i)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, micro_index: int) -> Any:
        return self.micro_batches[micro_index]
