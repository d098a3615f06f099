"""An elastic Lightning ``Trainer``: resized in place, state back from peer memory.

Usage, inside a raylastic train function (``ElasticTrainer`` or ``raylastic.TorchTrainer``)::

    trainer = pl.Trainer(max_steps=..., accelerator="cpu", ...)
    trainer = raylastic.integrations.lightning.prepare_trainer(trainer)
    trainer.fit(model, datamodule=dm)

What ``prepare_trainer`` changes, and why:

* **Strategy.** Lightning's own DDP strategy would start processes and a process group;
  raylastic has done both, and rebuilds the group after every resize before it calls the
  train function again in the same process. :class:`ElasticDDPStrategy` (``DDPStrategy``
  over :class:`ElasticEnvironment`, as Ray's ``RayDDPStrategy`` over
  ``RayLightningEnvironment``) finds the group initialised and takes rank and world size
  from the raylastic context, so each call of the train function sees the current ones.
* **Data.** The train DataLoader is replaced (in ``process_dataloader``) by
  :class:`ElasticBatches` over raylastic's :class:`~raylastic.data.ElasticDataLoader`: the
  samples of global step k depend on the global batch, not on the world size, so after a
  resize every sample is still trained once per epoch. Its ``batch_size`` becomes the
  micro-batch; ``accumulate_grad_batches = global_batch / (world_size * micro_batch)``
  follows the world size, so the optimizer sees the same mean gradient at any size.
  Validation dataloaders are left as they are.
* **State.** An :class:`~raylastic.ElasticState` over the LightningModule, its one
  optimizer, its LR schedulers, the data position and the global step is built when the
  train data is attached (after ``strategy.setup``, before the loops start): it restores
  from the survivors' snapshot. Lightning's own counters (epoch, batch, optimizer-step
  progress) are then set so ``trainer.global_step``, ``max_steps`` and ``max_epochs`` go on
  where the run was. The callback commits once per optimizer step, in
  ``on_train_batch_end`` (after Lightning's optimizer and step-interval scheduler steps,
  after the other callbacks' hooks, before the LightningModule's); an epoch's last step
  is committed after the epoch-end work instead (``_ElasticRun.flush``).

Limits: automatic optimization with one optimizer; DDP (not FSDP/DeepSpeed strategies);
batch-count based ``val_check_interval`` counts micro-batches, whose number per step
changes with the world size. Evaluation loaders get Lightning's DistributedSampler at the
current world size, as usual (``use_distributed_sampler`` is turned off only so that the
train loader arrives as the user built it, its shuffle setting included).

:class:`ElasticBatches`, :class:`ElasticEnvironment` and the ``ElasticState`` adapters are
defined in ``_lightning_adapters``, the loop counters in ``_lightning_loop``; both are
re-exported here.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _is_dataloader_shuffled
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from raylastic import session as _session
from raylastic.data import ElasticDataLoader
from raylastic.integrations._elastic import check_state_kwargs, refuse_or_fall_back
from raylastic.integrations._lightning_adapters import ElasticBatches, ElasticEnvironment, _Position, _Schedulers
from raylastic.integrations._lightning_loop import accumulation, resume_point, set_loop_counters

_log = logging.getLogger(__name__)

__all__ = [
    "ElasticBatches",
    "ElasticDDPStrategy",
    "ElasticEnvironment",
    "accumulation",
    "prepare_trainer",
    "resume_point",
    "set_loop_counters",
]

# DataLoader arguments carried over to the elastic loader's inner DataLoader.
_CARRIED = (
    "pin_memory",
    "persistent_workers",
    "prefetch_factor",
    "worker_init_fn",
    "multiprocessing_context",
    "timeout",
    "generator",
    "pin_memory_device",
)


class ElasticDDPStrategy(DDPStrategy):
    """``DDPStrategy`` on raylastic's process group; attaches the elastic train data."""

    def __init__(self, run: "_ElasticRun", **kwargs: Any):
        super().__init__(**kwargs)
        self._run = run

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices, "set by prepare_trainer"
        return self.parallel_devices[0]  # this process's one device (local_rank may exceed it)

    @property
    def distributed_sampler_kwargs(self) -> Dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def process_dataloader(self, dataloader: object) -> object:
        module = self.lightning_module
        assert module is not None, "Lightning attaches the module before it loads data"
        trainer = module.trainer
        if trainer.state.stage != RunningStage.TRAINING:
            return self._run.shard_eval(trainer, dataloader)
        return self._run.attach(trainer, dataloader)


