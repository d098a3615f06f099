"""Ray Train's view of a run's checkpoints: ``get_all_reported_checkpoints()`` on a worker,
and the checkpoint-manager snapshot that ``ray.train.Result.from_path`` reads.

Why: in Ray Train 2.60 ``ray.train.get_all_reported_checkpoints()`` returns, on any rank,
the checkpoints the run keeps once every report up to the caller's has been registered
(each ``report()`` is a collective there, so "up to the caller's" is well defined). Here
reports are not collectives: a checkpoint commits when the controller has every rank's
record of that report index, its files uploaded. So a caller waits for:

1. every rank of its group to have made at least as many reports (each rank publishes its
   report count, and the last index at which it passed checkpoint files, in the group's
   TCPStore: one ``set`` per report);
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
from typing import Any, List, Optional

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
        """Publish ``(report index, last index with files)`` for this rank (the session
        knows whether a report's checkpoint carried files)."""
        store = _store()
        if store is not None:
            spec = sess.spec
            store.set(f"{_KEY}/{spec.epoch}/{spec.rank}/{sess.current_index()}", str(sess.last_files_index))

    def reported(self, sess: Any, timeout_s: Optional[float] = None) -> List[Any]:
        """``get_all_reported_checkpoints()``: see the module docstring."""
        from ray.train.v2.api.reported_checkpoint import ReportedCheckpoint, ReportedCheckpointStatus

        from raylastic.checkpoint import scoring
        from raylastic.checkpoint.manager import MANIFEST, committed_checkpoints
        from raylastic.session import StorageCheckpoint, checkpoint_rel

        timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        spec, index = sess.spec, sess.current_index()
        if index > sess.restore.index:  # reported this epoch: wait for the others, then the commit
            if sess.uploader is not None:
                sess.uploader.wait(max(0.0, deadline - time.monotonic()))
            newest = max(sess.last_files_index, self._others_files_index(spec, index, deadline))
            if newest >= 0:
                _wait_exists(sess, f"{checkpoint_rel(sess.run_rel, newest, spec.epoch)}/{MANIFEST}", deadline)
        committed = [c for c in committed_checkpoints(sess.storage, sess.run_rel) if c.index <= index]
        r = self.retention
        return [ReportedCheckpoint(checkpoint=StorageCheckpoint(sess.storage, c.rel), metrics=dict(c.metrics),
                                   status=ReportedCheckpointStatus.COMMITTED)
                for c in scoring.kept(committed, r.num_to_keep, r.score_attribute, r.score_order)]

    def _others_files_index(self, spec: Any, index: int, deadline: float) -> int:
        store = _store()
        if store is None or spec.world_size == 1:
            return -1
        keys = [f"{_KEY}/{spec.epoch}/{r}/{index}" for r in range(spec.world_size) if r != spec.rank]
        try:
            store.wait(keys, datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except Exception as e:  # a rank that never gets there (lost, finished early): list what is there
            logger.warning("get_all_reported_checkpoints: not every rank reached report %d in time (%s)", index, e)
            return -1
        return max(int(store.get(k)) for k in keys)


def _store() -> Any:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def _wait_exists(sess: Any, rel: str, deadline: float) -> None:
    while not sess.storage.exists(rel):
        if time.monotonic() >= deadline or sess.aborted:
            logger.warning("get_all_reported_checkpoints: %s not committed in time; listing what is", rel)
            return
        time.sleep(0.05)


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
        return {"version": 0, "checkpoint_dir_name": c.rel[len(prefix):], "metrics": dict(c.metrics)}

    snapshot = {
        "ray_version": ray.__version__,
        "checkpoint_results": [state(c) for c in kept],
        "checkpoint_report_indices": [c.index for c in kept],
        "latest_checkpoint_result": state(committed[-1]) if committed else None,
        "pending_training_results": [], "pending_validation_specs": [],
        "current_report_index": len(committed),
        "validated_checkpoint_dir_names": [], "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    }
    storage.write_bytes(f"{run_rel}/{CHECKPOINT_MANAGER_SNAPSHOT_FILENAME}",
                        json.dumps(snapshot, default=str).encode())
