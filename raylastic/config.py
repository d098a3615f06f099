"""User-facing configuration: frozen, keyword-only dataclasses validated at construction.

Every check here runs before any Ray actor or placement is requested, so a typo costs
a traceback, not a cluster. Messages name the field, the value and the fix.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Dict, Mapping, Optional

from raylastic.errors import ConfigError
from raylastic.policies.capacity import CapacityPolicy

_STANDARD_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """How many workers to run and what each one needs.

    Training starts as soon as ``min_workers`` can be placed and grows toward
    ``max_workers`` as capacity appears; losing workers shrinks the group down to
    ``min_workers`` before training pauses to wait for capacity.

    Args:
        min_workers: fewest workers training may run with (>= 1).
        max_workers: most workers to run; defaults to ``min_workers`` (a fixed size
            that still survives node loss by waiting for replacements).
        resources_per_worker: Ray resources each worker actor reserves. Defaults to
            one CPU (or one GPU and one CPU with ``use_gpu``).
        use_gpu: train with NCCL on one GPU per worker instead of gloo on CPU.
        max_wait_s: how long fewer than ``min_workers`` may be placeable before
            ``fit()`` fails with ``InsufficientCapacityError``. ``None`` waits
            forever (logging every 30 s).
        validate_resources: reject resource names that no node offers at ``fit()``
            time. Turn off on an autoscaling cluster that starts without the nodes
            that carry a custom resource.
        capacity: a ``raylastic.policies.capacity.CapacityPolicy``: spot first,
            on-demand fallback, back to spot (see docs/spot.md). Workers are then placed
            per node type (custom resource ``node_type:<name>``) and the autoscaler is
            asked for slots of each type. ``None``: any node with the resources.
    """

    min_workers: int = 1
    max_workers: Optional[int] = None
    resources_per_worker: Optional[Mapping[str, float]] = None
    use_gpu: bool = False
    max_wait_s: Optional[float] = None
    validate_resources: bool = True
    capacity: Optional[Any] = None

    def __post_init__(self) -> None:
        _check(
            isinstance(self.min_workers, int) and self.min_workers >= 1,
            f"ScalingConfig.min_workers must be an int >= 1, got {self.min_workers!r}. "
            "Fix: pass min_workers=1 or more.",
        )
        if self.max_workers is None:
            object.__setattr__(self, "max_workers", self.min_workers)
        _check(
            isinstance(self.max_workers, int) and self.max_workers >= 1,
            f"ScalingConfig.max_workers must be an int >= 1, got {self.max_workers!r}.",
        )
        _check(
            self.min_workers <= self.max_workers,
            f"ScalingConfig: min_workers ({self.min_workers}) > max_workers "
            f"({self.max_workers}). Fix: raise max_workers or lower min_workers.",
        )
        if self.max_wait_s is not None:
            _check(
                isinstance(self.max_wait_s, (int, float)) and self.max_wait_s > 0,
                f"ScalingConfig.max_wait_s must be > 0 seconds or None (wait forever), "
                f"got {self.max_wait_s!r}.",
            )
        if self.resources_per_worker is not None:
            _check(
                isinstance(self.resources_per_worker, Mapping),
                "ScalingConfig.resources_per_worker must be a dict like {'CPU': 1}, "
                f"got {type(self.resources_per_worker).__name__}.",
            )
            for name, amount in self.resources_per_worker.items():
                _check(
                    isinstance(name, str) and name != "",
                    f"ScalingConfig.resources_per_worker has a bad key {name!r}: "
                    "resource names are non-empty strings.",
                )
                _check(
                    isinstance(amount, (int, float))
                    and not isinstance(amount, bool)
                    and amount >= 0
                    and math.isfinite(amount),
                    f"ScalingConfig.resources_per_worker[{name!r}] must be a number "
                    f">= 0, got {amount!r}.",
                )
            gpus = self.resources_per_worker.get("GPU", 0)

            _check(
                not (gpus and not self.use_gpu),
                "ScalingConfig.resources_per_worker asks for GPU but use_gpu=False. "
                "Fix: pass use_gpu=True (NCCL) or drop 'GPU' from resources_per_worker.",
            )

        if self.capacity is not None:
            _check(isinstance(self.capacity, CapacityPolicy),
                   "ScalingConfig.capacity must be a raylastic.policies.capacity.CapacityPolicy, got "
                   f"{type(self.capacity).__name__}.")
            try:
                self.capacity.validate_scaling(min_workers=self.min_workers, max_workers=self.max_workers)
            except ValueError as e:
                raise ConfigError(f"ScalingConfig.capacity: {e}") from None

    def worker_resources(self) -> Dict[str, float]:
        """The Ray resources one worker actor reserves."""
        res = dict(self.resources_per_worker or {})
        if not res:
            res = {"CPU": 1.0}
        if self.use_gpu and not res.get("GPU"):
            res["GPU"] = 1.0
        return res

    def custom_resources(self) -> Dict[str, float]:
        return {k: v for k, v in self.worker_resources().items() if k not in _STANDARD_RESOURCES}

    @property
    def backend(self) -> str:
        return "nccl" if self.use_gpu else "gloo"


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    """Retry budgets, counted separately because they mean different things.

    Args:
        max_failures: how many real failures (an exception raised by the train
            function, a crashed worker process on a healthy node) to recover from
            before ``fit()`` fails. ``-1`` means unlimited. Default 0: user bugs
            surface at once.
        max_node_failures: how many node losses / preemptions to recover from.
            ``None`` (default) means unlimited: losing spot nodes is the normal case.
    """

    max_failures: int = 0
    max_node_failures: Optional[int] = None

    def __post_init__(self) -> None:
        _check(
            isinstance(self.max_failures, int) and self.max_failures >= -1,
            f"FailureConfig.max_failures must be an int >= -1 (-1 = unlimited), got "
            f"{self.max_failures!r}.",
        )
        if self.max_node_failures is not None:
            _check(
                isinstance(self.max_node_failures, int) and self.max_node_failures >= 0,
                "FailureConfig.max_node_failures must be an int >= 0 or None "
                f"(unlimited), got {self.max_node_failures!r}.",
            )


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """What to keep of the checkpoints the train function reports.

    Args:
        num_to_keep: committed checkpoints to keep (oldest deleted first). ``None``
            keeps all. The newest committed checkpoint is never deleted, and an older
            one is only deleted after a newer one is committed, so at least two exist
            while a new one is being written.
        async_upload: ``report(checkpoint=...)`` returns once the files are copied to
            local staging (with checksums); the upload runs in the background, at most
            one pending per worker. ``False`` waits for the upload inside ``report``.

        persist_every: with ``ElasticState``, write every N-th in-memory snapshot to
            storage (in the background). ``None``: only snapshots in memory, plus what
            the train function reports itself.
    """

    num_to_keep: Optional[int] = None
    async_upload: bool = True
    persist_every: Optional[int] = None

    def __post_init__(self) -> None:
        if self.num_to_keep is not None:
            _check(
                isinstance(self.num_to_keep, int) and self.num_to_keep >= 1,
                f"CheckpointConfig.num_to_keep must be an int >= 1 or None (keep all), "
                f"got {self.num_to_keep!r}.",
            )
        if self.persist_every is not None:
            _check(isinstance(self.persist_every, int) and self.persist_every >= 1,
                   f"CheckpointConfig.persist_every must be an int >= 1 or None, got {self.persist_every!r}.")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where a run lives and how it reacts to failures.

    Args:
        name: the run's directory name under ``storage_path``. Calling ``fit()``
            again with the same name and storage path resumes from the run's last
            committed checkpoint. Defaults to a timestamped name.
        storage_path: local path or URI (``s3://``, ``abfs://``, ``gs://``, any
            ``pyarrow.fs`` URI) under which the run directory is written. On a
            multi-node cluster a local path must be shared by every node.
        poll_interval_s: how often the controller collects metrics from workers.
            Training never waits for it.
        verbose: print resize/failure messages (from the controller) to stdout.
        progress: show one live status line during ``fit()`` (step, world size,
            throughput, last loss, ETA, recoveries); plain lines when stdout is not a TTY.
        tensorboard: write scalars (metrics, world size, throughput, cost so far) to
            ``<run>/tensorboard``.
        total_steps: the number of reports the run will make, if known: enables the
            ETA of the progress line.
        storage_retry: a ``raylastic.checkpoint.storage.RetryPolicy`` for transient
            storage errors (attempts, backoff); ``None`` keeps the default (5 attempts,
            0.2-5 s exponential backoff with jitter).
    """

    name: Optional[str] = None
    storage_path: str = "~/raylastic_results"
    failure_config: FailureConfig = field(default_factory=FailureConfig)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    poll_interval_s: float = 0.1
    verbose: bool = True
    progress: bool = True
    tensorboard: bool = True
    total_steps: Optional[int] = None
    storage_retry: Optional[Any] = None

    def __post_init__(self) -> None:
        if self.storage_retry is not None:
            # Here, not at the top: storage imports pyarrow, and configs stay cheap to import.
            from raylastic.checkpoint.storage import RetryPolicy

            _check(isinstance(self.storage_retry, RetryPolicy),
                   "RunConfig.storage_retry must be a raylastic.checkpoint.storage.RetryPolicy, got "
                   f"{type(self.storage_retry).__name__}.")
        if self.total_steps is not None:
            _check(isinstance(self.total_steps, int) and self.total_steps >= 1,
                   f"RunConfig.total_steps must be an int >= 1 or None, got {self.total_steps!r}.")
        if self.name is not None:
            problem = _run_name_problem(self.name)
            _check(
                problem is None,
                f"RunConfig.name {self.name!r} is not a plain directory name: {problem}. It names "
                "the run's directory in storage, and storage backends (Azure's adlfs) read '*', "
                "'?' and '[' as patterns that match other runs. Fix: use letters, digits, '-', "
                "'_' and '.', e.g. RunConfig(name='my-run-1').",
            )
        _check(
            isinstance(self.storage_path, (str, os.PathLike)) and str(self.storage_path) != "",
            f"RunConfig.storage_path must be a path or URI string, got {self.storage_path!r}.",
        )
        object.__setattr__(self, "storage_path", os.fspath(self.storage_path))
        _check(
            isinstance(self.failure_config, FailureConfig),
            "RunConfig.failure_config must be a raylastic.FailureConfig.",
        )
        _check(
            isinstance(self.checkpoint_config, CheckpointConfig),
            "RunConfig.checkpoint_config must be a raylastic.CheckpointConfig.",
        )
        _check(
            isinstance(self.poll_interval_s, (int, float)) and 0 < self.poll_interval_s <= 10,
            f"RunConfig.poll_interval_s must be in (0, 10] seconds, got {self.poll_interval_s!r}.",
        )


_GLOB_CHARS = "*?[]"
_SEPARATORS = "/\\"


def _run_name_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot be a run's directory name, or None (see docs/security.md)."""
    if not isinstance(name, str) or name.strip() == "":
        return "it must be a non-empty string"
    if name in (".", ".."):
        return "'.' and '..' are not directory names"
    bad = sorted({c for c in name if c in _GLOB_CHARS + _SEPARATORS})
    if bad:
        return f"it contains {', '.join(repr(c) for c in bad)}"
    if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        return "it contains a control character"
    return None


def describe(obj: Any) -> Dict[str, Any]:
    """A JSON-friendly view of a config for the event log (no secrets live in configs)."""
    if is_dataclass(obj):
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(obj).items()}
    return {"value": repr(obj)}


def describe_run(run: RunConfig) -> Dict[str, Any]:
    """The parts of a RunConfig the event log records at the start of a run."""
    return {"name": run.name, "storage_path": run.storage_path,
            "failure_config": describe(run.failure_config),
            "checkpoint_config": describe(run.checkpoint_config)}
