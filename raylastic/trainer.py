"""``ElasticTrainer(...).fit()``: validate, start the controller, wait, clean up."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional

import ray
import ray.cloudpickle as cloudpickle
from ray.train import Checkpoint

from raylastic._internal.cluster.notices import sources_from_env
from raylastic._internal.controller.controller import Controller
from raylastic._internal.protocol import TrainFunc
from raylastic._internal.worker_group.keeper import HEAD_RESOURCE, ensure_keeper
from raylastic._internal.cluster.shared_storage import check_shared
from raylastic.checkpoint.lease import LEASE_FILE, RunLease
from raylastic.checkpoint.storage import Storage
from raylastic.config import RunConfig, ScalingConfig
from raylastic.errors import ConfigError, RunInUseError, TrainingAborted
from raylastic.progress import ProgressLine
from raylastic.checkpoint.storage_checkpoint import StorageCheckpoint

logger = logging.getLogger("raylastic")


@dataclass
class Result:
    """What ``fit()`` returns.

    Attributes:
        metrics: the last metrics rank 0 reported.
        checkpoint: the latest committed checkpoint (a ``ray.train.Checkpoint``) or None.
        path: the run directory (local path or URI).
        error: the exception that ended training, or None.
        world_sizes: world size of every group formed, in order (e.g. ``[3, 2, 3]``).
        restarts: how many times the group was re-formed.
    """

    metrics: Dict[str, Any]
    checkpoint: Optional[Checkpoint]
    path: str
    error: Optional[BaseException] = None
    world_sizes: List[int] = field(default_factory=list)
    restarts: int = 0
    return_value: Any = None


class ElasticTrainer:
    """Runs ``train_func`` on between ``min_workers`` and ``max_workers`` Ray workers.

    The group starts as soon as ``min_workers`` can be placed, grows as capacity
    appears, and survives worker and node loss by re-forming the torch process group
    on the survivors and restoring the last committed checkpoint. See the README.
    """

    def __init__(
        self,
        train_func: Callable,
        *,
        train_loop_config: Optional[Dict[str, Any]] = None,
        scaling_config: Optional[ScalingConfig] = None,
        run_config: Optional[RunConfig] = None,
        datasets: Optional[Dict[str, Any]] = None,
        dataset_config: Any = None,
    ):
        if not callable(train_func):
            raise ConfigError(
                f"train_func must be a callable taking (config) or (), got "
                f"{type(train_func).__name__}. Fix: pass the function itself, e.g. "
                "ElasticTrainer(train_func, ...), not train_func()."
            )
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise ConfigError(f"train_loop_config must be a dict or None, got {type(train_loop_config).__name__}.")
        scaling_config = scaling_config or ScalingConfig()
        run_config = run_config or RunConfig()
        if not isinstance(scaling_config, ScalingConfig):
            raise ConfigError(
                "scaling_config must be a raylastic.ScalingConfig "
                f"(got {type(scaling_config).__module__}.{type(scaling_config).__name__})."
            )
        if not isinstance(run_config, RunConfig):
            raise ConfigError(
                "run_config must be a raylastic.RunConfig "
                f"(got {type(run_config).__module__}.{type(run_config).__name__})."
            )
        _check_picklable(train_func, "train_func")
        _check_picklable(train_loop_config, "train_loop_config")
        self._datasets: Dict[str, Any] = {}
        self._split: List[str] = []
        if datasets or dataset_config is not None:
            from raylastic.data.ray_data import validate_datasets  # imports Ray Data: only when used

            self._datasets, self._split = validate_datasets(datasets, dataset_config)
        self._dataset_config = dataset_config  # its execution options: data/ray_data.py ingest_options
        self._train_func = train_func
        self._config = train_loop_config
        self._scaling = scaling_config
        self._run = run_config
        self._name = run_config.name or datetime.now().strftime("raylastic_%Y-%m-%d_%H-%M-%S")
        # Code the controller calls at moments of the run (``_internal/controller/hooks.py``):
        # raylastic.TorchTrainer sets Ray Train's Backend hooks and UserCallbacks here.
        self._hooks: Optional[Any] = None

    @classmethod
    def restore(cls, path: str, train_func: Callable, **kwargs: Any) -> "ElasticTrainer":
        """A trainer that resumes the run at ``path`` (``<storage_path>/<name>``)."""
        path = str(path).rstrip("/")
        scheme, sep, rest = path.partition("://")
        storage_path, _, name = path.rpartition("/")
        # "s3://bucket" is a bucket, not a run: without this it would split into "s3:/" (a
        # *local* directory) and "bucket".
        if not name or not storage_path or (sep and "/" not in rest.strip("/")):
            raise ConfigError(
                f"restore(path={path!r}): expected <storage_path>/<run name>, e.g. "
                f"{(scheme + '://bucket/prefix') if sep else '/mnt/runs'}/my-run."
            )
        run = kwargs.pop("run_config", None) or RunConfig()
        run = replace(run, name=name, storage_path=storage_path)
        return cls(train_func, run_config=run, **kwargs)

    def fit(self, raise_on_error: bool = True) -> Result:
        """Train until the train function returns on every rank, or a budget runs out.

        Raises the error that ended training (``TrainingFailedError``,
        ``InsufficientCapacityError``, ``TrainingAborted``) unless
        ``raise_on_error=False``, in which case it is in ``Result.error``.
        """
        fit_ts = time.time()  # a capacity deadline counts from here
        cap = self._scaling.capacity
        if cap is not None and cap.deadline_s is not None and self._run.total_steps is None:
            raise ConfigError(
                "CapacityPolicy.deadline_s needs the run's length to plan for it: set "
                "RunConfig.total_steps (the number of reports the run makes)"
            )
        storage = Storage(self._run.storage_path, retry=self._run.storage_retry)  # bad URIs/credentials fail here
        try:  # a bad RAYLASTIC_PREEMPTION_SOURCES fails here, not in every worker
            sources_from_env()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        # One fit() per run: a second one fails here, before Ray is started or anything taken.
        lease = RunLease(storage, self._name, ttl_s=self._run.lease_ttl_s)
        epoch_floor = lease.acquire()
        try:
            return self._start(storage, lease, epoch_floor, raise_on_error, fit_ts)
        finally:
            lease.release()

    def _start(
        self, storage: Storage, lease: RunLease, epoch_floor: int, raise_on_error: bool, fit_ts: float
    ) -> Result:
        if not ray.is_initialized():
            ray.init(log_to_driver=True)
        if self._scaling.validate_resources:
            _check_resources(self._scaling)
        if storage.is_local:  # a local path must be one the other hosts see too
            check_shared(storage.path(self._name, LEASE_FILE), lease.token, storage.uri)
        if self._scaling.keep_workers_s:  # created here, by the driver: see keeper.py
            ensure_keeper()
        # On the head node: it holds no CPU/GPU, and must not die with a preempted worker
        # node (the workers it owns would die with it). Soft node affinity is not enough:
        # Ray spills a zero-CPU actor off a zero-CPU head.
        controller_cls = ray.remote(Controller).options(
            num_cpus=0,
            max_concurrency=4,
            max_restarts=0,
            resources={HEAD_RESOURCE: 0.001},
        )
        train_func, plan = self._train_func, None
        if self._datasets:
            from raylastic.data.ray_data import WithDatasets, resolve_datasets, start_coordinators

            plan = start_coordinators(
                resolve_datasets(self._datasets), self._split, {HEAD_RESOURCE: 0.001}, self._dataset_config
            )
            train_func = WithDatasets(train_func, plan)
        try:
            if plan is None:
                return self._fit(
                    storage, controller_cls, train_func, raise_on_error, fit_ts, lease=lease, epoch_floor=epoch_floor
                )
            from raylastic.data.reservation import TrainingReservation

            # Ray Data must not take the CPUs a worker needs after a resize (reservation.py).
            with TrainingReservation(
                f"raylastic-{self._name}",
                self._scaling.worker_resources(),
                self._scaling.max_workers or self._scaling.min_workers,
            ):
                return self._fit(
                    storage, controller_cls, train_func, raise_on_error, fit_ts, lease=lease, epoch_floor=epoch_floor
                )
        finally:
            if plan is not None:
                from raylastic.data.ray_data import stop_coordinators

                stop_coordinators(plan)

    def _fit(
        self,
        storage: Storage,
        controller_cls,
        train_func: Callable,
        raise_on_error: bool,
        fit_ts: Optional[float] = None,
        *,
        lease: Optional[RunLease] = None,
        epoch_floor: int = 0,
    ) -> Result:
        # Put, not passed: the controller hands the reference on and never loads the function.
        func = TrainFunc(ray.put(train_func))
        controller = controller_cls.remote(
            func,
            self._config,
            self._scaling,
            self._run,
            storage,
            self._name,
            self._name,
            fit_ts=fit_ts,
            epoch_floor=epoch_floor,
            hooks=self._hooks,
        )
        run_ref = controller.run.remote()
        progress = ProgressLine(enabled=self._run.progress, total_steps=self._run.total_steps)
        try:
            outcome = _wait(run_ref, controller, progress, lease)
        except KeyboardInterrupt:
            logger.warning("interrupted: stopping workers (Ctrl-C again to force)")
            controller.request_stop.remote()
            try:
                outcome = ray.get(run_ref, timeout=60)
            except BaseException:  # noqa: BLE001 - second Ctrl-C or timeout: kill
                outcome = {
                    "error": TrainingAborted("training was interrupted"),
                    "metrics": {},
                    "checkpoint_rel": None,
                    "world_sizes": [],
                }
            ray.kill(controller, no_restart=True)
            raise KeyboardInterrupt from None
        finally:
            progress.close()
        ray.kill(controller, no_restart=True)
        if lease is not None:
            lease.note_epoch(outcome.get("epoch", 0))
            if lease.lost is not None:  # another fit() took the run over: its error wins
                outcome["error"] = RunInUseError(lease.lost, run=_join_uri(storage.uri, self._name))
        ckpt_rel = outcome.get("checkpoint_rel")
        result = Result(
            metrics=outcome.get("metrics", {}),
            checkpoint=StorageCheckpoint(storage, ckpt_rel) if ckpt_rel else None,
            path=_join_uri(storage.uri, self._name),
            error=outcome.get("error"),
            world_sizes=outcome.get("world_sizes", []),
            restarts=outcome.get("restarts", 0),
            return_value=outcome.get("return_value"),
        )
        if result.error is not None and raise_on_error:
            raise result.error
        return result


def _wait(ref, controller, progress, lease: Optional[RunLease] = None) -> Dict[str, Any]:
    """Wait for the controller's outcome, feeding the progress line on the way.

    Short waits so Ctrl-C reaches Python between them (``ray.get`` blocks signals); the
    status call never blocks the loop (the controller actor is threaded). A lease taken
    over by another fit() stops the run (once).
    """
    status_ref, stop_sent = None, False
    while True:
        ready, _ = ray.wait([ref], timeout=0.5)
        if ready:
            return ray.get(ref)
        if lease is not None and lease.lost is not None and not stop_sent:
            controller.request_stop.remote()
            stop_sent = True
        if not progress.enabled:
            continue
        if status_ref is None:
            status_ref = controller.status.remote()
        elif ray.wait([status_ref], timeout=0)[0]:
            try:
                progress.update(ray.get(status_ref))
            except Exception:  # noqa: BLE001 - display only
                pass
            status_ref = None


def _join_uri(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def _check_picklable(obj: Any, what: str) -> None:
    try:
        cloudpickle.dumps(obj)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"{what} cannot be pickled ({type(e).__name__}: {e}). Ray ships it to every "
            f"worker. Fix: build unpicklable objects (locks, open files, clients, CUDA "
            f"tensors) inside the train function instead of passing them in {what}."
        ) from None


def _check_resources(scaling: ScalingConfig) -> None:
    offered = ray.cluster_resources()
    unknown = [k for k in scaling.custom_resources() if k not in offered]
    if scaling.use_gpu and not offered.get("GPU"):
        unknown.append("GPU")
    if unknown:
        known = sorted(k for k in offered if not k.startswith("node:"))
        raise ConfigError(
            f"ScalingConfig.resources_per_worker asks for {unknown}, which no node in the "
            f"cluster offers (offered: {known}). Fix: start nodes with those resources "
            "(ray start --resources / --num-gpus), fix the name, or pass "
            "validate_resources=False if an autoscaler will add such nodes."
        )
