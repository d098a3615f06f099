"""User-facing configuration: frozen, keyword-only dataclasses validated at construction.

Every check here runs before any Ray actor or placement is requested, so a typo costs
a traceback, not a cluster. Messages name the field, the value and the fix. The rules
(a bool is not an int, NaN and infinity are no numbers, flags are real bools) live in
``raylastic._internal.validate``, shared with ``CapacityPolicy`` and the Ray Train shim.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Dict, Mapping, Optional, cast

from raylastic._internal.validate import (
    check_bool,
    check_instance,
    check_int,
    check_number,
    check_reserves_something,
    check_resources,
    check_storage_path,
    check_text,
    run_name_problem,
)
from raylastic.errors import ConfigError
from raylastic.policies.capacity import CapacityPolicy

_STANDARD_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
_run_name_problem = run_name_problem  # its old name here


# The default of ScalingConfig.keep_workers_s (seconds; unset: 0, workers end with the run).
KEEP_ENV = "RAYLASTIC_KEEP_WORKERS_S"


def _keep_s_from_env() -> float:
    """``RAYLASTIC_KEEP_WORKERS_S`` as seconds (0 when unset); ValueError names the variable."""
    raw = os.environ.get(KEEP_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and value != float("inf")):
        raise ValueError(
            f"{KEEP_ENV}={raw!r} is not a number of seconds >= 0. Fix: set it to e.g. 30, "
            "or unset it (workers end with the run)"
        )
    return value


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
            one CPU (or one GPU and one CPU with ``use_gpu``). Amounts are finite and
            >= 0 (0 reserves none of it), and a worker must reserve something.
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
        keep_workers_s: keep the workers a run ends with this many seconds, for the next
            ``fit()`` from the same driver to take instead of starting new processes
            (a notebook, a sweep: each worker's start is ~5 CPU-s of imports). Kept
            workers hold their resources meanwhile (Ray Data tasks the driver starts
            between runs wait for those CPUs), and a module they imported stays as it
            was (edit the train function's module between runs: pass 0). ``None``: the
            environment variable ``RAYLASTIC_KEEP_WORKERS_S``, else 0 (workers end with
            the run).
    """

    min_workers: int = 1
    max_workers: Optional[int] = None
    resources_per_worker: Optional[Mapping[str, float]] = None
    use_gpu: bool = False
    max_wait_s: Optional[float] = None
    validate_resources: bool = True
    capacity: Optional[Any] = None
    keep_workers_s: Optional[float] = None

    def __post_init__(self) -> None:
        check_int(self.min_workers, "ScalingConfig.min_workers", minimum=1, fix="pass min_workers=1 or more")
        if self.max_workers is None:
            object.__setattr__(self, "max_workers", self.min_workers)
        check_int(
            self.max_workers,
            "ScalingConfig.max_workers",
            minimum=1,
            fix="pass max_workers >= min_workers, or leave it out (a fixed size of min_workers)",
        )
        max_workers = cast(int, self.max_workers)  # set (and checked) just above
        _check(
            self.min_workers <= max_workers,
            f"ScalingConfig: min_workers ({self.min_workers}) > max_workers "
            f"({self.max_workers}). Fix: raise max_workers or lower min_workers.",
        )
        check_bool(
            self.use_gpu,
            "ScalingConfig.use_gpu",
            "pass use_gpu=True (NCCL, one GPU per worker) or use_gpu=False (gloo on CPU)",
        )
        check_bool(self.validate_resources, "ScalingConfig.validate_resources")
        check_number(
            self.max_wait_s,
            "ScalingConfig.max_wait_s",
            above=0,
            unit="seconds",
            none_means="wait forever",
            fix="pass seconds > 0, or None to wait forever",
        )
        check_resources(self.resources_per_worker, "ScalingConfig.resources_per_worker")
        if self.resources_per_worker is not None:
            _check(
                not (self.resources_per_worker.get("GPU", 0) and not self.use_gpu),
                "ScalingConfig.resources_per_worker asks for GPU but use_gpu=False. "
                "Fix: pass use_gpu=True (NCCL) or drop 'GPU' from resources_per_worker.",
            )
        check_instance(
            self.capacity,
            CapacityPolicy,
            "ScalingConfig.capacity",
            "capacity=raylastic.policies.capacity.CapacityPolicy(...), or None",
            optional=True,
        )
        if self.keep_workers_s is None:
            try:
                object.__setattr__(self, "keep_workers_s", _keep_s_from_env())
            except ValueError as e:
                raise ConfigError(f"ScalingConfig.keep_workers_s defaults to {e}") from None
        check_number(
            self.keep_workers_s,
            "ScalingConfig.keep_workers_s",
            minimum=0,
            maximum=86400,
            unit="seconds",
            fix="pass seconds >= 0 (0: workers end with the run)",
        )
        if self.capacity is None:  # (with a policy each worker also reserves its node type's slot)
            check_reserves_something(self.worker_resources(), "ScalingConfig.resources_per_worker")
        else:
            _check(
                self.max_wait_s is None,
                f"ScalingConfig.max_wait_s={self.max_wait_s} and a CapacityPolicy: with a capacity policy "
                "the wait for min_workers is bounded by CapacityPolicy.max_wait_s alone (one clock). "
                f"Fix: pass CapacityPolicy(max_wait_s={self.max_wait_s}, ...) and leave "
                "ScalingConfig.max_wait_s unset.",
            )
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
        check_int(
            self.max_failures,
            "FailureConfig.max_failures",
            minimum=-1,
            fix="pass 0 (fail at the first error), a number of retries, or -1 (unlimited)",
        )
        check_int(
            self.max_node_failures,
            "FailureConfig.max_node_failures",
            minimum=0,
            none_means="unlimited",
            fix="pass a number of node losses to recover from, or None (unlimited, the default)",
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
        score_attribute: rank checkpoints by this metric (of rank 0's report, nested keys
            as ``"a/b"``) instead of by age: ``num_to_keep`` then keeps the best ones, and
            the newest committed checkpoint is kept as well (what a restart resumes from),
            as in Ray Train. NaN ranks below every number; a missing key counts as
            ``-inf`` (last with "max", first with "min", as in Ray Train). ``None``: the
            newest ``num_to_keep`` are kept.
        score_order: ``"max"`` (a higher score is better) or ``"min"``.
    """

    num_to_keep: Optional[int] = None
    async_upload: bool = True
    persist_every: Optional[int] = None
    score_attribute: Optional[str] = None
    score_order: str = "max"

    def __post_init__(self) -> None:
        check_int(
            self.num_to_keep,
            "CheckpointConfig.num_to_keep",
            minimum=1,
            none_means="keep all",
            fix="pass num_to_keep=2 or more (1 keeps only the newest), or None",
        )
        check_bool(self.async_upload, "CheckpointConfig.async_upload")
        check_int(
            self.persist_every,
            "CheckpointConfig.persist_every",
            minimum=1,
            none_means="snapshots stay in memory",
            fix="pass persist_every=N to write every N-th ElasticState snapshot, or None",
        )
        check_text(
            self.score_attribute,
            "CheckpointConfig.score_attribute",
            optional=True,
            fix="pass the name of a metric your train function reports, e.g. score_attribute='val_loss', "
            "or None to keep the newest checkpoints",
        )
        _check(
            self.score_order in ("max", "min") and isinstance(self.score_order, str),
            f"CheckpointConfig.score_order={self.score_order!r} must be 'max' or 'min'. "
            "Fix: pass score_order='min' for a loss, 'max' for an accuracy.",
        )


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Where a run lives and how it reacts to failures.

    Args:
        name: the run's directory name under ``storage_path``. Calling ``fit()``
            again with the same name and storage path resumes from the run's last
            committed checkpoint. Defaults to a timestamped name.
        storage_path: local path or URI (``s3://``, ``gs://``, ``abfs://``/``az://``,
            ``file://``; other schemes are refused here) under which the run directory is
            written. On a multi-node cluster a local path must be shared by every node.
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
        lease_ttl_s: how long the run's lease outlives its holder (``fit()`` renews it every
            ``lease_ttl_s / 3``): while it is live a second ``fit()`` of the same run fails
            with ``RunInUseError``; after a crash the run can be resumed this long after its
            last renewal. See docs/security.md.
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
    lease_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if self.name is not None:
            problem = run_name_problem(self.name)
            _check(
                problem is None,
                f"RunConfig.name {self.name!r} is not a plain directory name: {problem}. It names "
                "the run's directory in storage, and storage backends (Azure's adlfs) read '*', "
                "'?' and '[' as patterns that match other runs. Fix: use letters, digits, '-', "
                "'_' and '.', e.g. RunConfig(name='my-run-1').",
            )
        object.__setattr__(self, "storage_path", check_storage_path(self.storage_path, "RunConfig.storage_path"))
        check_instance(
            self.failure_config,
            FailureConfig,
            "RunConfig.failure_config",
            "failure_config=raylastic.FailureConfig(max_failures=...)",
        )
        check_instance(
            self.checkpoint_config,
            CheckpointConfig,
            "RunConfig.checkpoint_config",
            "checkpoint_config=raylastic.CheckpointConfig(num_to_keep=...)",
        )
        check_number(
            self.poll_interval_s,
            "RunConfig.poll_interval_s",
            above=0,
            maximum=10,
            unit="seconds",
            fix="pass poll_interval_s=0.1 (the default)",
        )
        for flag in ("verbose", "progress", "tensorboard"):
            check_bool(getattr(self, flag), f"RunConfig.{flag}")
        check_int(
            self.total_steps,
            "RunConfig.total_steps",
            minimum=1,
            none_means="unknown: no ETA",
            fix="pass the number of reports the run makes, or None",
        )
        if self.storage_retry is not None:
            _check_retry(self.storage_retry)
        check_number(
            self.lease_ttl_s,
            "RunConfig.lease_ttl_s",
            minimum=3,
            maximum=3600,
            unit="seconds",
            fix="pass lease_ttl_s=30 (the default): renewed every lease_ttl_s / 3",
        )


def _check_retry(retry: Any) -> None:
    """``RunConfig.storage_retry``: a RetryPolicy with a finite attempt count and delays
    (a NaN delay sleeps for NaN seconds: ``time.sleep`` raises mid-run)."""
    # Here, not at the top: storage imports pyarrow, and configs stay cheap to import.
    from raylastic.checkpoint.storage import RetryPolicy

    check_instance(
        retry,
        RetryPolicy,
        "RunConfig.storage_retry",
        "storage_retry=raylastic.checkpoint.storage.RetryPolicy(...), or None (the default)",
    )
    check_int(
        retry.max_attempts,
        "RunConfig.storage_retry.max_attempts",
        minimum=1,
        fix="pass max_attempts=5 (the default) or another count >= 1",
    )
    for name in ("base_delay_s", "max_delay_s"):
        check_number(
            getattr(retry, name),
            f"RunConfig.storage_retry.{name}",
            minimum=0,
            unit="seconds",
            fix=f"pass {name} as seconds >= 0",
        )


def describe(obj: Any) -> Dict[str, Any]:
    """A JSON-friendly view of a config for the event log (no secrets live in configs)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in asdict(obj).items()}
    return {"value": repr(obj)}


def describe_run(run: RunConfig) -> Dict[str, Any]:
    """The parts of a RunConfig the event log records at the start of a run."""
    return {
        "name": run.name,
        "storage_path": run.storage_path,
        "failure_config": describe(run.failure_config),
        "checkpoint_config": describe(run.checkpoint_config),
    }
