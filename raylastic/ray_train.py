"""``raylastic.TorchTrainer``: Ray Train's ``TorchTrainer``, run by ``ElasticTrainer``.

A Ray Train user changes one import::

    from ray.train.torch import TorchTrainer   ->   from raylastic import TorchTrainer

and keeps the train function and Ray Train's own configs. ``ScalingConfig(num_workers=4)``
is a fixed size (that still survives node loss), ``num_workers=(2, 4)`` is elastic. The
configs are translated field by field (``raylastic.ray_train_config``); anything raylastic
cannot honour raises ``ConfigError`` in the constructor, before ``ray.init``. ``fit()``
returns a ``ray.train.Result`` (subclass) built from raylastic's result and the run's
committed checkpoints.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import pandas as pd
import pyarrow.fs as pafs
from ray.train import Checkpoint
from ray.train.v2.api.result import Result as RayResult

from raylastic import session as _session
from raylastic.checkpoint.manager import committed_checkpoints
from raylastic.checkpoint.storage import Storage
from raylastic.errors import ConfigError
from raylastic.ray_train_config import translate
from raylastic.session import StorageCheckpoint
from raylastic.trainer import ElasticTrainer
from raylastic.trainer import Result as ElasticResult

logger = logging.getLogger("raylastic")


@dataclass
class TorchTrainerResult(RayResult):
    """``ray.train.Result`` with raylastic's membership history.

    Ray Train's attributes: ``metrics`` (the last metrics rank 0 reported), ``checkpoint``
    (the latest committed checkpoint), ``error`` (None: ``fit()`` raises instead),
    ``path`` (the run directory on ``filesystem``), ``filesystem``, ``best_checkpoints``
    (the committed checkpoints kept, oldest first, with the metrics rank 0 reported with
    each), ``metrics_dataframe`` (one row per kept checkpoint, as in Ray Train 2.x),
    ``return_value`` (what rank 0's train function returned), ``get_best_checkpoint``.
    Added: ``world_sizes`` (every group formed, in order) and ``restarts``.
    """

    world_sizes: List[int] = field(default_factory=list)
    restarts: int = 0


class TorchTrainer:
    """Ray Train's ``TorchTrainer`` signature, elastic and fault tolerant.

    Args:
        train_loop_per_worker: the train function, as for Ray Train (``ray.train.report``,
            ``get_checkpoint``, ``get_context``, ``ray.train.torch.prepare_model`` /
            ``prepare_data_loader`` work unchanged).
        train_loop_config: the dict passed to it.
        torch_config: ``ray.train.torch.TorchConfig``; only its defaults can be kept
            (gloo on CPU, NCCL on GPU).
        scaling_config: ``ray.train.ScalingConfig``; ``num_workers=n`` or ``(min, max)``.
        run_config: ``ray.train.RunConfig`` with its ``FailureConfig`` and ``CheckpointConfig``.
        datasets: ``{name: ray.data.Dataset}``; ``ray.train.get_dataset_shard(name)`` in the
            train function returns this rank's iterator. Split datasets keep a position
            that survives resizes (docs/data.md, "Ray Data input").
        dataset_config: ``ray.train.DataConfig``: ``datasets_to_split`` ("all" or names;
            the others are given whole to every rank).
        validation_config, metadata: not supported (``ConfigError``).
        resume_from_checkpoint: a ``ray.train.Checkpoint`` that ``ray.train.get_checkpoint()``
            returns until the run has committed a checkpoint of its own.

    See docs/ray_train.md for what each config field does here.
    """

    def __init__(self, train_loop_per_worker: Callable, *, train_loop_config: Optional[Dict[str, Any]] = None,
                 torch_config: Any = None, scaling_config: Any = None, run_config: Any = None,
                 datasets: Optional[Dict[str, Any]] = None, dataset_config: Any = None,
                 validation_config: Any = None, metadata: Optional[Dict[str, Any]] = None,
                 resume_from_checkpoint: Optional[Checkpoint] = None):
        if not callable(train_loop_per_worker):
            raise ConfigError(
                f"train_loop_per_worker must be a callable taking (config) or (), got "
                f"{type(train_loop_per_worker).__name__}. Fix: pass the function itself.")
        if validation_config is not None:
            raise ConfigError(
                "TorchTrainer(validation_config=...) is not supported by raylastic: it runs no "
                "validation tasks. Fix: validate inside the train function, or after fit() on "
                "result.best_checkpoints.")
        if metadata is not None:
            raise ConfigError(
                "TorchTrainer(metadata=...) is not supported (Ray Train 2.x deprecated it too). "
                "Fix: pass the values in train_loop_config, or save them in your checkpoints.")
        translation = translate(scaling_config, run_config, torch_config)
        for note in translation.ignored:
            logger.info("TorchTrainer: %s", note)
        func: Callable = train_loop_per_worker
        if resume_from_checkpoint is not None:
            _check_checkpoint(resume_from_checkpoint)
            func = ResumeFrom(train_loop_per_worker, resume_from_checkpoint)
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.train_loop_config = train_loop_config
        self.translation = translation
        self._trainer = ElasticTrainer(func, train_loop_config=train_loop_config,
                                       scaling_config=translation.scaling, run_config=translation.run,
                                       datasets=datasets, dataset_config=dataset_config)

    def fit(self) -> TorchTrainerResult:
        """Train; raise the error that ended training (as Ray Train's ``fit`` does):
        ``raylastic.TrainingFailedError``, ``InsufficientCapacityError``, ``TrainingAborted``."""
        result = self._trainer.fit()
        return ray_result(result, self.translation.run.storage_path, self.translation.run.name)


def _check_checkpoint(ckpt: Any) -> None:
    if not isinstance(ckpt, Checkpoint):
        raise ConfigError(
            f"resume_from_checkpoint must be a ray.train.Checkpoint, got {type(ckpt).__name__}. "
            "Fix: ray.train.Checkpoint.from_directory(path) or Checkpoint(path, filesystem).")
    info = ckpt.filesystem.get_file_info(ckpt.path)
    if info.type != pafs.FileType.Directory:
        raise ConfigError(
            f"resume_from_checkpoint={ckpt!r}: no directory at {ckpt.path!r} "
            f"({ckpt.filesystem.type_name} filesystem). Fix: point it at an existing checkpoint "
            "directory that every node can read.")


class ResumeFrom:
    """The train function, with ``checkpoint`` as what ``get_checkpoint()`` returns until
    the run commits a checkpoint of its own (then, after any restart, that one wins)."""

    def __init__(self, func: Callable, checkpoint: Checkpoint):
        self.func = func
        self.checkpoint = checkpoint

    def __call__(self, config: Dict[str, Any]) -> Any:
        # Here, not at the top: the worker module imports torch (it is loaded already in
        # the worker process this runs in).
        from raylastic._internal.worker_group.worker import _call

        _session._get_session().initial_checkpoint = self.checkpoint
        return _call(self.func, config)


def ray_result(result: ElasticResult, storage_path: str, name: str) -> TorchTrainerResult:
    """Ray Train's result for raylastic's, reading the run's committed checkpoints."""
    storage = Storage(storage_path)
    best = [(StorageCheckpoint(storage, c.rel), dict(c.metrics))
            for c in committed_checkpoints(storage, name)]
    return TorchTrainerResult(
        metrics=result.metrics, checkpoint=result.checkpoint, error=result.error,
        path=storage.path(name), _storage_filesystem=storage.fs, best_checkpoints=best,
        metrics_dataframe=pd.DataFrame([m for _, m in best]) if best else None,
        return_value=result.return_value, world_sizes=list(result.world_sizes), restarts=result.restarts,
    )
