"""The pool of worker actors: asked for, coming up, ready, in a group, or gone.

The pool always keeps ``max_workers`` actors alive or pending. A pending actor is Ray's
own demand signal: it is placed the moment a node with the resources appears (and an
autoscaler sees it as demand), so the controller learns about new capacity by an actor
becoming ready rather than by polling the node list.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import ray
from ray.exceptions import RayActorError

from raylastic._internal.snapshots.placement import WHOLE, Holding, is_whole
from raylastic._internal.protocol import PROTOCOL_VERSION, Holdings, WorkerInfo
from raylastic._internal.worker_group.keeper import find_keeper
from raylastic.errors import ConfigError
from raylastic.policies.node_types import RESOURCE_PREFIX

logger = logging.getLogger("raylastic")
# How long the pool waits on the keeper, and on a run's workers releasing at its end.
KEEPER_CALL_S = 30.0


def check_protocol(info: WorkerInfo) -> None:
    """Refuse a worker whose raylastic speaks another protocol than this controller (a node
    whose image or setup commands installed another version): it would fail later, on a
    missing field, far from the cause."""
    if info.get("protocol") != PROTOCOL_VERSION:
        from raylastic import __version__

        raise ConfigError(
            f"the worker on node {info.get('node_id')} ({info.get('hostname')}) runs raylastic "
            f"{info.get('raylastic_version', 'older than 0.1.0')} (worker protocol {info.get('protocol')}); "
            f"this controller runs raylastic {__version__} (protocol {PROTOCOL_VERSION}). Fix: install "
            "the same raylastic on every node (pin it in the cluster's setup commands or image)."
        )


@dataclass
class WorkerHandle:
    wid: int
    actor: Any
    info_ref: Any
    created_at: float
    info: Optional[WorkerInfo] = None
    ready_at: Optional[float] = None
    node_type: Optional[str] = None  # the node type it was placed for (capacity policy)
    prev_rank: int = 1 << 30  # rank in the last group (new workers sort last)
    snapshots: List[int] = field(default_factory=list)  # in-memory ElasticState snapshots held
    stripes: Dict[int, Holding] = field(default_factory=dict)  # index -> holding, if not whole

    def holding(self, index: int) -> Holding:
        """What this worker holds of snapshot ``index`` (``WHOLE``: all of it; only
        meaningful for an index in ``snapshots``)."""
        return self.stripes.get(index, WHOLE)

    def update_holdings(self, view: Holdings) -> None:
        self.snapshots, self.stripes = list(view.snapshots), dict(view.stripes)

    def set_holding(self, index: int, holding: Holding) -> None:
        if is_whole(holding):
            self.stripes.pop(index, None)
        else:
            self.stripes[index] = holding

    @property
    def node_id(self) -> str:
        return self.info["node_id"] if self.info else ""

    @property
    def ready(self) -> bool:
        return self.info is not None


class WorkerPool:
    def __init__(
        self,
        *,
        target: int,
        resources: Dict[str, float],
        use_gpu: bool,
        storage,
        run_rel: str,
        run_name: str,
        async_upload: bool = True,
        persist_every: Optional[int] = None,
        keep_s: float = 0.0,
    ):
        self._resources = dict(resources)
        self._use_gpu = use_gpu
        self._init_args = (storage, run_rel, run_name, async_upload, persist_every)
        # Slow imports the members' train functions made (warm_imports.py): new workers
        # make them before they count as ready, not while the group waits for them.
        self.warm_imports: Set[str] = set()
        # Workers come from (and at the end go back to) the driver's keeper when the run
        # keeps them (ScalingConfig.keep_workers_s; keeper.py), else the pool creates them.
        self._keep_s = keep_s
        self._keeper = find_keeper() if keep_s > 0 else None
        self._ids = itertools.count()
        self.workers: Dict[int, WorkerHandle] = {}
        self.last_ready_at: Optional[float] = None
        # Worker slots wanted per node type; the key None means "any node" (no capacity
        # policy). A capacity policy replaces it with e.g. {"spot": 3, "on_demand": 1}.
        self.targets: Dict[Optional[str], int] = {None: target}
        self.max_workers = target  # the run's max_workers (targets change under a capacity policy)

    def set_targets(self, targets: Dict[Optional[str], int], protect: List[WorkerHandle]) -> List[WorkerHandle]:
        """Change how many workers of each node type to keep; surplus pending actors go
        first, then idle ready ones. Members of the running group (``protect``) stay.
        Returns the *ready* workers removed (their node slots are given back)."""
        self.targets = dict(targets)
        keep = {h.wid for h in protect}
        released: List[WorkerHandle] = []
        for t in {h.node_type for h in self.workers.values()}:
            surplus = self.count(t) - self.targets.get(t, 0)
            victims = sorted(
                (h for h in self.workers.values() if h.node_type == t and h.wid not in keep),
                key=lambda h: (h.ready, -h.wid),
            )
            for h in victims[: max(0, surplus)]:
                if h.ready:
                    released.append(h)
                self.remove(h, kill=True)
        return released

    def count(self, node_type: Optional[str], ready_only: bool = False) -> int:
        return sum(1 for h in self.workers.values() if h.node_type == node_type and (h.ready or not ready_only))

    def _actor_options(self, node_type: Optional[str] = None) -> Dict[str, Any]:
        res = dict(self._resources)
        if node_type is not None:
            res[f"{RESOURCE_PREFIX}{node_type}"] = 1.0
        opts: Dict[str, Any] = {
            "num_cpus": res.pop("CPU", 0),
            "num_gpus": res.pop("GPU", 0),
            "max_concurrency": 8,  # poll/abort/stop answer while the train thread runs
            "max_restarts": 0,  # a lost worker is replaced by the controller, not by Ray
            "scheduling_strategy": "SPREAD",
        }
        if "memory" in res:
            opts["memory"] = res.pop("memory")
        res.pop("object_store_memory", None)
        if res:
            opts["resources"] = res
        return opts

    def fill(self) -> int:
        """Ask for actors until each node type's target is alive or pending; returns how
        many were asked for."""
        n = 0
        for node_type, want in self.targets.items():
            missing = want - self.count(node_type)
            if missing <= 0:
                continue
            for actor, kept in self._new_actors(node_type, missing):
                wid = next(self._ids)
                # A kept worker (of an earlier run) serves this one from now on: rebind
                # answers with its info, so nothing reaches it before that (a threaded
                # actor's calls may run out of order).
                info_ref = actor.rebind.remote(*self._args()) if kept else actor.info.remote()
                self.workers[wid] = WorkerHandle(wid, actor, info_ref, time.monotonic(), node_type=node_type)
                n += 1
        return n

    def _new_actors(self, node_type: Optional[str], n: int) -> List[Tuple[Any, bool]]:
        """``n`` worker actors: from the keeper (kept ones first: True), or created here."""
        options = self._actor_options(node_type)
        if self._keeper is not None:
            try:
                return ray.get(
                    self._keeper.lease.remote(_options_key(options), options, self._args(), n), timeout=KEEPER_CALL_S
                )
            except Exception as e:  # noqa: BLE001 - the keeper is a shortcut, never a failure
                logger.warning("the worker keeper did not answer (%s); starting workers here", e)
                self._keeper = None
        # Here, not at the top: the worker module imports torch, which the controller's
        # process (where the pool lives) never needs.
        from raylastic._internal.worker_group.worker import TrainWorker

        cls = ray.remote(TrainWorker).options(**options)
        return [(cls.remote(*self._args()), False) for _ in range(n)]

    def _args(self) -> Tuple[Any, ...]:
        """``TrainWorker``'s (and ``rebind``'s) arguments."""
        return (*self._init_args, tuple(sorted(self.warm_imports)))

    def refresh(self) -> List[WorkerHandle]:
        """Collect actors that became ready; drop ones that died before that."""
        pending = {h.info_ref: h for h in self.workers.values() if not h.ready}
        if not pending:
            return []
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        newly = []
        for ref in done:
            h = pending[ref]
            try:
                h.info = info = ray.get(ref)
            except RayActorError as e:
                logger.info("worker %d died before it was ready: %s", h.wid, e)
                self.workers.pop(h.wid, None)
                continue
            check_protocol(info)
            h.ready_at = time.monotonic()
            self.last_ready_at = h.ready_at
            newly.append(h)
        return newly

    def starting(self) -> int:
        """Workers not ready yet whose actor already holds its node's resources: their
        process is starting (importing torch, a runtime env), so they will be ready in
        seconds, unlike an actor still waiting for a node. Ray's GCS tells them apart:
        both are ``PENDING_CREATION``, and only a placed one has a worker process (pid)."""
        pending = {h.actor._actor_id.hex() for h in self.workers.values() if not h.ready}
        return count_placed(pending) if pending else 0

    def ready_spares(self, members: List[WorkerHandle]) -> List[WorkerHandle]:
        in_group = {m.wid for m in members}
        return [h for h in self.workers.values() if h.ready and h.wid not in in_group]

    def remove(self, handle: WorkerHandle, kill: bool = False) -> None:
        self.workers.pop(handle.wid, None)
        if kill:
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def shutdown(self) -> None:
        """End the run's workers, or give the ready ones that released cleanly back to
        the keeper (the run keeps its workers)."""
        kept: Dict[str, List[Any]] = {}
        if self._keeper is not None:
            ready = {h.actor.release.remote(): h for h in self.workers.values() if h.ready}
            done, _ = ray.wait(list(ready), num_returns=len(ready), timeout=KEEPER_CALL_S) if ready else ([], [])
            for ref in done:
                h = ready[ref]
                try:
                    if ray.get(ref):
                        kept.setdefault(_options_key(self._actor_options(h.node_type)), []).append(h.actor)
                        self.workers.pop(h.wid, None)
                except Exception:  # noqa: BLE001 - gone or broken: killed below
                    pass
            try:
                ray.get(
                    [self._keeper.keep.remote(key, actors, self._keep_s) for key, actors in kept.items()],
                    timeout=KEEPER_CALL_S,
                )
            except Exception as e:  # noqa: BLE001
                logger.warning("the worker keeper did not take the run's workers (%s); ending them", e)
                for actors in kept.values():
                    for actor in actors:
                        ray.kill(actor, no_restart=True)
        for h in list(self.workers.values()):
            self.remove(h, kill=True)


def count_placed(actor_ids: Set[str]) -> int:
    """How many of these actors (hex ids) are placed and starting: ``PENDING_CREATION`` in
    the GCS with a leased worker process. One GCS call (~1 ms). 0 where the actor table
    cannot be read (it is Ray's internal API): the caller then decides as if none were."""
    try:
        from ray._private.state import state

        table = state.actor_table(None, actor_state_name="PENDING_CREATION")
    except Exception as e:  # noqa: BLE001 - a shortcut, never a failure
        logger.debug("could not read the actor table: %s", e)
        return 0
    return sum(1 for aid, row in table.items() if aid in actor_ids and row.get("Pid"))


def _options_key(options: Dict[str, Any]) -> str:
    """Kept workers are taken only by a run asking for the same actor options. Amounts
    compare as numbers: ``raylastic.TorchTrainer`` asks for Ray Train's ``{"CPU": 1}``,
    ``ElasticTrainer`` for ``{"CPU": 1.0}``, and one's workers are the other's."""

    def amounts(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: amounts(x) for k, x in v.items()}
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    return json.dumps(amounts(options), sort_keys=True, default=str)


def spares_holding_needed_state(ready: List, members: List, running: bool) -> List:
    """Ready workers outside the group whose in-memory snapshots the group may still need:
    all of them, unless the running group's members each hold a snapshot at least as new
    as the spare's newest (then the spare is redundant and may be released)."""
    spares = [h for h in ready if h.snapshots and h not in members]
    if not (running and members and all(m.snapshots for m in members)):
        return spares
    newest = min(max(m.snapshots) for m in members)
    return [h for h in spares if max(h.snapshots) > newest]
