"""Workers kept from one ``fit()`` to the next (``ScalingConfig.keep_workers_s``).

Why: a worker process pays its start once, and it is most of a short run's cost. Ray's
actor start, torch and (through DDP's constructor) ``torch._dynamo`` took ~5 CPU-s per
worker on a 2-core VM (2026-11-27), ~16 of the ~18 CPU-s of a 3-worker, 5-step ``fit()``.
A notebook or a sweep that calls ``fit()`` again, and the test suite, pay it every time.
With ``keep_workers_s > 0`` the workers a run ends with stay up for that long, released
from the run (process group left, snapshots and session dropped), and the next ``fit()``
from the same driver takes them instead of starting new ones. They still hold their
resources while kept: that is the price, and why it is off by default.

Who owns what: Ray ends an actor when its creator ends. The controller lives for one
``fit()``, so a worker it created could not outlive the run. Kept workers are created by
the keeper instead, an actor the driver creates (one per Ray job, on the head node like
the controller) and so living exactly as long as the driver: a driver that exits takes
its keeper and every kept worker with it, and nothing is left holding resources. The
keeper only creates workers and holds idle ones; the controller still decides everything
about a run's workers (and kills the lost, surplus and hung ones itself).

A worker is kept only if its train function and uploads have ended (``TrainWorker.release``);
a kept worker is taken only by a run asking for the same actor options (resources, node
type, GPUs); the kept workers a run does not take are ended when it asks for workers, so
their resources are free for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import ray

HEAD_RESOURCE = "node:__internal_head__"  # Ray puts this resource on the head node only


class KeptWorkers:
    """The keeper's bookkeeping, without Ray: idle workers by actor-options key, each
    with the time it expires at."""

    def __init__(self) -> None:
        self._idle: List[Tuple[str, Any, float]] = []  # (key, worker, expires_at)

    def put(self, key: str, workers: List[Any], keep_s: float, now: float) -> None:
        self._idle += [(key, w, now + keep_s) for w in workers]

    def take(self, key: str, n: int, now: float) -> Tuple[List[Any], List[Any]]:
        """``n`` unexpired workers of ``key``, or none if there are fewer (all or nothing:
        kept workers are ready at once and new ones seconds later, so a mix would form a
        smaller first group and grow it at once, where new workers start together); and
        every other idle worker, to end now. A run asks for all the workers it wants at
        once, so what it does not take holds resources it may need."""
        fits = [i for i, (key_, _, expires) in enumerate(self._idle) if key_ == key and expires > now]
        chosen = set(fits[:n]) if len(fits) >= n else set()
        taken = [w for i, (_, w, _) in enumerate(self._idle) if i in chosen]
        ended = [w for i, (_, w, _) in enumerate(self._idle) if i not in chosen]
        self._idle = []
        return taken, ended

    def expired(self, now: float) -> List[Any]:
        out = [w for _, w, expires in self._idle if expires <= now]
        self._idle = [e for e in self._idle if e[2] > now]
        return out

    def all(self) -> List[Any]:
        out, self._idle = [w for _, w, _ in self._idle], []
        return out

    def __len__(self) -> int:
        return len(self._idle)


class WorkerKeeper:
    """Ray actor body: creates workers for runs and holds the idle ones until they expire."""

    def __init__(self) -> None:
        self._kept = KeptWorkers()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        threading.Thread(target=self._reap, name="raylastic-keeper", daemon=True).start()

    def lease(self, key: str, options: Dict[str, Any], init_args: tuple, n: int) -> List[Tuple[Any, bool]]:
        """``n`` workers for a run: kept ones of ``key`` first (True: the caller rebinds
        them to its run), then new ones created with ``options`` and ``init_args``."""
        from raylastic._internal.worker_group.worker import TrainWorker

        with self._lock:
            taken, ended = self._kept.take(key, n, time.monotonic())
        if not _all_alive(taken):  # a node was lost while they were kept: start afresh
            taken, ended = [], ended + taken
        _end(ended)
        cls = ray.remote(TrainWorker).options(**options)
        created = [cls.remote(*init_args) for _ in range(n - len(taken))]
        return [(w, True) for w in taken] + [(w, False) for w in created]

    def keep(self, key: str, workers: List[Any], keep_s: float) -> None:
        with self._lock:
            self._kept.put(key, workers, keep_s, time.monotonic())
        self._wake.set()

    def end_all(self) -> int:
        """End every idle worker now; returns how many."""
        with self._lock:
            workers = self._kept.all()
        _end(workers)
        return len(workers)

    def _reap(self) -> None:
        while True:
            self._wake.wait(0.5)
            self._wake.clear()
            with self._lock:
                expired = self._kept.expired(time.monotonic())
            _end(expired)


def _all_alive(workers: List[Any], timeout_s: float = 5.0) -> bool:
    refs = [w.__ray_ready__.remote() for w in workers]
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
    try:
        ray.get(done)
    except Exception:  # noqa: BLE001 - RayActorError: dead
        return False
    return len(done) == len(refs)


def _end(workers: List[Any]) -> None:
    for w in workers:
        try:
            ray.kill(w, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone (its node was lost while kept)
            pass


def keeper_name() -> str:
    return f"raylastic-keeper-{ray.get_runtime_context().get_job_id()}"


# The driver's handle and the (cluster, job) it belongs to: Ray ends an actor once its
# creator's handle is gone, so the driver holds on to the one it created. (Job ids restart
# with each cluster, hence the cluster in the key.)
_held: Optional[Tuple[Tuple[str, str], Any]] = None


def _job_key() -> Tuple[str, str]:
    ctx = ray.get_runtime_context()
    return ctx.gcs_address, ctx.get_job_id()


def ensure_keeper() -> Any:
    """The driver's keeper, created on first use (by the driver: it lives as long as the
    driver does)."""
    global _held
    key = _job_key()
    if _held is None or _held[0] != key:  # none yet, or one of an earlier job: gone with it
        _held = (
            key,
            ray.remote(WorkerKeeper)
            .options(
                name=keeper_name(),
                num_cpus=0,
                max_concurrency=4,
                max_restarts=0,
                resources={HEAD_RESOURCE: 0.001},
            )
            .remote(),
        )
    return _held[1]


def find_keeper() -> Optional[Any]:
    """The keeper of this Ray job, or None (the driver did not keep workers)."""
    try:
        return ray.get_actor(keeper_name())
    except ValueError:
        return None


def end_kept_workers() -> int:
    """End the workers this driver keeps, now (their resources are free at once); returns
    how many. A no-op where it keeps none."""
    if _held is None or not ray.is_initialized() or _held[0] != _job_key():
        return 0
    return ray.get(_held[1].end_all.remote())
