"""``ElasticDataLoader``: a map-style DataLoader whose global steps survive world-size changes.

Why not ``DataLoader + DistributedSampler``: that sampler deals samples to ranks round-robin,
so which samples form step k depends on the world size, and a resize mid-epoch either skips
or repeats samples. Here the samples of global step k depend only on (dataset length, seed,
epoch, k, global batch size); the current ranks only split them (see ``plan.py``), and the
position is one integer, so a checkpoint taken at 4 workers resumes exactly at 3.

Loading itself is a stock ``torch.utils.data.DataLoader`` driven by a batch sampler that emits
this rank's micro-batches, so ``num_workers``, ``collate_fn``, pinning and prefetching behave
as usual and the only per-step Python work is slicing the cached epoch order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from raylastic.data._checks import (
    check_batch_sizes,
    check_dataloader_kwargs,
    check_explicit_world,
    check_int,
    dataset_length,
)
from raylastic.data.batch import StepBatch
from raylastic.data.plan import EpochPlan, epoch_order, micro_batch_sizes
from raylastic.data.policy import BatchPolicy, LRScaling, coerce_enum, lr_scale_factor
from raylastic.data.state import LoaderState

__all__ = ["ElasticDataLoader"]


class _PlanBatchSampler:
    """Batch sampler replaying the current ``EpochPlan``; re-pointed before each epoch.

    One sampler object for the loader's lifetime lets ``persistent_workers=True`` work: the
    DataLoader re-iterates the same sampler each epoch and sees the new plan.
    """

    def __init__(self) -> None:
        self.plan: EpochPlan | None = None

    def __iter__(self) -> Iterator[list[int]]:
        assert self.plan is not None, "ElasticDataLoader sets a plan before iterating"
        return self.plan.iter_micro_batches()

    def __len__(self) -> int:
        if self.plan is None:
            return 0
        return self.plan.num_steps * len(micro_batch_sizes(self.plan.shard_size, self.plan.micro_batch_size))


class ElasticDataLoader:
    """Yields one :class:`StepBatch` per global step: this rank's micro-batches for that step.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        global_batch_size: samples per global step over all ranks (fixed policy; must be None
            under the dynamic policy, where it is ``micro_batch_size * world_size``).
        micro_batch_size: most samples per forward/backward; None under the fixed policy means
            one micro-batch holding the rank's whole share.
        shuffle, seed: epoch order is ``randperm(n)`` seeded with ``seed + epoch``.
        num_workers, collate_fn: passed to the inner ``DataLoader``.
        world_size, rank: explicit membership (both or neither); by default read from
            ``torch.distributed`` when initialised (at construction and at each ``iter()``),
            else 1 and 0.
        max_world_size: the largest world size the job may reach; validated up front so a
            scale-up cannot fail later with ``global_batch_size < world_size``.
        batch_policy: ``BatchPolicy.FIXED`` (default) or ``BatchPolicy.DYNAMIC``.
        lr_scaling, base_world_size: learning-rate rule for the dynamic policy; see
            :meth:`lr_scale`.
        dataloader_kwargs: extra ``DataLoader`` arguments (``pin_memory``,
            ``persistent_workers``, ``prefetch_factor``, ...), not the ones this class owns.

    The final partial global batch of each epoch is dropped (drop_last). A step counts as
    consumed when its item is yielded: ``state_dict()`` taken after the optimizer step for an
    item says "next step to train".
    """

    def __init__(
        self,
        dataset: Any,
        *,
        global_batch_size: int | None = None,
        micro_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        world_size: int | None = None,
        rank: int | None = None,
        max_world_size: int | None = None,
        batch_policy: BatchPolicy | str = BatchPolicy.FIXED,
        lr_scaling: LRScaling | str = LRScaling.LINEAR,
        base_world_size: int = 1,
        dataloader_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._dataset = dataset
        self._dataset_len = dataset_length(dataset)
        self._policy = coerce_enum(BatchPolicy, "batch_policy", batch_policy)
        self._lr_scaling = coerce_enum(LRScaling, "lr_scaling", lr_scaling)
        check_int("seed", seed, minimum=0)
        check_int("num_workers", num_workers, minimum=0)
        check_int("base_world_size", base_world_size, minimum=1)
        if not isinstance(shuffle, bool):
            raise ValueError(f"shuffle ({shuffle!r}) must be a bool")
        self._shuffle, self._seed, self._base_world_size = shuffle, seed, base_world_size
        self._fixed_gbs, self._micro = check_batch_sizes(self._policy, global_batch_size, micro_batch_size)
        self._explicit_world = check_explicit_world(world_size, rank)
        if max_world_size is not None:
            check_int("max_world_size", max_world_size, minimum=1)
            self._check_world(max_world_size, name="max_world_size")
        self._max_world_size = max_world_size
        self._dataloader_kwargs = check_dataloader_kwargs(dataloader_kwargs)
        self._num_workers = num_workers
        self._collate_fn = collate_fn if collate_fn is not None else default_collate
        self._world_size, self._rank = self._resolve_world()
        self._epoch, self._step, self._samples = 0, 0, 0
        self._order_epoch: int | None = None
        self._order: Any = None
        self._sampler = _PlanBatchSampler()
        self._dataloader: DataLoader | None = None
        self._token: object | None = None  # identifies the live iterator; others stop

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batch_policy(self) -> BatchPolicy:
        return self._policy

    @property
    def micro_batch_size(self) -> int:
        return self._micro

    @property
    def global_batch_size(self) -> int:
        """Samples per global step at the current world size."""
        if self._policy is BatchPolicy.FIXED:
            return self._fixed()
        return self._micro * self._world_size

    def _fixed(self) -> int:
        """The global batch under the fixed policy (check_batch_sizes sets it there)."""
        assert self._fixed_gbs is not None
        return self._fixed_gbs

    def lr_scale(self) -> float:
        """Factor for the base learning rate at the current world size.

        1.0 under the fixed policy (the global batch never changes). Under the dynamic policy,
        ``W / base_world_size`` (linear) or its square root (sqrt). Call it after each
        (re)start and feed it to :func:`raylastic.data.apply_lr_scaling`.
        """
        if self._policy is BatchPolicy.FIXED:
            return 1.0
        return lr_scale_factor(self._world_size, self._base_world_size, self._lr_scaling)

    def __len__(self) -> int:
        """Global steps in the current epoch at the current world size (tail dropped)."""
        if self._policy is BatchPolicy.FIXED:
            return self._dataset_len // self._fixed()
        return self._step + (self._dataset_len - self._samples) // self.global_batch_size

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` at step 0, unless it is already the current epoch.

        Keeping the position when ``epoch`` is current makes the usual
        ``for e in range(start, n): loader.set_epoch(e)`` loop safe after ``load_state_dict``.
        """
        check_int("epoch", epoch, minimum=0)
        if epoch != self._epoch:
            self._start_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Plain-dict position: ``step`` is the next global step to yield within ``epoch``."""
        return LoaderState(
            epoch=self._epoch,
            step=self._step,
            samples=self._samples,
            dataset_len=self._dataset_len,
            seed=self._seed,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self._micro,
            shuffle=self._shuffle,
            batch_policy=self._policy.value,
            world_size=self._world_size,
        ).to_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Resume at a saved position, at any world size. Raises ``ValueError`` on a mismatch."""
        state = LoaderState.from_dict(state_dict)
        state.check_compatible(
            dataset_len=self._dataset_len,
            seed=self._seed,
            shuffle=self._shuffle,
            batch_policy=self._policy,
            global_batch_size=self._fixed_gbs,
        )
        self._token = None
        self._epoch, self._step, self._samples = state.epoch, state.step, state.samples

    def __iter__(self) -> Iterator[StepBatch]:
        if self._explicit_world is None:
            self._world_size, self._rank = self._resolve_world()
        plan = self._plan()
        if plan.num_steps == 0:  # epoch finished (or only its dropped tail is left)
            self._start_epoch(self._epoch + 1)
            plan = self._plan()
        self._token = token = object()
        self._sampler.plan = plan
        return self._run(plan, token)

    def _run(self, plan: EpochPlan, token: object) -> Iterator[StepBatch]:
        batches = iter(self._get_dataloader())
        sizes = micro_batch_sizes(plan.shard_size, plan.micro_batch_size)
        n_micro, gbs = len(sizes), plan.global_batch_size
        for k, shard in enumerate(plan.iter_shards()):
            micros = [next(batches) for _ in range(n_micro)]
            if self._token is not token:
                return
            self._step = plan.start_step + k + 1
            self._samples = plan.start_samples + (k + 1) * gbs
            yield StepBatch(
                step=plan.start_step + k,
                epoch=plan.epoch,
                indices=shard,
                global_batch_size=gbs,
                world_size=plan.world_size,
                rank=plan.rank,
                micro_batches=micros,
                micro_sizes=sizes,
            )
            if self._token is not token:  # load_state_dict / set_epoch / a newer iter()
                return
        self._token = None
        self._start_epoch(plan.epoch + 1)

    def _plan(self) -> EpochPlan:
        if self._order_epoch != self._epoch:
            self._order = epoch_order(self._dataset_len, seed=self._seed, epoch=self._epoch, shuffle=self._shuffle)
            self._order_epoch = self._epoch
        return EpochPlan(
            order=self._order,
            epoch=self._epoch,
            start_step=self._step,
            start_samples=self._samples,
            global_batch_size=self.global_batch_size,
            micro_batch_size=self._micro,
            world_size=self._world_size,
            rank=self._rank,
        )

    def _start_epoch(self, epoch: int) -> None:
        self._token = None
        self._epoch, self._step, self._samples = epoch, 0, 0

    def _get_dataloader(self) -> DataLoader:
        if self._dataloader is None:
            self._dataloader = DataLoader(
                self._dataset,
                batch_sampler=self._sampler,
                num_workers=self._num_workers,
                collate_fn=self._collate_fn,
                **self._dataloader_kwargs,
            )
        return self._dataloader

    def _resolve_world(self) -> tuple[int, int]:
        if self._explicit_world is not None:
            world = self._explicit_world
        elif dist.is_available() and dist.is_initialized():
            world = (dist.get_world_size(), dist.get_rank())
        else:
            world = (1, 0)
        self._check_world(world[0], name="world_size")
        if self._max_world_size is not None and world[0] > self._max_world_size:
            raise ValueError(f"world_size ({world[0]}) > max_world_size ({self._max_world_size}); raise max_world_size")
        return world

    def _check_world(self, world_size: int, *, name: str) -> None:
        """Every rank must get a sample and every epoch at least one step at ``world_size``."""
        n = self._dataset_len
        if self._policy is BatchPolicy.FIXED:
            if self._fixed() < world_size:
                raise ValueError(
                    f"global_batch_size ({self._fixed_gbs}) < {name} ({world_size}): some rank "
                    f"would get no sample; use global_batch_size >= {world_size}"
                )
        elif self._micro * world_size > n:
            raise ValueError(
                f"micro_batch_size ({self._micro}) * {name} ({world_size}) > len(dataset) ({n}) "
                "under the dynamic policy: an epoch would have no step; lower micro_batch_size"
            )
