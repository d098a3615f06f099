"""The worker actor: one per training slot, kept alive across membership changes.

A worker survives every resize its node survives: the controller only tears down the
torch process group, assigns a new rank, and re-enters the train function in the same
train thread of the same process. Imports, CUDA context and page cache stay warm. With
``ScalingConfig.keep_workers_s`` it survives the run too: ``release`` at the run's end,
``rebind`` to the next run (keeper.py).

The train function runs in its own thread; the actor's other threads answer the
controller (poll, stop, abort) while it trains.
"""

from __future__ import annotations

import gc
import inspect
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import ray

from raylastic import session as _session
from raylastic._internal import ray_train_routes
from raylastic._internal.cluster.drain import start_preemption_watcher
from raylastic.checkpoint.uploader import AsyncUploader, checksum_tree
from raylastic.policies.node_types import MARKET_LABEL, NODE_TYPE_LABEL, RESOURCE_PREFIX
from raylastic.session import GroupSpec, RestoreInfo, Session, StopTraining, checkpoint_rel
from raylastic._internal.snapshots.placement import Holding
from raylastic._internal.protocol import JOIN_TIMEOUT_S, PROTOCOL_VERSION, ExportedShards, StoreAddress, WorkerInfo
from raylastic._internal.worker_group import warm_imports
from raylastic._internal.worker_group.train_thread import TrainThread
from raylastic._internal.worker_group.results import (
    Holdings,
    PersistedSnapshot,
    PollResult,
    StopAnswer,
    WorkerStatus,
)

if TYPE_CHECKING:
    from raylastic._internal.snapshots.store import SnapshotStore

# torch (and what imports it: process groups, the snapshot store) is imported by the methods
# that run in the worker process, not with this module: the controller imports this module
# for the actor class and never needs torch (~1 s of CPU and ~300 MB on the head node).


def _store() -> "SnapshotStore":
    from raylastic.state import STORE

    return STORE


def before_attempt(sess: Session) -> None:
    """In the worker, before each attempt's train function: reset what libraries cache
    about the process group, and route Ray Train's API to ``sess``, now if ``ray.train``
    is imported, else when the train function imports it (importing it costs a process
    ~0.9 s of CPU, and a raylastic train function never needs it: see ray_train_routes)."""
    ray_train_routes.reset_library_state()
    if "ray.train" in sys.modules:
        _route_ray_train(sess)
    else:
        ray_train_routes.on_ray_train_import(lambda: _route_ray_train(sess))


def _route_ray_train(sess: Session) -> None:
    from raylastic._internal import ray_train_compat

    ray_train_routes.on_ray_train_import(None)
    ray_train_compat.install(sess)


# Seconds a worker waits before joining a process group (fault injection, tests only: see
# raylastic.testing.faults.slow_joins). Read from the worker's environment.
JOIN_DELAY_ENV = "RAYLASTIC_TESTING_JOIN_DELAY_S"
Warm = Tuple[str, ...]  # slow imports to make before the worker is ready (warm_imports.py)


