"""Ray Train's ``Backend`` hooks and ``UserCallback``s, called by raylastic's controller.

Why: a Ray Train script can pass ``DataParallelTrainer(backend_config=B)`` (here
``raylastic.TorchTrainer(torch_config=B)``) and ``RunConfig(callbacks=[...])``; Ray Train's
controller calls ``B.backend_cls()``'s ``on_start`` / ``on_training_start`` /
``on_shutdown`` around each worker group, and every ``ray.train.UserCallback``'s
``after_report`` / ``after_exception`` as reports and errors come in. That controller does
not run here, so :class:`RayTrainHooks` (a ``RunHooks``, ``controller/hooks.py``) does the
same from raylastic's, in its actor on the head node:

- **per group formation.** Ray Train starts a new worker group on every resize and runs
  ``on_start`` then ``on_training_start`` when it has started (before the train function),
  and ``on_shutdown`` before it shuts down. raylastic re-forms its group (a new
  membership epoch) on every resize, keeping the worker processes: the hooks run for each
  formed group, ``on_shutdown`` when that group stopped (finished, failed, resized away or
  the run ended), before a new one forms. A hook gets :class:`RaylasticWorkerGroup`, Ray's
  worker-group interface (``execute`` / ``execute_async`` / ``execute_single`` /
  ``execute_single_async``, ``len()``, ``get_resources_per_worker``) over the group's
  members in rank order; raylastic's own process group (gloo / NCCL) is already formed.
- **after_report** is called once every rank of the group has reported an index, with
  the ranks' metrics in rank order and the checkpoint those reports committed (None
  without one), as Ray calls it after its report barrier. Reports are no barrier here, so
  it runs when the slowest rank's report arrives.
- **after_exception** is called with ``{rank: error}`` when ranks of the group raised,
  crashed or were lost, before the failure policy decides (the errors are
  ``ray_train_errors.RankError``: they crossed a process boundary as text).
- **errors.** As in Ray Train 2.60, an exception raised by a hook or callback ends the run
  with a ``ray.train.ControllerError`` (``controller_failure`` is that exception), except
  that ``on_shutdown`` calls failing because a worker is gone only log a warning, and a
  worker that dies during ``on_start`` / ``on_training_start`` is an ordinary loss.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.train._internal.base_worker_group import BaseWorkerGroup

from raylastic._internal.controller.hooks import RunHooks
from raylastic._internal.ray_train_errors import ControllerFailed, RankError
from raylastic._internal.worker_group.membership import MembersLost, PollBatch

logger = logging.getLogger("raylastic")

PROBE_TIMEOUT_S = 5.0  # how long a member may take to answer "are you alive" after a hook failed


class RaylasticWorkerGroup(BaseWorkerGroup):
    """Ray Train's worker-group interface (what ``Backend`` hooks are written against)
    over one membership epoch's members, in rank order. ``execute`` runs the function in
    every worker process (``TrainWorker.execute``) and returns the results in rank order."""

    def __init__(self, members: Sequence[Any], resources_per_worker: Dict[str, float]):
        self._members = list(members)
        self._resources = dict(resources_per_worker)

    def execute_async(self, func: Callable, *args: Any, **kwargs: Any) -> List[Any]:
        return [m.actor.execute.remote(func, args, kwargs) for m in self._members]

    def execute(self, func: Callable, *args: Any, **kwargs: Any) -> List[Any]:
        return ray.get(self.execute_async(func, *args, **kwargs))

    def execute_single_async(self, worker_index: int, func: Callable, *args: Any, **kwargs: Any) -> Any:
        return self._members[worker_index].actor.execute.remote(func, args, kwargs)

    def execute_single(self, worker_index: int, func: Callable, *args: Any, **kwargs: Any) -> Any:
        return ray.get(self.execute_single_async(worker_index, func, *args, **kwargs))

    def __len__(self) -> int:
        return len(self._members)

    def get_resources_per_worker(self) -> dict:
        return dict(self._resources)

    def dead_members(self) -> Dict[int, Optional[BaseException]]:
        """The members whose actor is gone (wid -> Ray's error), after a hook's call failed."""
        refs = {m.wid: m.actor.execute.remote(len, ((),)) for m in self._members}
        dead: Dict[int, Optional[BaseException]] = {}
        for wid, ref in refs.items():
            try:
                ray.get(ref, timeout=PROBE_TIMEOUT_S)
            except RayActorError as e:
                dead[wid] = e
            except GetTimeoutError:
                pass  # slow, not gone: the group's own liveness checks decide
        return dead


class RayTrainHooks(RunHooks):
    """Ray Train's backend hooks (``backend_config``: a ``BackendConfig`` other than
    raylastic's TorchConfig path, or None) and user callbacks, called with ``run_context``
    (Ray's ``TrainRunContext`` of the trainer's configs). ``storage_path`` is where the
    run's checkpoints are, for the ``checkpoint`` given to ``after_report``."""

    def __init__(
        self,
        backend_config: Any,
        callbacks: Sequence[Any],
        run_context: Any,
        storage_path: str,
        resources_per_worker: Dict[str, float],
    ):
        self._backend_config = backend_config
        self._callbacks = list(callbacks)
        self._run_context = run_context
        self._storage_path = storage_path
        self._resources = dict(resources_per_worker)
        self._storage: Any = None  # opened in the controller, on first use
        self._group: Optional[RaylasticWorkerGroup] = None  # the group whose on_shutdown is due
        self._backend: Any = None  # its Backend: one instance per group, as Ray's BackendExecutor keeps one
        self._epoch = -1
        self._world = 0
        self._reports: Dict[int, Dict[int, Dict[str, Any]]] = {}  # index -> rank -> metrics

    # -- Backend hooks -------------------------------------------------------------
    def group_started(self, members: List[Any], epoch: int) -> None:
        self._epoch, self._world, self._reports = epoch, len(members), {}
        if self._backend_config is None:
            return
        group = RaylasticWorkerGroup(members, self._resources)
        backend = self._backend_config.backend_cls()
        self._group, self._backend = group, backend  # from here on_shutdown is due, whatever happens next
        for hook in (backend.on_start, backend.on_training_start):
            try:
                hook(group, self._backend_config)
            except RayActorError as e:
                dead = group.dead_members()
                if not dead:  # Ray said a worker is gone and none is: not a loss to handle
                    raise _ended_by(f"{type(backend).__name__}.{hook.__name__}", e) from e
                logger.warning(
                    "epoch %d: a worker died during %s.%s; handling it as a loss",
                    epoch,
                    type(backend).__name__,
                    hook.__name__,
                )
                raise MembersLost(PollBatch(lost=[m for m in members if m.wid in dead], causes=dead)) from e
            except Exception as e:  # noqa: BLE001 - the user's hook: it ends the run, as in Ray Train
                raise _ended_by(f"{type(backend).__name__}.{hook.__name__}", e) from e

    def group_ended(self) -> Optional[BaseException]:
        group, backend, self._group, self._backend = self._group, self._backend, None, None
        self._reports = {}
        if group is None:
            return None
        try:
            backend.on_shutdown(group, self._backend_config)
        except (RayActorError, RayTaskError):  # as in Ray Train: expected when a worker crashed
            logger.warning(
                "%s.on_shutdown failed on a worker; expected if one of the workers is gone",
                type(backend).__name__,
                exc_info=True,
            )
        except Exception as e:  # noqa: BLE001 - the user's hook: it ends the run, as in Ray Train
            return _ended_by(f"{type(backend).__name__}.on_shutdown", e)
        return None

    # -- UserCallback --------------------------------------------------------------
    def records(self, records: List[Any], committed: List[Any]) -> None:
        if not self._callbacks:
            return
        for rec in records:
            if rec.epoch != self._epoch:
                continue  # a report of an older group: it can no longer be complete
            ranks = self._reports.setdefault(rec.index, {})
            ranks[rec.rank] = rec.metrics
            if len(ranks) < self._world:
                continue
            del self._reports[rec.index]
            ckpt = next((c for c in committed if c.index == rec.index and c.epoch == rec.epoch), None)
            self._call(
                "after_report",
                metrics=[ranks[r] for r in range(self._world)],
                checkpoint=self._checkpoint(ckpt.rel) if ckpt is not None else None,
            )

    def failed(self, failures: List[Any]) -> None:
        if not self._callbacks or not failures:
            return
        errors = {f.rank: RankError(f.rank, f.kind, f.message, f.traceback) for f in failures}
        self._call("after_exception", worker_exceptions=dict(sorted(errors.items())))

    def _call(self, method: str, **kwargs: Any) -> None:
        for cb in self._callbacks:
            try:
                getattr(cb, method)(run_context=self._run_context, **kwargs)
            except Exception as e:  # noqa: BLE001 - the user's callback: it ends the run, as in Ray Train
                raise _ended_by(f"{type(cb).__name__}.{method}", e) from e

    def _checkpoint(self, rel: str) -> Any:
        from raylastic.checkpoint.storage import Storage
        from raylastic.checkpoint.storage_checkpoint import StorageCheckpoint

        if self._storage is None:
            self._storage = Storage(self._storage_path)
        return StorageCheckpoint(self._storage, rel)


def _ended_by(where: str, error: BaseException) -> ControllerFailed:
    """The run's error when user code called by the controller raised: Ray Train's
    ``ControllerError`` whose ``controller_failure`` is that error (as text when it cannot
    travel to the driver)."""
    from ray import cloudpickle

    logger.error(
        "%s raised %s: %s; ending the run (as Ray Train does)", where, type(error).__name__, error, exc_info=error
    )
    cause: Exception = error if isinstance(error, Exception) else RuntimeError(str(error))
    try:
        cloudpickle.loads(cloudpickle.dumps(cause))
    except Exception:  # noqa: BLE001 - any pickling failure: keep its text
        cause = RuntimeError(f"{type(error).__name__}: {error}")
    return ControllerFailed(f"{where} raised {type(error).__name__}: {error}", (), cause)
