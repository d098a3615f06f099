"""Commit, list, restore and retire checkpoints of one run (controller side).

A checkpoint directory ``checkpoints/checkpoint_<index>-e<epoch>/`` receives the files
of every rank that passed a checkpoint to ``report()`` for that index. It becomes a
checkpoint only when its manifest is written, and the manifest is written only after
every rank of the group has reported that index (so every rank's shard is in place).
Readers ignore directories without a valid manifest, and a directory is never
rewritten: a retry that reaches the same index writes under a new epoch suffix.

"Not committed" is decided only from answers the store gave: a manifest that is absent
(the store said so) or present but unparsable (written by something else than this
protocol, which writes it whole and last; kept on storage for a human, logged, skipped).
A manifest or file the store could not be asked about (an outage, throttling) is retried
under the Storage's RetryPolicy; if the retries run out the StorageError propagates. So an
outage never makes a committed checkpoint look missing: a restore never falls back to an
older checkpoint or a fresh start because of it, and nothing is deleted because of it.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional

from raylastic.checkpoint import scoring
from raylastic.events import EventKind, EventLog
from raylastic._internal.protocol import ReportRecord

logger = logging.getLogger("raylastic")

MANIFEST = ".raylastic_manifest.json"
SCHEMA_VERSION = 1
CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)-e(\d+)$")  # index, membership epoch


@dataclass(frozen=True)
class CommittedCheckpoint:
    rel: str  # path relative to the storage root
    index: int
    epoch: int
    world_size: int
    ts: float
    files: List[Any] = field(default_factory=list)
    metrics: Dict[str, Any] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(int(f[1]) for f in self.files)


def named_dir_problem(name: Any) -> Optional[str]:
    """Why ``name`` cannot be a checkpoint directory directly under the run directory
    (``ray.train.report(checkpoint_dir_name=name)``, Ray Train's layout), or None: it must be
    one plain path segment, not hidden, and not a name raylastic uses there itself."""
    if not isinstance(name, str) or not name:
        return "it is not a non-empty string"
    if "/" in name or "\\" in name or name in (".", "..") or any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "it is not a single plain path segment"
    if name.startswith(".") or name in RESERVED_RUN_NAMES:
        return f"{name!r} is reserved in the run directory"
    return None


RESERVED_RUN_NAMES = frozenset({"checkpoints", "snapshots", "events", "metrics"})


def committed_checkpoints(storage, run_rel: str) -> List[CommittedCheckpoint]:
    """A run's committed checkpoints in storage, oldest first; corrupt ones skipped. Raises
    StorageError when the store stays unreachable past the retry policy. Read-only.

    Listed: ``<run>/checkpoints/checkpoint_<index>-e<epoch>/`` and, for reports that named
    their directory (Ray Train's ``checkpoint_dir_name``), ``<run>/<name>/``; either only with
    a manifest."""
    directory = f"{run_rel}/checkpoints"
    found = []
    rels = [f"{directory}/{name}" for name in storage.list_dir(directory) if CHECKPOINT_DIR.match(name)]
    list_dirs = getattr(storage, "list_dirs", None)  # (a Storage; a stand-in with list_dir only lists checkpoints/)
    if list_dirs is not None:
        rels += [f"{run_rel}/{name}" for name in list_dirs(run_rel) if named_dir_problem(name) is None]
    for rel in rels:
        ckpt = _read_manifest(storage, rel)
        if ckpt is not None:
            found.append(ckpt)
    found.sort(key=lambda c: (c.index, c.epoch, c.ts))
    return found


def _read_manifest(storage, rel: str) -> Optional[CommittedCheckpoint]:
    """The checkpoint committed in ``rel``; None when the store says it has no manifest,
    or its manifest is corrupt. A store that cannot be read raises StorageError (after
    the retry policy): "unreadable" is not "missing".

    Corrupt includes every field of the wrong type (index, epoch, world_size: integers
    >= 0, not bools; ts: a finite number; files: [relative path, size >= 0, checksum];
    metrics: an object) and numbers no float holds (``1e999``): the manifest is data from
    the store, and a wrong type must be skipped here, not crash a restore later."""
    try:
        raw = storage.read_bytes(f"{rel}/{MANIFEST}")
    except FileNotFoundError:  # the store answered: never committed
        return None

    def count(key: str) -> int:
        v = data[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{key} is {v!r}, not an integer >= 0")
        return v

    def file_entry(f: Any) -> tuple:
        # [path, size] or, as the uploader writes them, [path, size, "crc32:<hex>"]
        if not (
            isinstance(f, list)
            and len(f) in (2, 3)
            and isinstance(f[0], str)
            and isinstance(f[1], int)
            and not isinstance(f[1], bool)
            and f[1] >= 0
            and (len(f) == 2 or isinstance(f[2], str))
        ):
            raise ValueError(f"files entry {f!r:.80} is not [relative path, size >= 0(, checksum)]")
        if "\x00" in f[0] or any(part in ("", ".", "..") for part in f[0].split("/")):
            raise ValueError(f"files entry {f[0]!r:.80} is not a plain relative path")
        f[0].encode("utf-8")  # UnicodeEncodeError (a ValueError) for a lone surrogate
        return tuple(f)

    try:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"schema_version {data.get('schema_version')!r:.40}")
        ts = data["ts"]
        if (
            isinstance(ts, bool) or not isinstance(ts, (int, float)) or not (float("-inf") < float(ts) < float("inf"))
        ):  # an int beyond floats: OverflowError
            raise ValueError(f"ts is {ts!r:.40}, not a finite number")
        files, metrics = data.get("files", []), data.get("metrics", {})
        if not isinstance(files, list) or not isinstance(metrics, dict):
            raise ValueError("files must be a list and metrics an object")
        return CommittedCheckpoint(
            rel=rel,
            index=count("index"),
            epoch=count("epoch"),
            world_size=count("world_size"),
            ts=float(ts),
            files=[file_entry(f) for f in files],
            metrics=metrics,
        )
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError, RecursionError) as e:
        # The manifest is written whole and last, so a corrupt one was not written by a
        # commit: skip it, and leave it on storage (delete_uncommitted keeps it).
        logger.warning("ignoring checkpoint %s: corrupt manifest (%s: %.200s)", rel, type(e).__name__, e)
        return None


class CheckpointManager:
    """``score_attribute`` / ``score_order``: retention ranks checkpoints by that metric
    (``raylastic.checkpoint.scoring``, Ray Train's rules) instead of by age."""

    def __init__(
        self,
        storage,
        run_rel: str,
        num_to_keep: Optional[int],
        events: EventLog,
        *,
        score_attribute: Optional[str] = None,
        score_order: str = "max",
    ):
        self._storage = storage
        self._run_rel = run_rel
        self._dir = f"{run_rel}/checkpoints"
        self._num_to_keep = num_to_keep
        self._score_attribute = score_attribute
        self._score_order = score_order
        self._events = events
        self._pending: Dict[int, Dict[int, ReportRecord]] = {}
        self._writers_this_epoch: Optional[set] = None  # ranks whose files the epoch's commits had
        self._epoch = -1
        self._world_size = 0
        self._committed: List[CommittedCheckpoint] = self.scan()

    # -- listing / restore ---------------------------------------------------------
    def scan(self) -> List[CommittedCheckpoint]:
        return committed_checkpoints(self._storage, self._run_rel)

    def latest(self) -> Optional[CommittedCheckpoint]:
        return self._committed[-1] if self._committed else None

    def latest_valid(self) -> Optional[CommittedCheckpoint]:
        """Newest committed checkpoint whose files are all there with their manifest
        sizes; a damaged one (files deleted or truncated behind our back) is skipped
        with an event and the previous one is used. Checking waits out a store outage
        within the retry policy, then raises StorageError: an unverifiable checkpoint is
        neither used nor skipped."""
        for ckpt in reversed(self._committed):
            problem = self._verify(ckpt)
            if problem is None:
                return ckpt
            self._events.emit(
                EventKind.CHECKPOINT_INVALID,
                f"checkpoint {ckpt.index} is damaged ({problem}); trying an older one",
                index=ckpt.index,
                path=ckpt.rel,
                problem=problem,
            )
        return None

    def _verify(self, ckpt: CommittedCheckpoint) -> Optional[str]:
        """What is wrong with ``ckpt``'s files, or None; StorageError if they cannot be seen."""
        if not ckpt.files:
            return None
        sizes = self._storage.file_sizes([f"{ckpt.rel}/{f[0]}" for f in ckpt.files])
        for f, size in zip(ckpt.files, sizes):
            if size is None:
                return f"{f[0]} missing"
            if size != int(f[1]):
                return f"{f[0]} has {size} bytes, manifest says {f[1]}"
        return None

    @property
    def committed(self) -> List[CommittedCheckpoint]:
        return list(self._committed)

    # -- commit --------------------------------------------------------------------
    def begin_epoch(self, epoch: int, world_size: int) -> None:
        """A new group forms: reports of the old epoch can no longer complete."""
        self._pending.clear()
        self._writers_this_epoch = None
        self._epoch = epoch
        self._world_size = world_size
        self.delete_uncommitted()

    def on_records(self, records: List[ReportRecord]) -> List[CommittedCheckpoint]:
        committed = []
        for rec in records:
            if rec.epoch != self._epoch:
                continue
            by_rank = self._pending.setdefault(rec.index, {})
            by_rank[rec.rank] = rec
            if len(by_rank) == self._world_size:
                del self._pending[rec.index]
                ckpt = self._commit(rec.index, by_rank)
                if ckpt is not None:
                    committed.append(ckpt)
        return committed

    def incomplete_through(self, index: int) -> List[int]:
        """Report indices up to ``index`` of this epoch that some ranks, not all, have
        reported so far: what could still commit if the rest arrive (the controller keeps
        collecting them for a moment after a rank raised)."""
        return sorted(i for i in self._pending if i <= index)

    def commit_after_loss(self, lost_ranks: List[int]) -> List[CommittedCheckpoint]:
        """Ranks died before their report of an index reached us. If every survivor
        reported it and, in this epoch's earlier commits, the lost ranks never wrote
        checkpoint files (plain DDP: rank 0 writes, others pass None), the lost ranks had
        nothing to add: commit instead of throwing the steps away. Sharded checkpoints,
        where every rank writes, still need every rank."""
        lost = set(lost_ranks)
        if self._writers_this_epoch is None or self._writers_this_epoch & lost:
            return []
        survivors = set(range(self._world_size)) - lost
        committed = []
        for index in sorted(self._pending):
            by_rank = self._pending[index]
            writers = {r for r, rec in by_rank.items() if rec.checkpoint_rel}
            if survivors <= set(by_rank) and self._writers_this_epoch <= writers:
                del self._pending[index]
                ckpt = self._commit(index, by_rank, inferred=sorted(lost))
                if ckpt is not None:
                    committed.append(ckpt)
        return committed

    def _commit(
        self, index: int, by_rank: Dict[int, ReportRecord], inferred: Optional[List[int]] = None
    ) -> Optional[CommittedCheckpoint]:
        skipped = {r.rank: r.persist_skipped for r in by_rank.values() if r.persist_skipped}
        if skipped:  # (other ranks' shards of it stay uncommitted: delete_uncommitted removes them)
            self._events.emit(
                EventKind.CHECKPOINT_SKIPPED,
                index=index,
                epoch=self._epoch,
                ranks=sorted(skipped),
                reason=f"rank {min(skipped)}: {skipped[min(skipped)]}; memory holds the state",
            )
            return None
        with_ckpt = [r for r in by_rank.values() if r.checkpoint_rel]
        if not with_ckpt:
            return None
        writers = {r.rank for r in with_ckpt}
        self._writers_this_epoch = writers if self._writers_this_epoch is None else self._writers_this_epoch | writers
        rel = with_ckpt[0].checkpoint_rel
        assert rel is not None  # with_ckpt holds only records with a checkpoint_rel
        if not self._owns(rel):  # never write (or later delete) outside this run's checkpoints
            logger.error(
                "not committing checkpoint %d: %r is not a checkpoint directory of this run "
                "(%s/checkpoint_<index>-e<epoch> or a named directory)",
                index,
                rel,
                self._dir,
            )
            return None
        replaced = [c for c in self._committed if c.rel == rel]  # a name reported again (Ray's layout)
        for c in replaced:
            self._committed.remove(c)
        files = sorted({tuple(f) for r in with_ckpt for f in r.files})
        rank0 = by_rank.get(0) or with_ckpt[0]
        ckpt = CommittedCheckpoint(
            rel=rel,
            index=index,
            epoch=self._epoch,
            world_size=self._world_size,
            ts=time.time(),
            files=[list(f) for f in files],
            metrics=rank0.metrics,
        )
        manifest = {"schema_version": SCHEMA_VERSION, **asdict(ckpt)}
        manifest.pop("rel")
        manifest["ranks_with_files"] = sorted(r.rank for r in with_ckpt)
        if inferred:
            manifest["ranks_lost_before_reporting"] = inferred
        self._storage.write_bytes(f"{rel}/{MANIFEST}", json.dumps(manifest, default=str).encode())
        self._committed.append(ckpt)
        self._events.emit(
            EventKind.CHECKPOINT_COMMITTED,
            index=index,
            epoch=self._epoch,
            path=rel,
            bytes=ckpt.num_bytes,
            world_size=self._world_size,
            stage_s=max(r.stage_s for r in with_ckpt),
            wait_s=max(r.wait_s for r in with_ckpt),
            upload_s=max(r.upload_s for r in with_ckpt),
        )
        self._retain()
        return ckpt

    def commit_evacuation(
        self, index: int, rel: str, files: List[Any], upload_s: float
    ) -> Optional[CommittedCheckpoint]:
        """Commit a snapshot that the last holders of the state wrote to storage before
        leaving (every member was on draining nodes): a single writer, already uploaded."""
        rec = ReportRecord(
            index=index,
            rank=0,
            epoch=self._epoch,
            ts=time.time(),
            metrics={},
            checkpoint_rel=rel,
            files=files,
            upload_s=upload_s,
        )
        self._pending.pop(index, None)
        return self._commit(index, {0: rec})

    def _retain(self) -> None:
        """Delete what ``scoring.to_delete`` says: the oldest beyond ``num_to_keep``, or with
        a score attribute the worst-scored beyond it except the newest."""
        doomed = scoring.to_delete(self._committed, self._num_to_keep, self._score_attribute, self._score_order)
        reason = f"num_to_keep={self._num_to_keep}"
        if self._score_attribute is not None:
            reason += f", ranked by {self._score_attribute!r} ({self._score_order})"
        for old in doomed:
            if not self._owns(old.rel):
                logger.warning(
                    "not deleting checkpoint %s: not a checkpoint directory of this run "
                    "(%s/checkpoint_<index>-e<epoch>)",
                    old.rel,
                    self._dir,
                )
                self._committed.remove(old)
                continue
            # Manifest first: a half-deleted directory must never look committed. If that
            # delete fails (StorageError) the checkpoint is still committed and still listed;
            # once it succeeds, a failed directory delete leaves an uncommitted directory,
            # which delete_uncommitted removes when the next group forms.
            self._storage.delete_file(f"{old.rel}/{MANIFEST}")
            self._committed.remove(old)
            self._storage.delete_dir(old.rel)
            self._events.emit(EventKind.CHECKPOINT_DELETED, index=old.index, path=old.rel, reason=reason)

    def _owns(self, rel: str) -> bool:
        """Whether ``rel`` is exactly ``<run>/checkpoints/<checkpoint dir>``, or ``<run>/<name>``
        for a report that named its directory: retention and cleanup delete nothing else
        (names are compared whole, never as patterns). Only committed named directories are
        ever deleted (by retention); ``delete_uncommitted`` looks in ``checkpoints/`` only."""
        head, sep, name = rel.rpartition("/")
        if sep and head == self._run_rel:
            return named_dir_problem(name) is None
        return bool(sep) and head == self._dir and CHECKPOINT_DIR.fullmatch(name) is not None

    def delete_uncommitted(self) -> None:
        """Remove directories no group can commit any more (writers are all stopped).

        A directory goes only when the store itself answers that it has no manifest; one
        whose manifest exists but is not in our list (corrupt, or a commit whose write
        reply was lost) is kept. A store that cannot answer raises StorageError."""
        committed = {c.rel for c in self._committed}
        for name in self._storage.list_dir(self._dir):
            rel = f"{self._dir}/{name}"
            if not self._owns(rel) or rel in committed:
                continue
            if self._storage.exists(f"{rel}/{MANIFEST}"):
                continue  # a corrupt manifest: keep the files for a human to look at
            self._storage.delete_dir(rel)
