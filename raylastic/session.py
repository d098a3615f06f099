"""What a train function calls: ``report``, ``get_checkpoint``, ``get_context``.

The same session also answers Ray Train's own calls (``ray.train.report``,
``ray.train.get_checkpoint``, ``ray.train.get_context``, and through them
``ray.train.torch.prepare_model`` / ``prepare_data_loader``): at training start the
worker installs :class:`RayTrainAdapter` with Ray Train v2's ``set_train_fn_utils`` hook,
so a function written for ``TorchTrainer`` runs unchanged.

``report()`` never waits for the controller: metrics go to an in-process queue that the
controller drains when it polls. Only a checkpoint costs time in the step (its files are
copied to storage before ``report`` returns), and nothing waits on other ranks.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional

# The values a session hands the controller live with the rest of the worker <-> controller
# protocol; imported here too, where code has always found them.
from raylastic._internal.protocol import GroupSpec, ReportRecord, RestoreInfo  # noqa: F401
from raylastic.checkpoint.retry import TransientStorageError
from raylastic.errors import CheckpointError

if TYPE_CHECKING:
    from ray.train import Checkpoint


class StopTraining(BaseException):
    """Raised inside ``report()`` to unwind the train function for a resize.

    A ``BaseException`` so that a train function's ``except Exception`` does not
    swallow it.
    """


class TrainContext:
    """Where this worker stands: ranks, sizes, membership epoch, restart count.

    Mirrors Ray Train's ``TrainContext`` method names.
    """

    def __init__(self, spec: GroupSpec, experiment_name: str, restart_count: int):
        self._spec = spec
        self._name = experiment_name
        self._restart_count = restart_count

    def get_world_size(self) -> int:
        return self._spec.world_size

    def get_world_rank(self) -> int:
        return self._spec.rank

    def get_local_rank(self) -> int:
        return self._spec.local_rank

    def get_local_world_size(self) -> int:
        return self._spec.local_world_size

    def get_node_rank(self) -> int:
        return self._spec.node_rank

    def get_experiment_name(self) -> str:
        return self._name

    def get_membership_epoch(self) -> int:
        """Id of the current worker-group configuration; changes on every resize."""
        return self._spec.epoch

    def get_restart_count(self) -> int:
        """How many times the group was re-formed before this attempt."""
        return self._restart_count

    def get_metadata(self) -> Dict[str, Any]:
        return {}

    def get_storage(self):  # Ray Train API; raylastic's storage is not Ray's StorageContext
        return None


class Session:
    """Per-process state of the running attempt; thread-safe where the actor polls."""

    def __init__(
        self,
        *,
        spec: GroupSpec,
        storage,
        run_rel: str,
        run_name: str,
        restore: RestoreInfo,
        uploader=None,
        async_upload: bool = True,
        persist_every: Optional[int] = None,
    ):
        self.spec = spec
        self.persist_every = persist_every
        self.uploader = uploader
        self.async_upload = async_upload
        self._upload_error: Optional[BaseException] = None
        self._skip_next: Optional[str] = None  # the next record is a skipped persisted snapshot (why)
        self.last_files_index = -1  # the newest report whose checkpoint carried files (-1: none yet)
        self.last_files_rel: Optional[str] = None  # the directory that report's files went to
        self.storage = storage
        self.run_rel = run_rel
        self.context = TrainContext(spec, run_name, restore.restart_count)
        self.restore = restore
        self._lock = threading.Lock()
        self._records: Deque[ReportRecord] = collections.deque()
        self._index = restore.index
        self._stop_at: Optional[int] = None
        self._abort = threading.Event()
        # What get_checkpoint() returns while the run has no committed checkpoint yet:
        # raylastic.TorchTrainer(resume_from_checkpoint=...) sets it before the train
        # function starts. A committed checkpoint of the run always wins.
        self.initial_checkpoint: Optional[Checkpoint] = None
        # Ray Data input (``raylastic.data.ray_data.DataShards``), set by the train
        # function wrapper when the trainer got ``datasets=``; its positions ride with
        # every checkpoint this rank reports and every ElasticState snapshot.
        self.data: Any = None

    # -- called from the train thread -------------------------------------------------
    def report(
        self,
        metrics: Dict[str, Any],
        checkpoint: Optional[Checkpoint] = None,
        checkpoint_dir_name: Optional[str] = None,
    ) -> None:
        """``checkpoint_dir_name``: upload the checkpoint into ``<run>/<name>/`` (Ray Train's
        layout; the caller has checked the name: ``checkpoint.manager.named_dir_problem``)
        instead of ``<run>/checkpoints/checkpoint_<index>-e<epoch>/``."""
        record = self._next_record(metrics)
        if checkpoint is None:
            self._append(record)
        else:
            self._persist(checkpoint, record, checkpoint_dir_name)
        self._maybe_stop(record.index)

    def report_snapshot(self, metrics: Dict[str, Any], writer, persist: bool) -> None:
        """``report()`` for ``ElasticState.commit``: when ``persist``, rank 0's
        ``writer(dir)`` serialises the snapshot in the background and the upload follows;
        nothing but the snapshot copy touches the training thread."""
        record = self._next_record(metrics)
        if persist and writer is not None:
            record.checkpoint_rel = checkpoint_rel(self.run_rel, record.index, self.spec.epoch)
            record.wait_s = self.uploader.submit_lazy(
                writer,
                f"e{self.spec.epoch}-{record.index}-r{self.spec.rank}",
                record.checkpoint_rel,
                self._on_uploaded(record, snapshot=True),
            )
        else:
            self._append(record)
        self._maybe_stop(record.index)

    def persist_busy(self) -> bool:
        """For ``ElasticState.commit``: skip this persisted snapshot instead of waiting?

        Yes when the previous upload is still running (retrying through a storage outage,
        say) and uploads are asynchronous: waiting would block training on storage. Skipping
        never makes a state durable later than waiting would: the upload in flight goes on
        either way, and the steps trained meanwhile exist only because training did not
        wait (a node loss then redoes at most those). With two or more members, memory also
        covers a node loss meanwhile. The skipped index is reported (``checkpoint_skipped``)
        and never committed; the next persisted snapshot tries again.
        ``CheckpointConfig(async_upload=False)`` waits, as asked.

        Also yes once the controller asked this attempt to stop (a graceful resize: a
        scale-up, a preemption notice): the group re-forms from the in-memory snapshot
        of the stop index, and a rank finishes its uploads before it stops, so an upload
        started now would hold the whole resize (~1.3 s of a 10 s notice at 51.6M
        parameters, measured). The next group persists again at its next boundary.
        """
        why = None
        if self.async_upload and self.uploader is not None and self.uploader.pending:
            why = "the previous upload was still running"
        elif self.async_upload and self.stop_requested:
            why = "the group stops to resize and re-forms from memory"
        self._skip_next = why
        return why is not None

    def _next_record(self, metrics: Dict[str, Any]) -> ReportRecord:
        if self._abort.is_set():
            raise StopTraining("membership change")
        self.raise_upload_error()
        with self._lock:
            self._index += 1
            index = self._index
        skipped, self._skip_next = self._skip_next, None
        return ReportRecord(
            index=index,
            rank=self.spec.rank,
            epoch=self.spec.epoch,
            ts=time.time(),
            metrics=dict(metrics or {}),
            persist_skipped=skipped,
        )

    def _maybe_stop(self, index: int) -> None:
        """Unwind after this report if the controller asked for it (resize, abort)."""
        with self._lock:
            stop = self._stop_at is not None and index >= self._stop_at
        if stop or self._abort.is_set():
            raise StopTraining(f"stop after report {index}")

    def _on_uploaded(self, record: ReportRecord, snapshot: bool = False):
        """Upload callback: the record reaches the controller only once its files are in
        storage, so the controller can never commit a checkpoint still in flight. An
        ElasticState snapshot that storage could not take within the retry policy (an
        outage: the store answered at ``fit()``, the lease needs it) is skipped, not a
        failure: the state is still in memory and the next persisted snapshot tries again.
        Other errors (a permanent one: credentials, a missing bucket) fail the attempt as
        for any checkpoint."""

        def done(res) -> None:
            record.upload_s = res.upload_s
            if res.files:
                record.files = [list(f) for f in res.files]
            if res.error is not None and snapshot and isinstance(res.error, TransientStorageError):
                record.persist_skipped = f"its upload failed: {res.error}"
                record.checkpoint_rel, record.files = None, []
                self._append(record)
            elif res.error is not None:
                self._upload_error = CheckpointError(
                    f"rank {self.spec.rank}: could not persist checkpoint {record.index} to "
                    f"{self.storage.uri}/{record.checkpoint_rel}: {res.error}"
                )
            else:
                self._append(record)

        return done

    def _append(self, record: ReportRecord) -> None:
        with self._lock:
            self._records.append(record)

    def _persist(self, checkpoint: Checkpoint, record: ReportRecord, dir_name: Optional[str] = None) -> None:
        """Stage the files locally (the only stall), then upload in the background, or
        wait for the upload when ``CheckpointConfig(async_upload=False)``."""
        start = time.perf_counter()
        with checkpoint.as_directory() as local_dir:
            if not _has_files(local_dir):
                # The usual DDP pattern: every rank reports a directory, only rank 0 wrote
                # into it. An empty one adds nothing (as in Ray Train): the record carries
                # no checkpoint, so rank 0's files alone make the checkpoint.
                self._append(record)
                return
            staged = self.uploader.stage(local_dir, f"e{self.spec.epoch}-{record.index}-r{self.spec.rank}")
        if self.data is not None:  # the split datasets' positions, next to the user's files
            self.data.write_positions(staged)
        record.stage_s = time.perf_counter() - start
        record.checkpoint_rel = (
            f"{self.run_rel}/{dir_name}" if dir_name else checkpoint_rel(self.run_rel, record.index, self.spec.epoch)
        )
        self.last_files_index, self.last_files_rel = record.index, record.checkpoint_rel
        record.wait_s = self.uploader.submit(staged, record.checkpoint_rel, self._on_uploaded(record))
        if not self.async_upload:
            self.uploader.wait()
            self.raise_upload_error()

    def raise_upload_error(self) -> None:
        if self._upload_error is not None:
            err, self._upload_error = self._upload_error, None
            raise err

    def get_dataset_shard(self, name: Optional[str] = None):
        if self.data is None:
            raise KeyError(
                f"get_dataset_shard({name!r}): the trainer was given no datasets. Fix: pass "
                "datasets={name: ray.data.Dataset} to TorchTrainer / ElasticTrainer."
            )
        return self.data.get(name)

    def get_checkpoint(self) -> Optional[Checkpoint]:
        if self.restore.checkpoint_rel is None:
            return self.initial_checkpoint
        from raylastic.checkpoint.storage_checkpoint import StorageCheckpoint

        return StorageCheckpoint(self.storage, self.restore.checkpoint_rel)

    # -- called from the actor's control threads ------------------------------------
    def drain(self) -> List[ReportRecord]:
        with self._lock:
            out = list(self._records)
            self._records.clear()
            return out

    def current_index(self) -> int:
        with self._lock:
            return self._index

    def request_stop_at(self, index: int) -> bool:
        """Ask the train function to stop right after report ``index``.

        Returns False if this rank already passed it (the controller then picks a
        later index), so every rank stops after the same report and no rank is left
        waiting in a collective for peers that stopped. A later request replaces an
        earlier one: when one rank was already past the first proposal, the controller
        proposes a later index to all, and a rank that accepted the first must go on to
        it too (keeping the earlier index would stop it one report before the others,
        which would wait for it in their next collective). A rank that already reached
        its stop index refuses any other.
        """
        with self._lock:
            if self._index >= index:
                return False
            if self._stop_at is not None and self._index >= self._stop_at:
                return False  # stopping at the earlier index already
            self._stop_at = index
            return True

    @property
    def stop_requested(self) -> bool:
        """The controller asked this attempt to stop at a coming report (a resize)."""
        with self._lock:
            return self._stop_at is not None

    def abort(self) -> None:
        self._abort.set()

    @property
    def aborted(self) -> bool:
        return self._abort.is_set()


def _has_files(directory: str) -> bool:
    return any(files for _root, _dirs, files in os.walk(directory))


def checkpoint_rel(run_rel: str, index: int, epoch: int) -> str:
    """Checkpoint dirs are named by report index AND epoch: a retry that reaches the
    same index again writes a fresh directory instead of mixing files with a
    half-written one from the failed attempt."""
    return f"{run_rel}/checkpoints/checkpoint_{index:08d}-e{epoch}"


_session: Optional[Session] = None
_session_lock = threading.Lock()


def _set_session(session: Optional[Session]) -> None:
    global _session
    with _session_lock:
        _session = session


def _get_session() -> Session:
    with _session_lock:
        if _session is None:
            raise RuntimeError(
                "raylastic.report/get_checkpoint/get_context can only be called inside a "
                "train function launched by ElasticTrainer.fit()."
            )
        return _session


def report(metrics: Dict[str, Any], checkpoint: Optional[Checkpoint] = None, **_ignored: Any) -> None:
    """Report metrics (and optionally a checkpoint) for this step.

    Every rank should call it the same number of times (once per step is typical). A
    checkpoint passed by any rank is persisted under the run directory; the checkpoint
    counts only once every rank of the group has reported that step. Resizes happen
    inside this call: it may raise an internal ``StopTraining`` that unwinds the train
    function, which is then re-entered on the new group.
    """
    _get_session().report(metrics, checkpoint)


def get_checkpoint() -> Optional[Checkpoint]:
    """The latest committed checkpoint to resume from; on a fresh start None (or the
    ``resume_from_checkpoint`` given to ``raylastic.TorchTrainer``)."""
    return _get_session().get_checkpoint()


def get_context() -> TrainContext:
    return _get_session().context


def get_dataset_shard(name: Optional[str] = None):
    """This rank's iterator over dataset ``name`` passed as ``datasets=`` to the trainer
    (what ``ray.train.get_dataset_shard`` returns here too). Split datasets continue from
    their restored position after a resize: docs/data.md, "Ray Data input"."""
    return _get_session().get_dataset_shard(name)


def __getattr__(name: str) -> Any:
    # ``StorageCheckpoint`` lives in raylastic.checkpoint.storage_checkpoint: it subclasses
    # Ray Train's Checkpoint, and importing ray.train costs a process ~0.5 s of CPU that
    # the controller (which imports this module through the worker class) never needs.
    if name == "StorageCheckpoint":
        from raylastic.checkpoint.storage_checkpoint import StorageCheckpoint

        return StorageCheckpoint
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
