"""Lightning's loop counters and the batch arithmetic of an elastic Lightning run.

Apart from :mod:`raylastic.integrations.lightning` so that module stays within its size;
these are the parts that touch Lightning 2.6's progress trackers (private attributes: the
unit tests catch a change on upgrade).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional, Tuple

if TYPE_CHECKING:
    import lightning.pytorch as pl


def accumulation(global_batch_size: int, world_size: int, micro_batch_size: int) -> int:
    """Micro-batches per rank per optimizer step that keep ``global_batch_size`` constant."""
    per_step = world_size * micro_batch_size
    if global_batch_size <= 0 or global_batch_size % per_step:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) is not a multiple of world_size ({world_size}) * "
            f"micro batch size ({micro_batch_size}, the train DataLoader's batch_size): the global batch "
            "cannot stay constant. Pick a global_batch_size divisible by batch_size * every world size "
            "between min_workers and max_workers (or a batch_size that divides it)"
        )
    return global_batch_size // per_step


def resume_point(position: Optional[Dict[str, Any]], steps_per_epoch: int) -> Tuple[int, int]:
    """(epoch, step within it) the next optimizer step trains, from a loader position
    (``ElasticDataLoader.state_dict()``); a finished epoch resumes at the next one's start."""
    if not position:
        return 0, 0
    epoch, step = int(position["epoch"]), int(position["step"])
    return (epoch + 1, 0) if step >= steps_per_epoch else (epoch, step)


def _set(progress: Any, value: int) -> None:
    """Every counter of a Lightning progress tracker (ready/started/processed/completed)."""
    for name in ("ready", "started", "processed", "completed"):
        if hasattr(progress, name):
            setattr(progress, name, value)


def set_loop_counters(
    trainer: "pl.Trainer", *, epoch: int, step_in_epoch: int, global_step: int, accumulate: int
) -> None:
    """Put Lightning's loops where a resumed run stands, before ``fit_loop.reset()``.

    ``trainer.current_epoch`` (epoch progress), ``trainer.global_step`` (the optimizer's
    step progress), the logging step and the epoch's batch index (``step_in_epoch *
    accumulate`` micro-batches at this world size) are set. Mid-epoch, the epoch loop is
    marked restarting so its ``reset()`` keeps that batch index (Lightning's own mid-epoch
    resume path), which makes ``is_last_batch`` and the epoch end come where the data ends.
    """
    fit_loop = trainer.fit_loop
    for part in (fit_loop.epoch_progress.current, fit_loop.epoch_progress.total):
        _set(part, epoch)
    loop = fit_loop.epoch_loop
    optim = loop.automatic_optimization.optim_progress.optimizer
    for tracker in (optim.step.total, optim.zero_grad.total):
        _set(tracker, global_step)
    _set(loop.scheduler_progress.total, global_step)
    loop._batches_that_stepped = global_step
    _set(loop.batch_progress.current, step_in_epoch * accumulate)
    _set(loop.batch_progress.total, global_step * accumulate)
    loop.batch_progress.is_last_batch = False
    if step_in_epoch:
        loop._restarting = True
