"""The worker <-> controller protocol: every value that crosses between a worker actor
and the controller, in one place.

Why one module: the controller and the workers run in different processes, often on
different nodes, and exchange these objects over Ray (pickled). Keeping them typed (frozen
dataclasses, ``TypedDict`` where a plain mapping is the natural wire form) lets mypy check
both ends, and the version lets a worker on a node with another raylastic install be refused
with a clear error instead of failing later on a missing field.

Torch-free and Ray-free, so the controller (and its fake group in unit tests) can use them
without importing either.

Glossary: a *record* is one ``report()`` as the controller sees it; a *spec* is one
worker's place in one membership epoch; *holdings* are the in-memory snapshots a worker
has; a *poll* is the controller's periodic question to each worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, TypedDict

from raylastic._internal.snapshots.placement import Holding

# Bump when a type below changes shape: workers report it in ``WorkerInfo`` and the pool
# refuses a worker whose version differs from the controller's.
PROTOCOL_VERSION = 2
# How long survivors get to unwind their train function before being replaced, and the bound
# on one call that moves snapshot shards (the controller's wait, and the receiving worker's
# wait for the exported shards).
JOIN_TIMEOUT_S = 30.0


class WorkerInfo(TypedDict):
    """What a worker actor answers once it is up (``TrainWorker.info``)."""

    node_id: str
    node_type: Optional[str]
    market: Optional[str]
    ip: str
    hostname: str
    pid: int
    actor_id: Optional[str]
    gpu_ids: List[str]
    protocol: int
    raylastic_version: str


class StoreAddress(TypedDict):
    """Where rank 0 hosts the group's rendezvous store (``TrainWorker.host_store``)."""

    addr: str
    port: int


class ExportedShards(TypedDict):
    """A worker's shards of one in-memory snapshot, for another worker to merge
    (``TrainWorker.export_snapshot`` -> ``merge_snapshot``)."""

    holding: Holding
    # A Ray ObjectRef of {leaf position: tensor}, put by the exporting worker under its
    # store's lock (a returned tensor would be serialised after its buffer may be reused).
    leaves: Any


@dataclass(frozen=True)
class GroupSpec:
    """One worker's place in one membership epoch."""

    epoch: int
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    backend: str
    timeout_s: float = 60.0
    # Shards of the replicated training state this rank copies into its ElasticState
    # snapshots (``_internal/snapshots/placement.py``), out of ``world_size``; empty: all of it.
    stripe: Tuple[int, ...] = ()
    # The run's ScalingConfig.max_workers (0: unknown): the world size a script's batch
    # settings describe, for the integrations' default global batch.
    max_workers: int = 0


@dataclass(frozen=True)
class RestoreInfo:
    """The committed checkpoint an attempt starts from (None fields: fresh start)."""

    checkpoint_rel: Optional[str] = None  # run-relative path of the checkpoint dir
    index: int = 0  # report index training resumes after
    restart_count: int = 0
    memory_index: Optional[int] = None  # restore ElasticState from this in-memory snapshot
    broadcast: bool = False  # some ranks lack (part of) that snapshot: holders send it


@dataclass
class ReportRecord:
    """One ``report()`` call as the controller sees it."""

    index: int  # global report index (continues across restarts from the checkpoint's)
    rank: int
    epoch: int
    ts: float
    metrics: Dict[str, Any]
    checkpoint_rel: Optional[str] = None
    files: List[Any] = field(default_factory=list)  # (relative path, size, "crc32:...")
    stage_s: float = 0.0  # time report() spent copying the files locally (the stall)
    wait_s: float = 0.0  # time report() waited for the previous upload (back-pressure)
    upload_s: float = 0.0  # background upload time
    persist_skipped: Optional[str] = None  # why a persisted ElasticState snapshot was not written


class WorkerStatus:
    IDLE = "idle"
    RUNNING = "running"
    FINISHED = "finished"  # train function returned
    STOPPED = "stopped"  # unwound for a resize (StopTraining) or aborted
    ERROR = "error"  # train function raised


@dataclass(frozen=True)
class Holdings:
    """Complete in-memory snapshots a worker holds, and which of them are striped."""

    snapshots: List[int] = field(default_factory=list)
    stripes: Dict[int, Holding] = field(default_factory=dict)  # index -> holding, if not whole


@dataclass
class PollResult:
    status: str
    epoch: int
    records: List[ReportRecord] = field(default_factory=list)
    error: Optional[str] = None
    traceback: str = ""
    index: int = 0
    return_value: Any = None
    holdings: Holdings = field(default_factory=Holdings)
    # Which of worker_group/warm_imports.SLOW_IMPORTS the worker has imported: the pool's
    # new workers import them before they count as ready.
    imported: Tuple[str, ...] = ()


@dataclass(frozen=True)
class StopAnswer:
    """Answer to ``request_stop_at(index)``: ``ok`` False when the worker is already past
    ``index`` (then ``index`` is where it is, to pick a later stop)."""

    ok: bool
    index: int


@dataclass(frozen=True)
class PersistedSnapshot:
    """An in-memory snapshot written to storage by ``persist_snapshot``."""

    rel: str
    files: List[Any]
    upload_s: float


@dataclass(frozen=True)
class TrainFunc:
    """The train function as the driver put it in Ray's object store (``ray.put``).

    The controller only hands it on, as a top-level argument of ``TrainWorker.start``, which
    Ray resolves in the worker. So the controller never unpickles the function, nor imports
    what its module imports (torch: ~1 s of CPU and ~300 MB on the head node, at every run
    start). Nested in this dataclass, the reference reaches the controller unresolved."""

    ref: Any  # ray.ObjectRef


__all__ = [
    "PROTOCOL_VERSION",
    "JOIN_TIMEOUT_S",
    "ExportedShards",
    "GroupSpec",
    "Holdings",
    "PersistedSnapshot",
    "PollResult",
    "ReportRecord",
    "RestoreInfo",
    "StopAnswer",
    "StoreAddress",
    "TrainFunc",
    "WorkerInfo",
    "WorkerStatus",
]
