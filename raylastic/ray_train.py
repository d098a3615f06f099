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

import contextlib
import copy
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import pandas as pd
import pyarrow.fs as pafs
from ray.train import Checkpoint
from ray.train.v2.api.result import Result as RayResult

from raylastic import session as _session
from raylastic._internal.ray_train_checkpoints import (
    Retention,
    honour_dir_names,
    settle_before_error,
    write_ray_snapshot,
)
from raylastic._internal.ray_train_errors import as_ray_error
from raylastic._internal.ray_train_hooks import RayTrainHooks
from raylastic._internal.ray_train_local import LocalRun, is_local_mode
from raylastic._internal.ray_train_local import check_config as check_local_config
from raylastic.checkpoint import scoring
from raylastic.checkpoint.manager import committed_checkpoints
from raylastic.checkpoint.storage import Storage
from raylastic.config import CheckpointConfig
from raylastic.errors import ConfigError, TrainingFailedError
from raylastic.ray_train_config import Translation, translate
from raylastic.checkpoint.storage_checkpoint import StorageCheckpoint
from raylastic.trainer import ElasticTrainer
from raylastic.trainer import Result as ElasticResult

logger = logging.getLogger("raylastic")


@dataclass
class TorchTrainerResult(RayResult):
    """``ray.train.Result`` with raylastic's membership history.

    Ray Train's attributes: ``metrics`` (the last metrics rank 0 reported), ``checkpoint``
    (the latest committed checkpoint), ``error`` (None: ``fit()`` raises instead),
    ``path`` (the run directory on ``filesystem``), ``filesystem``, ``best_checkpoints``
    (the best ``num_to_keep`` committed checkpoints by ``checkpoint_score_attribute``, worst
    first, or without one the kept checkpoints oldest first, each with the metrics rank 0
    reported with it), ``metrics_dataframe`` (one row per best checkpoint, as in Ray Train),
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
            (gloo on CPU, NCCL on GPU). Or any other ``ray.train.backend.BackendConfig``
            (what Ray's ``DataParallelTrainer(backend_config=...)`` takes): its backend's
            ``on_start`` / ``on_training_start`` / ``on_shutdown`` run around every group
            formed, and its ``train_func_context`` around the train function.
        scaling_config: ``ray.train.ScalingConfig``; ``num_workers=n`` or ``(min, max)``.
        run_config: ``ray.train.RunConfig`` with its ``FailureConfig`` and ``CheckpointConfig``;
            its ``callbacks`` (``ray.train.UserCallback``) are called as Ray Train calls them;
            ``storage_filesystem`` (a picklable ``pyarrow.fs.FileSystem``) holds the run at
            ``storage_path`` on it. ``report(checkpoint_dir_name=name)`` writes ``<run>/<name>/``.
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

    def __init__(
        self,
        train_loop_per_worker: Callable,
        *,
        train_loop_config: Optional[Dict[str, Any]] = None,
        torch_config: Any = None,
        scaling_config: Any = None,
        run_config: Any = None,
        datasets: Optional[Dict[str, Any]] = None,
        dataset_config: Any = None,
        validation_config: Any = None,
        metadata: Optional[Dict[str, Any]] = None,
        resume_from_checkpoint: Optional[Checkpoint] = None,
    ):
        if not callable(train_loop_per_worker):
            raise ConfigError(
                f"train_loop_per_worker must be a callable taking (config) or (), got "
                f"{type(train_loop_per_worker).__name__}. Fix: pass the function itself."
            )
        if validation_config is not None:
            raise ConfigError(
                "TorchTrainer(validation_config=...) is not supported by raylastic: it runs no "
                "validation tasks. Fix: validate inside the train function, or after fit() on "
                "result.best_checkpoints."
            )
        if metadata is not None:
            raise ConfigError(
                "TorchTrainer(metadata=...) is not supported (Ray Train 2.x deprecated it too). "
                "Fix: pass the values in train_loop_config, or save them in your checkpoints."
            )
        self._local: Optional[LocalRun] = None
        if is_local_mode(scaling_config):  # num_workers=0: Ray Train's local mode (_internal/ray_train_local.py)
            self.scaling_config, self.run_config, self.train_loop_config = scaling_config, run_config, train_loop_config
            self.translation = check_local_config(scaling_config, run_config, torch_config)
            if resume_from_checkpoint is not None:
                _check_checkpoint(resume_from_checkpoint)
            self._local = LocalRun(
                train_loop_per_worker,
                train_loop_config,
                torch_config,
                cast(str, self.translation.run.name),
                datasets,
                resume_from_checkpoint,
            )
            return
        translation = translate(scaling_config, run_config, torch_config)
        for note in translation.ignored:
            logger.info("TorchTrainer: %s", note)
        if resume_from_checkpoint is not None:
            _check_checkpoint(resume_from_checkpoint)
        ship_by_value(train_loop_per_worker)
        backend = translation.backend
        func = ResumeFrom(
            train_loop_per_worker,
            resume_from_checkpoint,
            Retention.of(translation.run.checkpoint_config),
            context=backend.train_func_context if backend is not None else None,
        )
        self.scaling_config = scaling_config
        self.run_config = run_config
        self.train_loop_config = train_loop_config
        self.translation = translation
        self._trainer = ElasticTrainer(
            func,
            train_loop_config=train_loop_config,
            scaling_config=translation.scaling,
            run_config=translation.run,
            datasets=datasets,
            dataset_config=dataset_config,
        )
        if chdir_to_run_dir_enabled():  # read here, in the driver, as Ray Train reads it
            func.working_dir = translation.run.name or self._trainer._name
        if backend is not None or translation.callbacks:
            self._trainer._hooks = RayTrainHooks(
                backend,
                translation.callbacks,
                run_context(translation, scaling_config, run_config, torch_config, train_loop_config, dataset_config),
                translation.run.storage_path,
                translation.scaling.worker_resources(),
            )

    def fit(self) -> TorchTrainerResult:
        """Train; raise the error that ended training (as Ray Train's ``fit`` does): a
        ``raylastic.TrainingFailedError`` that is also a ``ray.train.TrainingFailedError``
        (``WorkerGroupError`` when ranks failed, ``ControllerError`` otherwise),
        ``InsufficientCapacityError``, ``TrainingAborted``. Either way the run directory gets
        Ray's checkpoint-manager snapshot, so ``ray.train.Result.from_path`` reads it.
        In local mode (``num_workers=0``) the train function runs here, its own exception
        propagates, and nothing is written to storage (``path`` is None), as in Ray Train."""
        if self._local is not None:
            out = self._local.run()
            return TorchTrainerResult(
                metrics=out.metrics,
                checkpoint=out.checkpoint,
                error=None,
                path=cast(Any, None),
                return_value=out.return_value,
                world_sizes=[out.world_size],
            )
        run = self.translation.run
        name = run.name or self._trainer._name  # the one given, or the one ElasticTrainer generated
        try:
            result = self._trainer.fit()
        except TrainingFailedError as e:
            _snapshot(run, name)
            raise as_ray_error(e) from e
        _snapshot(run, name)
        return ray_result(result, run.storage_path, name, run.checkpoint_config)


def ship_by_value(func: Callable) -> bool:
    """Pickle ``func``'s module by value when Ray's processes may not import it by name.

    cloudpickle pickles a function by reference (module and name) unless it lives in
    ``__main__``; the controller actor and the workers then import the module. Ray puts the
    driver's working directory and script directory on its workers' ``sys.path``, and they
    inherit ``PYTHONPATH`` on a local cluster; a top-level module elsewhere (a test file
    collected by pytest from another directory, a module the driver put on its own
    ``sys.path``) fails with ``ModuleNotFoundError`` in the controller. Such a module (outside
    the installed packages and the standard library too) is registered with ``ray.cloudpickle.register_pickle_by_value`` (for the
    whole process, as cloudpickle's registry is), so the function and the module globals
    it uses travel with it, as for ``__main__``. Returns whether it was registered."""
    import sys
    import sysconfig

    from ray import cloudpickle

    name = getattr(func, "__module__", None) or getattr(type(func), "__module__", None)
    module = sys.modules.get(name or "")
    path = getattr(module, "__file__", None)
    if module is None or not name or name == "__main__" or "." in name or not path:
        return False
    path = os.path.realpath(path)
    installed = {os.path.realpath(p) for k, p in sysconfig.get_paths().items() if k in ("purelib", "platlib", "stdlib")}
    if any(path.startswith(root + os.sep) for root in installed):
        return False
    reachable = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    reachable |= {os.path.realpath(os.curdir), os.path.dirname(os.path.realpath(sys.argv[0] or os.curdir))}
    if os.path.dirname(path) in reachable:
        return False
    cloudpickle.register_pickle_by_value(module)
    return True


def _check_checkpoint(ckpt: Any) -> None:
    if not isinstance(ckpt, Checkpoint):
        raise ConfigError(
            f"resume_from_checkpoint must be a ray.train.Checkpoint, got {type(ckpt).__name__}. "
            "Fix: ray.train.Checkpoint.from_directory(path) or Checkpoint(path, filesystem)."
        )
    fs = ckpt.filesystem
    if fs is None:
        raise ConfigError(
            f"resume_from_checkpoint={ckpt!r} has no filesystem. Fix: "
            "ray.train.Checkpoint.from_directory(path) or Checkpoint(path, filesystem)."
        )
    info = fs.get_file_info(ckpt.path)
    if info.type != pafs.FileType.Directory:
        raise ConfigError(
            f"resume_from_checkpoint={ckpt!r}: no directory at {ckpt.path!r} "
            f"({fs.type_name} filesystem). Fix: point it at an existing checkpoint "
            "directory that every node can read."
        )


class ResumeFrom:
    """The train function as a worker runs it: ``checkpoint`` (``resume_from_checkpoint``,
    or None) is what ``get_checkpoint()`` returns until the run commits a checkpoint of its
    own (then, after any restart, that one wins); ``retention`` is the run's
    ``CheckpointConfig`` rules, which ``ray.train.get_all_reported_checkpoints()`` applies;
    ``context`` (a custom ``BackendConfig``'s ``train_func_context``) is entered around the
    train function, as Ray Train's workers do; ``working_dir`` (the run's name, or None) is
    the directory under ``<Ray session dir>/artifacts/`` the worker changes into first
    (``RAY_CHDIR_TO_TRIAL_DIR``, on by default, as in Ray Train)."""

    def __init__(
        self,
        func: Callable,
        checkpoint: Optional[Checkpoint] = None,
        retention: Optional[Retention] = None,
        context: Optional[Callable] = None,
        working_dir: Optional[str] = None,
    ):
        self.func = func
        self.checkpoint = checkpoint
        self.retention = retention or Retention()
        self.context = context
        self.working_dir = working_dir

    def __call__(self, config: Dict[str, Any]) -> Any:
        # Here, not at the top: the worker module imports torch (it is loaded already in
        # the worker process this runs in).
        from raylastic._internal import ray_train_compat
        from raylastic._internal.worker_group.worker import _call

        if self.checkpoint is not None:
            _session._get_session().initial_checkpoint = self.checkpoint
        ray_train_compat.set_retention(self.retention)
        honour_dir_names()
        if self.working_dir is not None:
            chdir_to_run_dir(self.working_dir)
        try:
            with (self.context or contextlib.nullcontext)():
                return _call(self.func, config)
        except Exception:
            finish_uploads()
            raise


UPLOAD_WAIT_ON_ERROR_S = 60.0
SETTLE_ON_ERROR_S = 10.0


def finish_uploads(timeout_s: float = UPLOAD_WAIT_ON_ERROR_S, settle_s: float = SETTLE_ON_ERROR_S) -> None:
    """The train function raised: let this rank's checkpoint uploads in flight finish (at
    most ``timeout_s``), then wait (at most ``settle_s``) for the checkpoint of its last
    reports to commit with the other ranks' (``ray_train_checkpoints.settle_before_error``),
    before the error reaches the controller: every checkpoint reported before the error can
    commit, as in Ray Train, where ``report()`` returns once its checkpoint is registered.
    (A stop or abort is a ``BaseException``: not waited for.)"""
    sess = _session._session
    if sess is None or sess.aborted:
        return
    if sess.uploader is not None:
        sess.uploader.wait(timeout_s)
    try:
        settle_before_error(sess, settle_s)
    except Exception as e:  # noqa: BLE001 - the train function's own error is what must surface
        logger.debug("settling reports before the error failed: %s", e)


def chdir_to_run_dir_enabled() -> bool:
    """``RAY_CHDIR_TO_TRIAL_DIR`` as Ray Train reads it (``env_bool``, default on)."""
    from ray._private.ray_constants import env_bool
    from ray.train.constants import RAY_CHDIR_TO_TRIAL_DIR

    return bool(env_bool(RAY_CHDIR_TO_TRIAL_DIR, True))


def chdir_to_run_dir(name: str) -> str:
    """Change this worker process into ``<Ray session dir>/artifacts/<name>`` (created if
    missing), Ray Train's per-run working directory on every node, and return it. The change
    is process-wide and stays after the train function, as in Ray Train's workers."""
    from ray.train.constants import _get_ray_train_session_dir

    path = os.path.join(_get_ray_train_session_dir(), name)
    os.makedirs(path, exist_ok=True)
    os.chdir(path)
    return path


def run_context(
    translation: Translation,
    scaling_config: Any,
    run_config: Any,
    torch_config: Any,
    train_loop_config: Optional[Dict[str, Any]],
    dataset_config: Any,
) -> Any:
    """Ray Train's ``TrainRunContext`` of this trainer (the ``run_context`` its
    ``UserCallback``s get): the configs as given, Ray's defaults for those left out, and the
    run's name as raylastic runs it."""
    from ray.train import DataConfig
    from ray.train.torch import TorchConfig
    from ray.train.v2._internal.execution.context import TrainRunContext
    from ray.train.v2.api.config import RunConfig as RayRunConfig, ScalingConfig as RayScalingConfig

    rc = copy.copy(run_config) if run_config is not None else RayRunConfig()
    rc.name = translation.run.name or rc.name
    return TrainRunContext(
        run_config=rc,
        train_loop_config=train_loop_config,
        scaling_config=scaling_config if scaling_config is not None else RayScalingConfig(),
        backend_config=torch_config if torch_config is not None else TorchConfig(),
        dataset_config=dataset_config if dataset_config is not None else DataConfig(),
    )


def _snapshot(run: Any, name: str) -> None:
    """Ray's checkpoint-manager snapshot of run ``name``; a storage error is logged, never
    raised over the run's own outcome."""
    try:
        write_ray_snapshot(Storage(run.storage_path), name, run.checkpoint_config)
    except Exception as e:  # noqa: BLE001 - the run's result or error matters more
        logger.warning("could not write Ray Train's checkpoint_manager_snapshot.json for run %s: %s", name, e)


def ray_result(
    result: ElasticResult, storage_path: str, name: str, checkpoint_config: Optional[CheckpointConfig] = None
) -> TorchTrainerResult:
    """Ray Train's result for raylastic's, reading the run's committed checkpoints:
    ``best_checkpoints`` are the best ``num_to_keep`` by the score attribute (worst first),
    or the kept ones oldest first, as Ray Train lists them."""
    cc = checkpoint_config or CheckpointConfig()
    storage = Storage(storage_path)
    ranked = scoring.best(committed_checkpoints(storage, name), cc.num_to_keep, cc.score_attribute, cc.score_order)
    best: List[Tuple[Checkpoint, Dict[str, Any]]] = [
        (StorageCheckpoint(storage, c.rel), dict(c.metrics)) for c in ranked
    ]
    return TorchTrainerResult(
        # fit() raises instead of returning an error: Ray's field type (its TrainingFailedError) is moot
        metrics=result.metrics,
        checkpoint=result.checkpoint,
        error=cast(Any, result.error),
        path=storage.path(name),
        _storage_filesystem=storage.fs,
        best_checkpoints=best,
        metrics_dataframe=pd.DataFrame([m for _, m in best]) if best else None,
        return_value=result.return_value,
        world_sizes=list(result.world_sizes),
        restarts=result.restarts,
    )
