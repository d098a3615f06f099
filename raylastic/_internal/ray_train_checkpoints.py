"""Ray Train's view of a run's checkpoints: ``get_all_reported_checkpoints()`` on a worker,
and the checkpoint-manager snapshot that ``ray.train.Result.from_path`` reads.

Why: in Ray Train 2.60 ``ray.train.get_all_reported_checkpoints()`` returns, on any rank,
the checkpoints the run keeps once every report up to the caller's has been registered
(each ``report()`` is a collective there, so "up to the caller's" is well defined). Here
reports are not collectives: a checkpoint commits when the controller has every rank's
record of that report index, its files uploaded. So a caller waits for:

1. every rank of its group to have made at least as many reports (each rank publishes its
   report count, the last index at which it passed checkpoint files and the directory they
   went to, in the group's TCPStore: one ``set`` per report);
2. the commit (the manifest) of the newest such index with files (at most ``timeout_s``:
   a commit that cannot happen, because a rank was lost, does not hang the caller);

then lists the committed checkpoints with index <= its own, ranked and trimmed by the
run's retention rules (``raylastic.checkpoint.scoring``, the same as the controller's).
Before its first report of a membership epoch a rank waits for nothing: every commit of
the epochs before is final.

``Result.from_path(run_dir)`` reads Ray's ``checkpoint_manager_snapshot.json`` from the run
directory; :func:`write_ray_snapshot` writes one (the kept checkpoints in Ray's order,
worst first, and the newest) when a ``raylastic.TorchTrainer`` run ends, failed or not.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

logger = logging.getLogger("raylastic")

_KEY = "raylastic/ray_reports"
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Retention:
    """The run's ``CheckpointConfig`` rules a worker needs (set by the shim's wrapper)."""

    num_to_keep: Optional[int] = None
    score_attribute: Optional[str] = None
    score_order: str = "max"

    @classmethod
    def of(cls, cc: Any) -> "Retention":
        return cls(cc.num_to_keep, cc.score_attribute, cc.score_order)


class ReportProgress:
    """One worker's published report progress, and the waits on everyone else's (one per
    session, so per membership epoch: the worker installs a new adapter for each)."""

    def __init__(self) -> None:
        self.retention = Retention()

    def after_report(self, sess: Any) -> None:
        """Publish ``(report index, last index with files, its directory)`` for this rank (the
        session knows whether a report's checkpoint carried files)."""
        store = _store()
        if store is not None:
            spec, files = sess.spec, sess.last_files_index
            store.set(f"{_KEY}/{spec.epoch}/{spec.rank}/{sess.current_index()}", f"{files}|{_files_rel(sess, files)}")

    def reported(self, sess: Any, timeout_s: Optional[float] = None) -> List[Any]:
        """``get_all_reported_checkpoints()``: see the module docstring."""
        from ray.train.v2.api.reported_checkpoint import ReportedCheckpoint, ReportedCheckpointStatus

        from raylastic.checkpoint import scoring
        from raylastic.checkpoint.manager import MANIFEST, committed_checkpoints
        from raylastic.checkpoint.storage_checkpoint import StorageCheckpoint

        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        spec, index = sess.spec, sess.current_index()
        if index > sess.restore.index:  # reported this epoch: wait for the others, then the commit
            if sess.uploader is not None:
                sess.uploader.wait(max(0.0, deadline - time.monotonic()))
            own = (sess.last_files_index, _files_rel(sess, sess.last_files_index))
            newest, rel = max(own, self._others_files(spec, index, deadline))
            if newest >= 0:
                _wait_exists(sess, f"{rel}/{MANIFEST}", deadline)
        committed = [c for c in committed_checkpoints(sess.storage, sess.run_rel) if c.index <= index]
        r = self.retention
        return [
            ReportedCheckpoint(
                checkpoint=StorageCheckpoint(sess.storage, c.rel),
                metrics=dict(c.metrics),
                status=ReportedCheckpointStatus.COMMITTED,
            )
            for c in scoring.kept(committed, r.num_to_keep, r.score_attribute, r.score_order)
        ]

    def _others_files(self, spec: Any, index: int, deadline: float, quiet: bool = False) -> Tuple[int, str]:
        """The newest index with files among the other ranks' reports up to ``index``, and
        its directory; (-1, "") when none (or they did not get there in time)."""
        store = _store()
        if store is None or spec.world_size == 1:
            return -1, ""
        keys = [f"{_KEY}/{spec.epoch}/{r}/{index}" for r in range(spec.world_size) if r != spec.rank]
        try:
            store.wait(keys, datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except Exception as e:  # a rank that never gets there (lost, finished early): list what is there
            (logger.debug if quiet else logger.warning)(
                "get_all_reported_checkpoints: not every rank reached report %d in time (%s)", index, e
            )
            return -1, ""
        published = [store.get(k).decode().partition("|") for k in keys]
        return max((int(files), rel) for files, _, rel in published)


def settle_before_error(sess: Any, timeout_s: float) -> None:
    """This rank's train function raised: before the error leaves it, wait (at most
    ``timeout_s``) for the other ranks to reach its report count and for the newest
    checkpoint with files up to it to commit. In Ray Train every ``report()`` is a
    collective that returns once the checkpoint is registered, so a rank that raises right
    after a report never loses its peers' checkpoint of that report; here reports are not
    collectives, and without this wait the controller handles the error before a slower
    rank's checkpoint has committed. A peer that never gets there (lost, stuck) costs at
    most ``timeout_s``."""
    spec, index = sess.spec, sess.current_index()
    if index <= sess.restore.index or sess.aborted:
        return
    from raylastic.checkpoint.manager import MANIFEST

    deadline = time.monotonic() + timeout_s
    own = (sess.last_files_index, _files_rel(sess, sess.last_files_index))
    newest, rel = max(own, ReportProgress()._others_files(spec, index, deadline, quiet=True))
    if newest >= 0:
        _wait_exists(sess, f"{rel}/{MANIFEST}", deadline, quiet=True)


def _store() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _wait_exists(sess: Any, rel: str, deadline: float, quiet: bool = False) -> None:
    while not sess.storage.exists(rel):
        if time.monotonic() >= deadline or sess.aborted:
            (logger.debug if quiet else logger.warning)(
                "get_all_reported_checkpoints: %s not committed in time; listing what is", rel
            )
            return
        time.sleep(0.05)


# -- ``ray.train.report(checkpoint_dir_name=...)``: Ray Train's checkpoint directory names --


def _files_rel(sess: Any, index: int) -> str:
    """The directory this rank's checkpoint files of report ``index`` went to ("" for -1):
    the one its report named (``Session.last_files_rel``) for its newest such report."""
    if index < 0:
        return ""
    if index == sess.last_files_index and getattr(sess, "last_files_rel", None):
        return sess.last_files_rel
    from raylastic.session import checkpoint_rel

    return checkpoint_rel(sess.run_rel, index, sess.spec.epoch)


def usable_dir_name(name: Any) -> Optional[str]:
    """``name`` if a report may upload its checkpoint into ``<run>/<name>/``; else None,
    with a warning (the checkpoint then goes to ``checkpoints/checkpoint_<index>-e<epoch>/``):
    a name that is not one plain path segment, or is one raylastic uses in the run
    directory (``checkpoints``, hidden names)."""
    from raylastic.checkpoint.manager import named_dir_problem

    problem = named_dir_problem(name)
    if problem is None:
        return name
    logger.warning(
        "report(checkpoint_dir_name=%r) ignored: %s; the checkpoint goes to checkpoints/checkpoint_<index>-e<epoch>/",
        name,
        problem,
    )
    return None


def honour_dir_names() -> None:
    """In this worker process, make ``ray.train.report(..., checkpoint_dir_name=name)`` upload
    the checkpoint into ``<run>/<name>/`` (Ray Train's layout) instead of
    ``<run>/checkpoints/checkpoint_<index>-e<epoch>/``: the session's report takes the name
    (``Session.report(checkpoint_dir_name=...)``). Ranks that report the same name write
    into the same directory, which commits (its manifest) once every rank reported, as any
    checkpoint here. A name :func:`usable_dir_name` refuses is ignored with a warning.
    Called by ``raylastic.TorchTrainer``'s train-function wrapper after the session (and its
    ``RayTrainAdapter``) is installed; ``ElasticTrainer`` runs keep raylastic's layout."""
    from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils

    try:
        utils = get_train_fn_utils()
    except RuntimeError:  # no Ray Train API routed in this process (ray_train_compat.install)
        return
    if hasattr(utils, "names_dirs"):  # a RayTrainAdapter
        utils.names_dirs = True


def write_ray_snapshot(storage: Any, run_rel: str, cc: Any) -> None:
    """Write ``<run>/checkpoint_manager_snapshot.json`` in Ray Train 2.60's schema
    (``_CheckpointManagerState``) for the run's committed checkpoints."""
    import ray
    from ray.train.v2._internal.constants import CHECKPOINT_MANAGER_SNAPSHOT_FILENAME

    from raylastic.checkpoint import scoring
    from raylastic.checkpoint.manager import committed_checkpoints

    committed = committed_checkpoints(storage, run_rel)
    kept = scoring.kept(committed, cc.num_to_keep, cc.score_attribute, cc.score_order)
    prefix = f"{run_rel}/"

    def state(c: Any) -> dict:
        return {"version": 0, "checkpoint_dir_name": c.rel[len(prefix) :], "metrics": dict(c.metrics)}

    snapshot = {
        "ray_version": ray.__version__,
        "checkpoint_results": [state(c) for c in kept],
        "checkpoint_report_indices": [c.index for c in kept],
        "latest_checkpoint_result": state(committed[-1]) if committed else None,
        "pending_training_results": [],
        "pending_validation_specs": [],
        "current_report_index": len(committed),
        "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    }
    storage.write_bytes(f"{run_rel}/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}", json.dumps(snapshot, default=str).encode())