def _unsupported(trainer: "pl.Trainer", dataloader: object) -> Optional[str]:
    """Why this fit cannot be resized in place, or None."""
    if not isinstance(dataloader, DataLoader) or isinstance(dataloader.dataset, IterableDataset):
        return (
            f"the train dataloader is a {type(dataloader).__name__}; prepare_trainer needs a torch "
            "DataLoader over a map-style dataset (its batch_size is the micro batch)"
        )
    micro = (
        dataloader.batch_size
        if dataloader.batch_size is not None
        else getattr(dataloader.batch_sampler, "batch_size", None)
    )
    if not isinstance(micro, int):
        return "the train DataLoader has no batch_size: give it batch_size= (the micro batch)"
    if not trainer.lightning_module.automatic_optimization:
        return "prepare_trainer supports automatic optimization only (LightningModule.automatic_optimization is False)"
    if len(trainer.optimizers) != 1:
        return f"prepare_trainer needs exactly one optimizer; configure_optimizers gave {len(trainer.optimizers)}"
    return None


class _ElasticRun:
    """What one ``fit()`` shares between the strategy (attach) and the callback (commit)."""

    def __init__(
        self,
        global_batch_size: Optional[int],
        accumulate: int,
        seed: int,
        shuffle: Optional[bool],
        state_kwargs: Dict[str, Any],
        distributed_sampler: bool,
        fallback: bool = False,
    ):
        self.global_batch_size = global_batch_size
        self.fallback, self.warned = fallback, False  # see prepare_trainer(fallback_to_restart=...)
        self.distributed_sampler = distributed_sampler  # the user's Trainer(use_distributed_sampler)
        self.user_accumulate = accumulate
        self.seed, self.shuffle = seed, shuffle
        self.state_kwargs = state_kwargs
        self.state: Any = None
        self.batches: Optional[ElasticBatches] = None
        self.position = _Position()
        self.committed_step = 0
        self.due = False  # an epoch's last step waits for the epoch-end work (flush)

    def attach(self, trainer: "pl.Trainer", dataloader: object) -> object:
        why = _unsupported(trainer, dataloader)
        if why is not None:  # Ray's prepare_trainer routed here: run as under Ray Train (warned once)
            refuse_or_fall_back(why, self.fallback, _log, "this Lightning run", warn=not self.warned)
            self.warned = True
            return dataloader
        assert isinstance(dataloader, DataLoader)
        micro = (
            dataloader.batch_size
            if dataloader.batch_size is not None
            else getattr(dataloader.batch_sampler, "batch_size", None)
        )
        assert isinstance(micro, int)
        first = self.state is None
        if first:
            self.state = self._elastic_state(trainer)
        world = trainer.world_size
        full = _session._get_session().spec.max_workers or world  # the script's settings describe its full size
        gbs = self.global_batch_size or self.state.global_batch_size or micro * self.user_accumulate * full
        self.state.global_batch_size = gbs
        accumulate = accumulation(gbs, world, micro)
        trainer.accumulate_grad_batches = accumulate
        shuffle = self.shuffle if self.shuffle is not None else isinstance(dataloader.sampler, RandomSampler)
        carried = {k: getattr(dataloader, k) for k in _CARRIED if hasattr(dataloader, k)}
        if not carried.get("prefetch_factor") or dataloader.num_workers == 0:
            carried.pop("prefetch_factor", None)
        if dataloader.num_workers == 0:
            carried.pop("persistent_workers", None)
        loader = ElasticDataLoader(
            dataloader.dataset,
            global_batch_size=gbs,
            micro_batch_size=micro,
            shuffle=shuffle,
            seed=self.seed,
            num_workers=dataloader.num_workers,
            collate_fn=dataloader.collate_fn,
            dataloader_kwargs=carried,
        )
        batches = ElasticBatches(loader, accumulate, lambda: trainer.current_epoch)
        batches.position = self.batches.position if self.batches is not None else self.position.value
        self.batches = batches
        if first:
            epoch, step = resume_point(self.position.value, len(loader))
            self.committed_step = self.state.global_step
            if self.state.restored_from != "none":
                set_loop_counters(
                    trainer, epoch=epoch, step_in_epoch=step, global_step=self.committed_step, accumulate=accumulate
                )
        return batches

    def shard_eval(self, trainer: "pl.Trainer", dataloader: object) -> object:
        """Validation/test/predict loaders get the DistributedSampler Lightning would have
        given them (at this world size); only the train loader's sampler is ours."""
        if not self.distributed_sampler:
            return dataloader
        connector = trainer._accelerator_connector
        connector.use_distributed_sampler = True
        try:
            stage = trainer.state.stage
            assert stage is not None
            return trainer._data_connector._prepare_dataloader(
                dataloader, shuffle=_is_dataloader_shuffled(dataloader), mode=stage
            )
        finally:
            connector.use_distributed_sampler = False

    def _elastic_state(self, trainer: "pl.Trainer") -> Any:
        from raylastic.state import ElasticState

        module = trainer.lightning_module
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        return ElasticState(
            model=module,
            optimizer=trainer.optimizers[0],
            lr_scheduler=_Schedulers(schedulers) if schedulers else None,
            loader=self.position,
            global_step=0,
            global_batch_size=0,
            **self.state_kwargs,
        )

    def after_batch(self, trainer: "pl.Trainer", batch_idx: int) -> None:
        """Commit after each optimizer step (a no-op on accumulating micro-batches)."""
        step = trainer.global_step
        if step == self.committed_step or self.state is None or self.batches is None:
            return
        self.position.value = self.batches.trained(batch_idx)
        self.committed_step = step
        if trainer.fit_loop.epoch_loop._num_ready_batches_reached():
            self.due = True  # the epoch's last step: see flush
            return
        self._commit(trainer)

    def flush(self, trainer: "pl.Trainer") -> None:
        """Commit the step that ended an epoch once the epoch-end work is done (validation,
        ``on_train_epoch_end``, plateau schedulers): at the next epoch's start or the end of
        ``fit``. A restore from it then starts the next epoch as Lightning would; committed
        at once, a resize there would skip that epoch's validation and epoch-end hooks."""
        if not self.due:
            return
        self.due = False
        position = self.position.value
        if position and int(position["epoch"]) < trainer.current_epoch:
            self.position.value = dict(position, epoch=trainer.current_epoch, step=0, samples=0)
        self._commit(trainer)

    def _commit(self, trainer: "pl.Trainer") -> None:
        step = self.state.global_step = trainer.global_step
        metrics: Dict[str, Any] = {"step": step, "epoch": trainer.current_epoch, "world_size": trainer.world_size}
        for key, value in trainer.callback_metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                metrics.setdefault(key, float(value))
        self.state.commit(metrics)


