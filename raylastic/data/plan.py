"""Pure index math of the elastic data layer (no Ray, no I/O, no global state).

Why a separate module: every guarantee the loader makes ("each sample once per epoch",
"step k holds the same samples at any world size", "a resize resumes without a gap") is a
property of these few functions, so they are unit-tested directly and exhaustively.

The model: an epoch is one ordering of ``range(n)`` (a seeded permutation, or the identity).
Training consumes that ordering front to back in contiguous windows, one window per global
step. A rank's share of a window is a contiguous slice chosen by rank only, and a share is
cut into micro-batches for gradient accumulation. The position inside the epoch is therefore
a single integer (samples consumed), which is what makes resuming at another world size exact.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

# An epoch's order: a ``range`` (not shuffled), an int64 tensor (shuffled), or any sequence.
Order = Sequence[int] | torch.Tensor

# Samples converted from the epoch order tensor to Python ints at a time (see iter_shards).
_BLOCK_SAMPLES = 1 << 16

__all__ = [
    "EpochPlan",
    "epoch_order",
    "global_batch_indices",
    "micro_batch_sizes",
    "micro_batches",
    "shard_bounds",
    "shard_for_rank",
    "steps_per_epoch",
    "window",
]


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> range | torch.Tensor:
    """The order in which epoch ``epoch`` visits ``range(n)``.

    Shuffled orders use ``torch.randperm`` with a ``torch.Generator`` seeded with
    ``seed + epoch``, exactly as ``DistributedSampler`` does, so at world size 1 the loader
    visits samples in the same order as ``DataLoader(sampler=DistributedSampler(...))``.
    The result is an int64 tensor (8 bytes per sample, not a Python list of ints, which costs
    ~5x more) or a ``range`` when not shuffling (no memory at all).
    """
    _check_non_negative("n", n)
    if not shuffle:
        return range(n)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(n, generator=generator)


def steps_per_epoch(n: int, global_batch_size: int) -> int:
    """Global steps in an epoch: the final partial global batch is dropped (drop_last)."""
    _check_positive("global_batch_size", global_batch_size)
    return n // global_batch_size


def window(order: Order, start: int, count: int) -> list[int]:
    """``order[start:start + count]`` as a list of Python ints, for a tensor or a range."""
    part = order[start : start + count]
    return part.tolist() if isinstance(part, torch.Tensor) else list(part)


def global_batch_indices(n: int, seed: int, epoch: int, step: int, global_batch_size: int, shuffle: bool) -> list[int]:
    """Sample indices of global step ``step`` of ``epoch`` (fixed global batch policy).

    Depends only on its arguments: never on the world size. Builds the epoch's order on each
    call; the loader caches the order once per epoch instead.
    """
    total = steps_per_epoch(n, global_batch_size)
    if not 0 <= step < total:
        raise ValueError(
            f"step ({step}) is outside epoch: {n} samples at global_batch_size "
            f"{global_batch_size} give steps 0..{total - 1} (the partial tail is dropped)"
        )
    order = epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle)
    return window(order, step * global_batch_size, global_batch_size)


def shard_bounds(total: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``rank``'s contiguous share of ``total`` items.

    Uneven splits give the first ``total % world_size`` ranks one extra item
    (256 over 3 ranks: 86, 85, 85), so shares differ by at most one sample.
    """
    _check_positive("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, world_size={world_size})")
    base, extra = divmod(total, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def shard_for_rank(indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Rank ``rank``'s contiguous slice of a global batch (see :func:`shard_bounds`)."""
    lo, hi = shard_bounds(len(indices), rank, world_size)
    return list(indices[lo:hi])


def micro_batch_sizes(num_samples: int, micro_batch_size: int) -> tuple[int, ...]:
    """Micro-batch sizes for a share of ``num_samples``: full ones, then the remainder."""
    _check_positive("micro_batch_size", micro_batch_size)
    full, rest = divmod(num_samples, micro_batch_size)
    return (micro_batch_size,) * full + ((rest,) if rest else ())


def micro_batches(shard: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Cut a rank's share into consecutive micro-batches of at most ``micro_batch_size``."""
    _check_positive("micro_batch_size", micro_batch_size)
    return [list(shard[i : i + micro_batch_size]) for i in range(0, len(shard), micro_batch_size)]


@dataclass(frozen=True, kw_only=True, slots=True)
class EpochPlan:
    """What one rank reads for the rest of an epoch, from a resume position.

    ``start_samples`` is the number of samples of the epoch's order already consumed; under the
    fixed policy it is ``start_step * global_batch_size``, under the dynamic policy it is
    whatever earlier world sizes consumed. Steps are windows of ``global_batch_size`` from there.
    """

    order: Order
    epoch: int
    start_step: int
    start_samples: int
    global_batch_size: int
    micro_batch_size: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        _check_positive("global_batch_size", self.global_batch_size)
        _check_positive("micro_batch_size", self.micro_batch_size)
        _check_non_negative("start_step", self.start_step)
        if not 0 <= self.start_samples <= len(self.order):
            raise ValueError(f"start_samples ({self.start_samples}) must be in [0, {len(self.order)}]")
        if self.global_batch_size < self.world_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) < world_size ({self.world_size}): "
                "some rank would get no sample"
            )
        shard_bounds(self.global_batch_size, self.rank, self.world_size)  # validates rank

    @property
    def num_steps(self) -> int:
        """Steps left in the epoch; a tail shorter than a global batch is dropped."""
        return (len(self.order) - self.start_samples) // self.global_batch_size

    @property
    def shard_size(self) -> int:
        lo, hi = shard_bounds(self.global_batch_size, self.rank, self.world_size)
        return hi - lo

    def shard(self, k: int) -> list[int]:
        """This rank's indices for the ``k``-th remaining step (global step ``start_step + k``)."""
        if not 0 <= k < self.num_steps:
            raise IndexError(f"step offset {k} not in [0, {self.num_steps})")
        return next(self.iter_shards(first=k, stop=k + 1))

    def iter_shards(self, first: int = 0, stop: int | None = None) -> Iterator[list[int]]:
        """This rank's indices for remaining steps ``first .. stop - 1`` (default: all)."""
        lo, hi = shard_bounds(self.global_batch_size, self.rank, self.world_size)
        stop = self.num_steps if stop is None else min(stop, self.num_steps)
        base, gbs, order = self.start_samples, self.global_batch_size, self.order
        if not isinstance(order, torch.Tensor):
            for k in range(first, stop):
                yield list(order[base + k * gbs + lo : base + k * gbs + hi])
            return
        # Convert blocks of steps at once: one (steps, G) view, keep columns [lo, hi), one
        # tolist(). Per step this costs ~0.1 us instead of ~2.5 us for a slice + tolist().
        block = max(1, _BLOCK_SAMPLES // gbs)
        for b in range(first, stop, block):
            e = min(b + block, stop)
            yield from order[base + b * gbs : base + e * gbs].view(e - b, gbs)[:, lo:hi].tolist()

    def iter_micro_batches(self) -> Iterator[list[int]]:
        """Every micro-batch of index lists this rank reads, in order (the batch sampler)."""
        mb = self.micro_batch_size
        for shard in self.iter_shards():
            if len(shard) <= mb:
                yield shard
            else:
                for i in range(0, len(shard), mb):
                    yield shard[i : i + mb]


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} ({value!r}) must be a positive int")


def _check_non_negative(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} ({value!r}) must be a non-negative int")