class TrainWorker:
    """Ray actor body (wrapped with ``ray.remote`` by the worker group)."""

    def __init__(
        self,
        storage,
        run_rel: str,
        run_name: str,
        async_upload: bool = True,
        persist_every: Optional[int] = None,
        warm: Warm = (),
    ):
        import torch  # noqa: F401 - pay the import once per process, not per attempt

        ray_train_routes.route_on_import()  # before any train function is unpickled here

        # Cloud spot/preemption notices -> a Ray drain of this node, which the controller
        # turns into a graceful shrink (docs/preemption.md). None unless
        # RAYLASTIC_PREEMPTION_SOURCES names a source.
        self._notice_watcher = start_preemption_watcher()
        self._lock = threading.Lock()
        self._train = TrainThread("raylastic-train")
        self._bind(storage, run_rel, run_name, async_upload, persist_every, warm)

    # -- the run it serves ---------------------------------------------------------
    def rebind(self, *args: Any) -> WorkerInfo:
        """A kept worker (``ScalingConfig.keep_workers_s``), released by the run before,
        serves another run from now on (``args``: the constructor's). Answers ``info()``,
        so that the controller's first call follows it (a threaded actor's calls may run
        out of order)."""
        self._bind(*args)
        return self.info()

    def _bind(
        self, storage, run_rel: str, run_name: str, async_upload: bool, persist_every: Optional[int], warm: Warm
    ) -> None:
        if self._train.busy():
            raise RuntimeError("rebind while the train function is still running")
        warm_imports.warm(warm)  # what the running workers' train functions imported (before ready)
        self._storage = storage
        self._uploader = AsyncUploader(storage)
        self._async_upload = async_upload
        self._persist_every = persist_every
        self._run_rel = run_rel
        self._run_name = run_name
        # One join at a time: a join the controller gave up on (a member died while the
        # others waited for it in the rendezvous) may still be blocked in
        # init_process_group until the group timeout; the next join must not run beside it.
        self._join_lock = threading.Lock()
        self._join_epoch = -1  # the newest epoch asked to join; an older join still queued gives up
        self._session: Optional[Session] = None
        self._status = WorkerStatus.IDLE
        self._error: Optional[str] = None
        self._traceback = ""
        self._return_value: Any = None
        self._epoch = -1

    def release(self, timeout_s: float = 10.0) -> bool:
        """The run ended: leave its process group, drop its in-memory snapshots and
        session, so that the process can serve another run (``rebind``). False (the
        worker is not fit to be kept) if its train function or an upload is still busy."""
        from raylastic._internal.distributed import process_group

        if self._train.busy() or self._join_lock.locked():
            return False
        self._uploader.wait(timeout_s)
        if self._uploader.pending:
            return False
        process_group.destroy_group()
        process_group.release_store()
        _store().clear()
        _session._set_session(None)
        with self._lock:
            self._session, self._status, self._epoch = None, WorkerStatus.IDLE, -1
        gc.collect()  # the run's model and optimizer, unless a cycle holds them
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()  # a kept worker holds no cached GPU memory of its last run
        return True

    # -- identity ------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        from raylastic import __version__

        ctx = ray.get_runtime_context()
        node_type, market = _node_type(ctx.get_node_id())
        return {
            "node_id": ctx.get_node_id(),
            "node_type": node_type,
            "market": market,
            "ip": ray.util.get_node_ip_address(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "actor_id": ctx.get_actor_id(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "protocol": PROTOCOL_VERSION,
            "raylastic_version": __version__,
        }

    # -- process group -------------------------------------------------------------
    def host_store(self, world_size: int, timeout_s: float) -> StoreAddress:
        from raylastic._internal.distributed import process_group

        process_group.destroy_group()
        ip = ray.util.get_node_ip_address()
        port = process_group.host_store(ip, world_size, timeout_s)
        return {"addr": ip, "port": port}

    def setup_group(self, spec: GroupSpec) -> None:
        from raylastic._internal.distributed import process_group

        if self._train.busy():
            raise RuntimeError("setup_group while the train function is still running")
        with self._lock:
            self._join_epoch = max(self._join_epoch, spec.epoch)
        delay = float(os.environ.get(JOIN_DELAY_ENV) or 0)
        if delay > 0:  # fault injection (raylastic.testing.faults.slow_joins): a member can be lost mid-join
            time.sleep(delay)
        with self._join_lock:
            if spec.epoch < self._join_epoch:
                raise process_group.JoinCancelled(f"join of epoch {spec.epoch} superseded by epoch {self._join_epoch}")
            self._init_group(spec)

    def _init_group(self, spec: GroupSpec) -> None:
        from raylastic._internal.distributed import process_group

        process_group.init_group(
            epoch=spec.epoch,
            rank=spec.rank,
            world_size=spec.world_size,
            master_addr=spec.master_addr,
            master_port=spec.master_port,
            backend=spec.backend,
            timeout_s=spec.timeout_s,
            local_rank=spec.local_rank,
            local_world_size=spec.local_world_size,
            cancelled=lambda: spec.epoch < self._join_epoch,  # a newer join was asked for
        )

    def teardown_group(self) -> None:
        from raylastic._internal.distributed import process_group

        process_group.destroy_group()
        process_group.release_store()

    def execute(self, func: Callable, args: tuple = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        """``func(*args, **kwargs)`` in this worker process: what a Ray Train ``Backend``
        hook's ``worker_group.execute(...)`` runs (``raylastic/_internal/ray_train_hooks.py``),
        as Ray's own worker actor does."""
        return func(*args, **(kwargs or {}))

    # -- training ------------------------------------------------------------------
    def start(
        self, train_func: Callable, config: Optional[Dict[str, Any]], spec: GroupSpec, restore: RestoreInfo
    ) -> None:
        if self._train.busy():
            raise RuntimeError("start while the train function is still running")
        sess = Session(
            spec=spec,
            storage=self._storage,
            run_rel=self._run_rel,
            run_name=self._run_name,
            restore=restore,
            uploader=self._uploader,
            async_upload=self._async_upload,
            persist_every=self._persist_every,
        )
        with self._lock:
            self._session = sess
            self._status = WorkerStatus.RUNNING
            self._error, self._traceback, self._return_value = None, "", None
            self._epoch = spec.epoch
        _session._set_session(sess)
        before_attempt(sess)
        self._train.submit(lambda: self._run(train_func, config, sess))

    def _run(self, train_func: Callable, config: Optional[Dict[str, Any]], sess: Session) -> None:
        from raylastic._internal.distributed.abortable_wait import abandon_waits_on_abort

        status, error, tb, value = WorkerStatus.FINISHED, None, "", None
        try:
            with abandon_waits_on_abort():  # a gloo wait no abort wakes ends anyway
                value = _call(train_func, config)
            self._finish_uploads(sess)
        except StopTraining:
            status = WorkerStatus.STOPPED
            if not sess.aborted:  # a graceful stop keeps the checkpoint of the stop index
                try:
                    self._finish_uploads(sess)
                except BaseException as e:  # noqa: BLE001
                    status, error, tb = WorkerStatus.ERROR, f"{type(e).__name__}: {e}", ""
        except BaseException as e:  # noqa: BLE001 - every failure goes to the controller
            if sess.aborted:
                status = WorkerStatus.STOPPED  # a peer vanished mid-collective: expected
            else:
                status, error, tb = WorkerStatus.ERROR, f"{type(e).__name__}: {e}", traceback.format_exc()
        # The last snapshot's copy out of the live state belongs to this attempt: wait for
        # it. Its peer copies too, but only when the attempt ended in order (finished, or a
        # graceful stop, whose snapshot the next group restores): after an abort or an error
        # a peer may be gone, and a copy to it waits for the side group's timeout (a 51.6M
        # FSDP2 survivor whose collective failed before the controller's abort reached it
        # waited here 30 s and was replaced).
        _store().wait_pending(own_only=sess.aborted or status == WorkerStatus.ERROR)
        with self._lock:
            if self._session is sess:
                self._status, self._error, self._traceback = status, error, tb
                self._return_value = value

    def persist_snapshot(self, index: int, epoch: int) -> PersistedSnapshot:
        """Write the in-memory snapshot ``index`` to storage now (this worker's node is
        going away and no other worker holds the state). Returns where and what."""
        rel = checkpoint_rel(self._run_rel, index, epoch)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as d:
            _store().read(self._run_rel, index, lambda snap: snap.save(d))  # see SnapshotStore.read
            files = [list(f) for f in checksum_tree(d)]
            self._storage.upload_dir(d, rel)
        return PersistedSnapshot(rel=rel, files=files, upload_s=time.perf_counter() - start)

    def holdings(self) -> Holdings:
        """Complete in-memory snapshots here, and which of them are striped (as poll()
        reports them, without draining reports)."""
        snapshots, stripes = _store().holdings(self._run_rel)
        return Holdings(snapshots=snapshots, stripes=stripes)

    def export_snapshot(self, index: int) -> ExportedShards:
        """The tensors of in-memory snapshot ``index`` this worker holds (by position),
        for another worker to merge (its node is going away, or it is stuck). They are put
        in Ray's object store here, under the store's lock (``SnapshotStore.read``): Ray
        would serialise a returned tensor only after this call, when a commit of this
        worker's own train thread (one that came unstuck) may be reusing its buffer."""
        from raylastic._internal.snapshots.capture import held_leaves

        def put(snap: Any) -> ExportedShards:
            return {"holding": snap.holding, "leaves": ray.put(held_leaves(snap.tensors))}

        return _store().read(self._run_rel, index, put)

    def merge_snapshot(self, index: int, exported: ExportedShards) -> Holding:
        """Add another worker's shards of snapshot ``index`` to this worker's copy.
        Returns what it holds now (``WHOLE`` once it has all of it)."""
        # As long as the controller waits for the merge: frees this actor thread when the
        # exporter died meanwhile.
        leaves = ray.get(exported["leaves"], timeout=JOIN_TIMEOUT_S)
        return _store().merge(self._run_rel, index, exported["holding"], leaves)

    def _finish_uploads(self, sess: Session) -> None:
        """Training ended: the last checkpoint must reach storage before we say so."""
        self._uploader.wait()
        sess.raise_upload_error()

    def poll(self) -> PollResult:
        with self._lock:
            sess = self._session
            records = sess.drain() if sess is not None else []
            return PollResult(
                status=self._status,
                epoch=self._epoch,
                records=records,
                error=self._error,
                traceback=self._traceback,
                index=sess.current_index() if sess else 0,
                return_value=self._return_value if self._status == WorkerStatus.FINISHED else None,
                holdings=self.holdings(),
                imported=warm_imports.imported(),
            )

    def request_stop_at(self, index: int) -> StopAnswer:
        sess = self._session
        if sess is None:
            return StopAnswer(ok=True, index=0)
        ok = sess.request_stop_at(index)
        return StopAnswer(ok=ok, index=sess.current_index())

    def abort(self, epoch: Optional[int] = None) -> int:
        """Make the train function of membership epoch ``epoch`` (None: the current one)
        unwind: at its next ``report()``, and (gloo) at once if it is blocked in a
        collective: the group's connections are shut down, which fails the operation here
        and on every peer still in it (see ``process_group.abort_group``). NCCL ranks
        unwind when NCCL notices the broken connection; ``join`` bounds how long the
        controller waits. An abort for another epoch (one that arrives late, after the
        next group formed) does nothing. Returns how many connections were shut down."""
        sess = self._session
        if sess is None or (epoch is not None and sess.spec.epoch != epoch):
            return 0
        sess.abort()
        from raylastic._internal.distributed import process_group

        return process_group.abort_group(sess.spec.epoch)

    def train_stack(self, limit: int = 6) -> str:
        """Where the train thread is now (its innermost ``limit`` frames): said in the
        event log when the controller replaces a worker that did not unwind."""
        ident = self._train.ident
        frame = sys._current_frames().get(ident) if ident is not None else None
        return "".join(traceback.format_stack(frame, limit=limit)) if frame is not None else ""

    def join(self, timeout_s: float) -> bool:
        """Wait for the train function to return; True if it did."""
        return self._train.join(timeout_s)


def _node_type(node_id: str):
    """The node type (custom resource ``node_type:<name>``) and market (label
    ``raylastic.io/market``) of a node; ("default", None) when it carries neither."""
    for n in ray.nodes():
        if n.get("NodeID") != node_id:
            continue
        labels = n.get("Labels") or {}
        names = [k[len(RESOURCE_PREFIX) :] for k in n.get("Resources", {}) if k.startswith(RESOURCE_PREFIX)]
        name = labels.get(NODE_TYPE_LABEL) or (names[0] if names else "default")
        return name, labels.get(MARKET_LABEL)
    return "default", None


def _call(train_func: Callable, config: Optional[Dict[str, Any]]) -> Any:
    try:
        n_params = len(inspect.signature(train_func).parameters)
    except (TypeError, ValueError):
        n_params = 1
    if n_params == 0:
        return train_func()
    return train_func(config if config is not None else {})