class _CommitCallback(pl.Callback):
    def __init__(self, run: _ElasticRun):
        self._run = run

    def on_train_batch_end(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._run.after_batch(trainer, batch_idx)

    def on_train_epoch_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._run.flush(trainer)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        self._run.flush(trainer)

    @property
    def restored_from(self) -> str:
        return self._run.state.restored_from if self._run.state is not None else "none"


def prepare_trainer(
    trainer: "pl.Trainer",
    global_batch_size: Optional[int] = None,
    *,
    seed: Optional[int] = None,
    shuffle: Optional[bool] = None,
    fallback_to_restart: bool = False,
    **state_kwargs: Any,
) -> "pl.Trainer":
    """Make ``trainer`` resize in place under raylastic; returns it. Call before ``fit``.

    Args:
        global_batch_size: samples per optimizer step over all workers, kept at every world
            size. Default: ``batch_size * accumulate_grad_batches * max_workers`` (what the
            unchanged script trains with at full size), carried across resizes in the
            snapshot. It must divide by ``batch_size * world_size`` at every size the
            run takes: a ValueError names it otherwise.
        seed, shuffle: the epoch order (``randperm`` seeded with ``seed + epoch``, default
            seed 0); ``shuffle`` defaults to whether the train DataLoader shuffles.

        fallback_to_restart: where this fit cannot be resized in place (a sharded strategy,
            a train loader that is not a torch DataLoader over a map-style dataset, such as
            Ray Data's ``iter_torch_batches``, manual optimization, several optimizers), log
            a warning and run it as under Ray Train (a resize restarts it from its last
            reported checkpoint) instead of raising. Ray's ``prepare_trainer``, routed here
            under raylastic, sets it, so Ray Train scripts that worked before keep working.

    Calling it again on a prepared trainer (Ray's ``prepare_trainer`` routed here, then
    this one) keeps the preparation and applies the arguments given.
        state_kwargs: passed to :class:`~raylastic.ElasticState` (``persist_every``,
            ``snapshot_every``, ``async_snapshot``, ``striped``).
    """
    _session._get_session()  # raises outside a raylastic train function
    check_state_kwargs(state_kwargs)
    old = trainer.strategy
    if not isinstance(old, (DDPStrategy, SingleDeviceStrategy)) or type(old).__name__ not in (
        "DDPStrategy",
        "SingleDeviceStrategy",
        "RayDDPStrategy",
        "ElasticDDPStrategy",
    ):
        why = (
            f"prepare_trainer supports Trainer(strategy='ddp' | 'auto' | RayDDPStrategy()), "
            f"not {type(old).__name__}: sharded strategies are not wired to ElasticState here"
        )
        return _fallback(trainer, why, fallback_to_restart)
    if isinstance(old, ElasticDDPStrategy):  # prepared already: take the arguments given
        run = old._run
        run.global_batch_size = global_batch_size or run.global_batch_size
        run.seed = run.seed if seed is None else seed
        run.shuffle = run.shuffle if shuffle is None else shuffle
        run.state_kwargs.update(state_kwargs)
        run.fallback = run.fallback and fallback_to_restart  # strict once the user calls it
        return trainer
    callbacks: List[pl.Callback] = trainer.callbacks  # type: ignore[attr-defined]  # set by its connector
    if any(isinstance(c, GradientAccumulationScheduler) for c in callbacks):
        return _fallback(
            trainer,
            "GradientAccumulationScheduler conflicts with prepare_trainer, which sets "
            "accumulate_grad_batches from the world size: remove the callback",
            fallback_to_restart,
        )
    # As in the HF integration: each commit reports the step's metrics, and the callback's
    # per-epoch checkpoint would be the run's newest (ahead of the epoch's deferred commit):
    # a resize there would restore from storage, a state ElasticState did not write.
    for cb in [c for c in callbacks if type(c).__name__ == "RayTrainReportCallback"]:
        callbacks.remove(cb)
    connector = trainer._accelerator_connector
    run = _ElasticRun(
        global_batch_size,
        trainer.accumulate_grad_batches,
        seed or 0,
        shuffle,
        state_kwargs,
        distributed_sampler=connector.use_distributed_sampler,
        fallback=fallback_to_restart,
    )
    if trainer.accelerator.__class__.__name__ == "CUDAAccelerator":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    ddp_kwargs = dict(old._ddp_kwargs) if isinstance(old, DDPStrategy) else {}
    strategy = ElasticDDPStrategy(
        run,
        accelerator=old.accelerator,
        parallel_devices=[device],
        cluster_environment=ElasticEnvironment(),
        **ddp_kwargs,
    )
    connector.strategy = strategy
    connector._lazy_init_strategy()  # accelerator, precision, checkpoint_io, ranks (as Trainer() does)
    connector.use_distributed_sampler = False  # the train loader arrives as the user built it (shard_eval)
    callbacks.append(_CommitCallback(run))
    return trainer


def _fallback(trainer: "pl.Trainer", why: str, fallback: bool) -> "pl.Trainer":
    # The strategy / callback refusals come before fit and hold on every attempt alike (a run
    # refused here never took an elastic snapshot), so attach()'s memory-restore check is not applied.
    refuse_or_fall_back(why, fallback, _log, "this Lightning run", strict_once_elastic=False)
    return trainer
