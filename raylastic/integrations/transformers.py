"""An elastic Hugging Face ``Trainer``: ``trainer = prepare_trainer(trainer)`` before ``train()``.

Inside a raylastic train function (``ElasticTrainer`` or ``raylastic.TorchTrainer`` with
``min_workers < max_workers``), an otherwise unmodified ``transformers.Trainer`` script then
survives node losses and scale-ups in place:

- **Accelerate's singletons** (``PartialState``, ``AcceleratorState``, ``GradientState``) cache
  the world size and rank of the process group they first saw. The survivors' train
  function is called again in the same process after the group is rebuilt, so they are reset
  before every attempt, in the worker, before the train function runs and builds its
  ``TrainingArguments`` (``raylastic/_internal/ray_train_compat.py: reset_library_state``).
  Doing it here, in ``prepare_trainer``, would be too late: ``TrainingArguments`` and the
  ``Trainer``'s ``Accelerator`` already read the stale state when they were constructed.
- **Constant global batch.** ``gradient_accumulation_steps`` becomes
  ``global_batch_size / (world_size * per_device_train_batch_size)`` for the current world
  size (a ``ValueError`` names the field when it does not divide). With equal micro-batches,
  DDP's mean over ranks of the Trainer's mean over micro-batches is the mean over the global
  batch at any world size, so an elastic run follows the fixed-size run's trajectory.
- **Exactly-once data.** The Trainer's train dataloader is replaced by one driven by
  raylastic's elastic data plan (``raylastic/data/plan.py``): the samples of global step k
  depend only on (dataset length, seed, epoch, k, global batch), ranks only split them, and
  the position is one integer, restored with the rest of the state. HF's own resume skipping
  (``skip_first_batches``) is not used: the loader yields only the steps left.
- **State from peer memory.** At ``on_train_begin`` (after HF built the optimizer and LR
  scheduler, before the first step) an :class:`~raylastic.ElasticState` over the unwrapped
  model, the torch optimizer inside Accelerate's wrapper, the LR scheduler, the loader
  position and the global step restores them (survivors' memory, storage as a fallback) and
  ``trainer.state.global_step`` is set from it, so HF's ``max_steps`` stop and the schedule
  line up. ``ElasticState.commit`` runs once per optimizer step from ``on_step_end``; that is
  where a resize unwinds the train function.

``max_steps`` is fixed up front: ``args.max_steps`` when set (optimizer steps at the global
batch), else ``ceil(num_train_epochs * len(train_dataset) // global_batch_size)``; it does not
depend on the world size, so neither does the LR schedule.

Ray's ``ray.train.huggingface.transformers.prepare_trainer`` routes here when the process runs
a raylastic train function (``ray_train_compat``); ``RayTrainReportCallback`` is then dropped
from the trainer (see :func:`prepare_trainer`).

Not supported (refused with a ``ValueError``): DeepSpeed or FSDP through the Trainer (use
``ElasticState(engine=...)`` / FSDP2 directly), ``auto_find_batch_size``, several GPUs per
process (DataParallel), length-grouped sampling, and datasets without ``__len__``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback

from raylastic import session as _session
from raylastic.data import ElasticDataLoader
from raylastic.integrations._elastic import check_state_kwargs, refuse_or_fall_back
from raylastic.state import STATE_FILE, STORE, ElasticState

_log = logging.getLogger(__name__)

__all__ = ["prepare_trainer", "elastic_state", "gradient_accumulation_steps", "planned_max_steps"]


def gradient_accumulation_steps(global_batch_size: int, world_size: int, per_device_batch_size: int) -> int:
    """Micro-batches per optimizer step that keep ``global_batch_size`` samples per step."""
    for name, value in (
        ("global_batch_size", global_batch_size),
        ("world_size", world_size),
        ("per_device_train_batch_size", per_device_batch_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive int")
    per_round = world_size * per_device_batch_size
    if global_batch_size % per_round:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) is not a multiple of world_size ({world_size}) * "
            f"per_device_train_batch_size ({per_device_batch_size}) = {per_round}: gradient accumulation "
            "cannot keep the global batch constant at this world size. Pick a global_batch_size divisible "
            "by per_device_train_batch_size * every world size between min_workers and max_workers "
            "(or a per_device_train_batch_size that divides it)"
        )
    return global_batch_size // per_round


def planned_max_steps(
    num_examples: int, global_batch_size: int, num_train_epochs: float, max_steps: int
) -> tuple[int, int]:
    """``(steps_per_epoch, max_steps)`` at a fixed global batch (the partial tail is dropped)."""
    steps_per_epoch = num_examples // global_batch_size
    if steps_per_epoch == 0:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) > len(train_dataset) ({num_examples}): "
            "an epoch would have no step; lower global_batch_size"
        )
    if max_steps > 0:
        return steps_per_epoch, max_steps
    if num_train_epochs <= 0:
        raise ValueError(f"num_train_epochs ({num_train_epochs}) must be > 0 when max_steps is not set")
    return steps_per_epoch, math.ceil(num_train_epochs * steps_per_epoch)


def _check_args(trainer: Trainer) -> None:
    args = trainer.args
    refusals = [
        (
            getattr(trainer, "is_deepspeed_enabled", False) or getattr(trainer, "is_fsdp_enabled", False),
            "deepspeed / fsdp: the elastic Trainer supports replicated (DDP) models; use "
            "ElasticState(engine=...) or FSDP2 with ElasticState directly",
        ),
        (
            args.auto_find_batch_size,
            "auto_find_batch_size: it changes per_device_train_batch_size "
            "mid-run, which would move the global batch; set it to False",
        ),
        (
            args.n_gpu > 1,
            f"n_gpu ({args.n_gpu}): one process per GPU is needed (DataParallel is not "
            "supported); give each worker one GPU",
        ),
        (
            getattr(args, "train_sampling_strategy", "random") != "random",
            f"train_sampling_strategy ({getattr(args, 'train_sampling_strategy', None)!r}): the elastic data "
            "plan replaces the sampler; use 'random'",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise ValueError(f"prepare_trainer: unsupported TrainingArguments: {why}")
    dataset = trainer.train_dataset
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise ValueError(
            f"train_dataset ({type(dataset).__name__}) must be a map-style dataset (__getitem__ and "
            "__len__): the elastic data plan places every sample exactly once per epoch by index"
        )


def _saved_global_batch(sess: "_session.Session") -> int | None:
    """The global batch of the state this attempt restores (None: a fresh start).

    Survivors read it from the in-memory snapshot the controller chose; ranks that joined
    hold none and get it with one all-reduce (every rank of the group has the same
    ``RestoreInfo``, so all of them take part). A storage restore reads the checkpoint.
    """
    restore = sess.restore
    found = 0
    if restore.memory_index is not None:
        snap = STORE.get(sess.run_rel, restore.memory_index)
        if snap is not None:
            found = int(snap.plain.get("_objects", {}).get("loader", {}).get("global_batch_size", 0))
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = "cuda" if dist.get_backend() == "nccl" else "cpu"
            box = torch.tensor([found], dtype=torch.int64, device=device)
            dist.all_reduce(box, op=dist.ReduceOp.MAX)
            found = int(box.item())
    elif restore.checkpoint_rel is not None:
        ckpt = sess.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                path = os.path.join(d, STATE_FILE)
                if os.path.exists(path):
                    plain = torch.load(path, weights_only=True).get("plain", {})
                    found = int(plain.get("_objects", {}).get("loader", {}).get("global_batch_size", 0))
    return found or None


class _TrainBatches:
    """What the Trainer iterates: the micro-batches of the steps left, from the position the
    :class:`ElasticDataLoader` holds (restored before the first step). No ``__len__`` and no
    ``set_epoch``: HF then trusts ``max_steps`` and leaves the order to us."""

    def __init__(self, loader: ElasticDataLoader, max_steps: int, steps_per_epoch: int):
        self.loader, self.max_steps, self.steps_per_epoch = loader, max_steps, steps_per_epoch

    def steps_done(self) -> int:
        return self.loader.epoch * self.steps_per_epoch + min(self.loader.state_dict()["step"], self.steps_per_epoch)

    def __iter__(self) -> Iterator[Any]:
        while self.steps_done() < self.max_steps:
            for batch in self.loader:
                yield from batch.micro_batches
                if self.steps_done() >= self.max_steps:
                    return


class _RestoreFirst(TrainerCallback):
    """The restore runs first at ``on_train_begin`` (other callbacks then see the restored
    ``global_step``); the commit runs last at ``on_step_end``: two callbacks, one state."""

    def __init__(self, elastic: "_ElasticCallback"):
        self.elastic = elastic

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.elastic.restore(state)
        return control


class _ElasticCallback(TrainerCallback):
    """Restores before the first step and commits at ``on_step_end`` (see the module docstring)."""

    def __init__(self, trainer: Trainer, batches: _TrainBatches, global_batch_size: int, state_kwargs: dict[str, Any]):
        self.trainer, self.batches, self.global_batch_size = trainer, batches, global_batch_size
        self.state_kwargs = state_kwargs
        self.state: ElasticState | None = None
        self.report_to_ray = False  # a RayTrainReportCallback was dropped: commit its metrics
        self._loss_seen, self._last_logged = 0.0, -1

    def restore(self, state: Any) -> None:
        tr = self.trainer
        optimizer = getattr(tr.optimizer, "optimizer", tr.optimizer)  # Accelerate's wrapper holds the torch one
        self.state = ElasticState(
            model=tr.accelerator.unwrap_model(tr.model),
            optimizer=optimizer,
            lr_scheduler=tr.lr_scheduler,
            loader=self.batches.loader,
            step=0,
            **self.state_kwargs,
        )
        if self.state.step != self.batches.steps_done():
            raise RuntimeError(
                f"restored step ({self.state.step}) != the data position's "
                f"({self.batches.steps_done()}): the snapshot is inconsistent"
            )
        state.global_step = self.state.step
        state.epoch = self.state.step / self.batches.steps_per_epoch
        # HF set these from global_step 0 before this hook; the loss averages and the final
        # train_loss are over the steps this attempt trains.
        tr._initial_global_step = tr._globalstep_last_logged = self.state.step
        self._loss_seen, self._last_logged = 0.0, self.state.step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        assert self.state is not None, "_RestoreFirst.on_train_begin builds the ElasticState"
        state.epoch = state.global_step / self.batches.steps_per_epoch
        metrics: dict[str, Any] = {
            "step": state.global_step,
            "epoch": state.epoch,
            "world_size": args.world_size,
            "global_batch_size": self.global_batch_size,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
        }
        loss = self._step_loss()
        if loss is not None:
            metrics["loss"] = loss
        scheduler = self.trainer.lr_scheduler
        if scheduler is not None and hasattr(scheduler, "get_last_lr"):
            metrics["learning_rate"] = float(scheduler.get_last_lr()[0])
        if self.report_to_ray:  # what RayTrainReportCallback reported: the merged log history
            for log in state.log_history:
                metrics.update({k: v for k, v in log.items() if isinstance(v, (int, float, str))})
        self.state.step = state.global_step
        self.state.commit(metrics)  # a resize unwinds here (StopTraining)
        return control

    def _step_loss(self) -> float | None:
        """This rank's loss of the step just taken: HF sums step losses in ``_tr_loss`` and
        drains it when it logs (after this hook); the difference to the last value is ours."""
        total = getattr(self.trainer, "_tr_loss", None)
        last_logged = getattr(self.trainer, "_globalstep_last_logged", None)
        if not isinstance(total, torch.Tensor) or last_logged is None:
            return None
        if last_logged != self._last_logged:
            self._loss_seen, self._last_logged = 0.0, last_logged
        value = float(total.detach())
        loss, self._loss_seen = value - self._loss_seen, value
        return loss


def _plan(trainer: Trainer, global_batch_size: int | None) -> tuple[Any, int, int, int, int]:
    """(args, global batch, gradient accumulation, steps per epoch, max steps) for this
    world size; ValueError where the trainer cannot be resized in place. Changes nothing."""
    _check_args(trainer)
    sess = _session._get_session()
    args = trainer.args
    world = sess.spec.world_size
    if dist.is_initialized() and dist.get_world_size() != world:
        raise RuntimeError(f"torch.distributed world size ({dist.get_world_size()}) != the session's ({world})")
    if args.world_size != world:
        raise RuntimeError(
            f"TrainingArguments.world_size ({args.world_size}) != the group's ({world}): Accelerate's state is "
            "stale; build TrainingArguments inside the train function (raylastic resets Accelerate's "
            "singletons before each attempt)"
        )
    per_device = args.per_device_train_batch_size
    saved = _saved_global_batch(sess)
    if global_batch_size is None:
        # the script's batch settings describe its full size: max_workers (else this world)
        full = sess.spec.max_workers or world
        global_batch_size = saved if saved is not None else per_device * args.gradient_accumulation_steps * full
    elif saved is not None and saved != global_batch_size:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) != the restored state's ({saved}): "
            f"pass global_batch_size={saved} or start a new run"
        )
    ga = gradient_accumulation_steps(global_batch_size, world, per_device)
    dataset: Any = trainer.train_dataset  # map-style (checked above)
    steps_per_epoch, max_steps = planned_max_steps(
        len(dataset), global_batch_size, args.num_train_epochs, args.max_steps
    )
    return args, global_batch_size, ga, steps_per_epoch, max_steps


def prepare_trainer(
    trainer: Trainer, global_batch_size: int | None = None, *, fallback_to_restart: bool = False, **state_kwargs: Any
) -> Trainer:
    """Make ``trainer`` elastic under raylastic; call it last, right before ``trainer.train()``.

    Args:
        trainer: a ``transformers.Trainer`` built in the train function as usual. Its
            ``train_dataset`` must be map-style; its ``TrainingArguments`` are adjusted in place
            (``gradient_accumulation_steps``, ``max_steps``).
        global_batch_size: samples per optimizer step over all workers, kept at every world
            size. Default: ``per_device_train_batch_size * gradient_accumulation_steps *
            max_workers`` (what the script's settings train with at full size), kept by a
            restored attempt. It must divide by ``per_device_train_batch_size`` times every
            world size between ``min_workers`` and ``max_workers``: give it explicitly
            where the default does not.
        fallback_to_restart: where the trainer cannot be resized in place (the refusals in
            the module docstring, an iterable ``train_dataset`` such as Ray Data's, a global
            batch that does not divide), log a warning and leave the trainer as it is (a
            resize restarts it from its last reported checkpoint, as under Ray Train)
            instead of raising. Ray's ``prepare_trainer``, routed here under raylastic, sets
            it, so Ray Train scripts that worked before keep working.
        state_kwargs: passed to :class:`~raylastic.ElasticState` (``persist_every``,
            ``snapshot_every``, ``async_snapshot``, ``striped``), as in the Lightning
            integration; checked here, before training starts.

    Call it after every other callback is added: the commit (where a resize unwinds the
    train function) must be the last ``on_step_end`` so the others see each step; the
    restore is the first ``on_train_begin``.
    ``RayTrainReportCallback`` is removed: each ``ElasticState.commit`` already reports the
    step's metrics (the merged log history it would report included), and a second report
    per save with the HF checkpoint directory would become the run's latest checkpoint,
    which ``ElasticState`` cannot restore from (its storage fallback would start afresh).
    """
    if not isinstance(trainer, Trainer):
        raise ValueError(f"trainer ({type(trainer).__name__}) must be a transformers.Trainer")
    check_state_kwargs(state_kwargs)
    try:
        plan = _plan(trainer, global_batch_size)
    except ValueError as e:
        refuse_or_fall_back(e, fallback_to_restart, _log, "this Trainer")  # raises e unless it may
        return trainer
    args, global_batch_size, ga, steps_per_epoch, max_steps = plan
    per_device = args.per_device_train_batch_size
    dataset: Any = trainer.train_dataset  # map-style (checked in _plan)
    args.gradient_accumulation_steps, args.max_steps = ga, max_steps
    collate = trainer._get_collator_with_removed_columns(trainer.data_collator, description="training")
    loader = ElasticDataLoader(
        dataset,
        global_batch_size=global_batch_size,
        micro_batch_size=per_device,
        shuffle=True,
        seed=args.data_seed if args.data_seed is not None else args.seed,
        num_workers=args.dataloader_num_workers,
        collate_fn=collate,
        dataloader_kwargs={"pin_memory": bool(args.dataloader_pin_memory and torch.cuda.is_available())},
    )
    batches = _TrainBatches(loader, max_steps, steps_per_epoch)
    # HF iterates it like a dataloader without a length (then it trusts max_steps)
    trainer.get_train_dataloader = lambda: batches  # type: ignore[method-assign,assignment,return-value]
    callback = _ElasticCallback(trainer, batches, global_batch_size, state_kwargs)
    for cb in list(trainer.callback_handler.callbacks):
        if type(cb).__name__ == "RayTrainReportCallback":
            trainer.callback_handler.remove_callback(cb)
            callback.report_to_ray = True
    trainer.callback_handler.callbacks.insert(0, _RestoreFirst(callback))
    trainer.add_callback(callback)
    return trainer


def elastic_state(trainer: Trainer) -> ElasticState | None:
    """The ``ElasticState`` of a prepared trainer's current ``train()`` (None before it
    begins): ``restored_from`` says whether this attempt came back from memory or storage."""
    for cb in trainer.callback_handler.callbacks:
        if isinstance(cb, _ElasticCallback):
            return cb.state
    return None
