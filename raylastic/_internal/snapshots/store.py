"""The process-wide store of in-memory snapshots.

Why process-wide: a resize unwinds the train function and calls it again in the same
worker process, and the snapshots must outlive it (they are what the next attempt
restores from). The store keeps the newest ``keep`` snapshots of one run, hands the
oldest back for its buffers to be reused (double buffering), and answers the worker's
questions for the controller (which snapshots are complete here, which are striped).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

import torch

from raylastic._internal.snapshots.capture import leaves, map_leaves, nbytes
from raylastic._internal.snapshots.persist import save_whole
from raylastic._internal.snapshots.placement import WHOLE, Holding, is_whole, union

T = TypeVar("T")


@dataclass
class Snapshot:
    index: int  # report index this snapshot was committed at
    plain: Dict[str, Any]
    tensors: Dict[str, Any] = field(default_factory=dict)  # model/optimizer state dicts (cloned)
    rng: Dict[str, Any] = field(default_factory=dict)
    complete: threading.Event = field(default_factory=threading.Event)  # copied successfully
    done: threading.Event = field(default_factory=threading.Event)  # copy over, either way
    error: Optional[BaseException] = None
    nbytes: int = 0
    # Buffers receiving peer shards, not yet merged into ``tensors`` (counted there after):
    # held all the same, and uncounted they made 4x read as 3x (issue 23).
    incoming_nbytes: int = 0
    pins: int = 0  # a background writer is reading the tensors: do not recycle
    # A lean sharded commit (``sharded/lean.py``) not over yet: makes the snapshot
    # independent of the live state at once, for an attempt that ends before it is over.
    settle: Optional[Callable[[], None]] = None
    voted: bool = False  # a lean commit every rank's peer copies of which landed
    # (nshards, shards) this copy holds (the rest are meta placeholders, see
    # ``placement``); WHOLE: a full copy.
    holding: Holding = WHOLE

    def save(self, directory: str) -> None:
        """Write the restorable part (what ``ElasticState`` reads back from storage)."""
        save_whole(self, directory)


class SnapshotStore:
    """Process-wide: snapshots outlive a train function that was unwound for a resize."""

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._lock = threading.Lock()
        self._snaps: List[Snapshot] = []
        self.run: Optional[str] = None

    def add(self, run: str, snap: Snapshot, trim: bool = True) -> None:
        """``trim`` False: a lean commit, whose snapshots ``trim_lean`` and ``take_older``
        drop (the older one must stay until every peer copy of the newer landed)."""
        with self._lock:
            if self.run != run:
                self._snaps, self.run = [], run
            older = [s for s in self._snaps if s.index < snap.index]
            self._snaps = (older[-(self._keep - 1) :] if trim else older) + [snap]

    def trim_lean(self, run: str) -> None:
        """Before a lean commit: keep the newest complete snapshot and the newest voted
        one (whole on every rank; after a failed vote the newer may be partial), drop the
        rest: a vote that keeps failing must not pile snapshots up."""
        with self._lock:
            if self.run != run:
                return
            complete = [s for s in self._snaps if s.complete.is_set()]
            keep = {id(s) for s in complete[-1:] + [s for s in complete if s.voted][-1:]}
            self._snaps = [s for s in self._snaps if id(s) in keep]

    def recycle(self, run: str) -> Optional[Snapshot]:
        """Take the oldest snapshot out of the store so its tensor buffers can be reused
        (double buffering: no 100s of MB allocated and page-faulted per step). Only when
        the store is full, and never a pinned one or the newest complete one."""
        with self._lock:
            if self.run != run or len(self._snaps) < self._keep:
                return None
            oldest = self._snaps[0]
            if oldest.pins or not oldest.complete.is_set():
                return None
            self._snaps.pop(0)
            oldest.complete.clear()
            oldest.done.clear()
            return oldest

    def take_older(self, run: str, snap: Snapshot) -> Tuple[bool, Optional[Snapshot]]:
        """Take every snapshot older than ``snap`` out of the store (a lean commit whose
        peer copies all landed keeps one snapshot). Returns whether ``snap`` is still in
        the store (not when a restore dropped it as a rolled-back future: then nothing is
        taken, the restored snapshot among them) and the newest unpinned snapshot taken,
        whose buffers may be reused."""
        with self._lock:
            if self.run != run or not any(s is snap for s in self._snaps):
                return False, None
            older = [s for s in self._snaps if s.index < snap.index]
            self._snaps = [s for s in self._snaps if s.index >= snap.index]
        for s in reversed(older):
            if not s.pins:
                s.complete.clear()
                return True, s
        return True, None

    def lend_peer_shards(self, run: str, root: str, rank: int) -> Dict[int, List[torch.Tensor]]:
        """``lean_snapshots="in_place"``: take the shards rank ``rank`` backs up (every
        shard but its own) out of the snapshots held, newest first, and return them by
        shard for the next peer copy to land in. The snapshots keep meta placeholders and
        say they no longer hold those shards, so a restore planned meanwhile does not count
        on them; the older copies of a shard are dropped (freed once received into anew)."""
        lent: Dict[int, List[torch.Tensor]] = {}
        with self._lock:
            if self.run != run:
                return lent
            for snap in reversed(self._snaps):
                tree = snap.tensors.get(root) or {}
                peers = {s for s, ts in tree.items() if s != rank and any(not t.is_meta for t in ts)}
                if not peers:
                    continue
                for s in peers:
                    lent.setdefault(s, tree[s])
                snap.tensors = {
                    **snap.tensors,
                    root: {
                        s: [torch.empty_like(t, device="meta") for t in ts] if s in peers else ts
                        for s, ts in tree.items()
                    },
                }
                held = range(len(tree)) if is_whole(snap.holding) else snap.holding[1]
                snap.holding = (
                    len(tree) if is_whole(snap.holding) else snap.holding[0],
                    tuple(s for s in held if s not in peers),
                )
                snap.nbytes = nbytes(snap.tensors)
        return lent

    def holdings(self, run: str) -> Tuple[List[int], Dict[int, Tuple[int, Tuple[int, ...]]]]:
        """The complete snapshots' indices, and those that hold only some shards (index ->
        (nshards, shards)), in one view: a commit may end between two separate looks."""
        with self._lock:
            if self.run != run:
                return [], {}
            done = [s for s in self._snaps if s.complete.is_set()]
            return [s.index for s in done], {s.index: s.holding for s in done if not is_whole(s.holding)}

    def complete_indices(self, run: str) -> List[int]:
        return self.holdings(run)[0]

    def stripes(self, run: str) -> Dict[int, Tuple[int, Tuple[int, ...]]]:
        """Complete snapshots that hold only some shards: index -> (nshards, shards)."""
        return self.holdings(run)[1]

    def merge(self, run: str, index: int, holding: Holding, tensors: Dict[int, torch.Tensor]) -> Holding:
        """Fill snapshot ``index``'s placeholders with another copy's tensors (by leaf
        position); returns what it holds now (WHOLE: all of it)."""
        with self._lock:
            snap = self._complete(run, index)
            if snap is None:
                raise RuntimeError(f"no complete in-memory snapshot {index} to merge into")
            snap.tensors = map_leaves(snap.tensors, lambda j, t: tensors[j] if t.is_meta and j in tensors else t)
            if not any(t.is_meta for t in leaves(snap.tensors)):
                snap.holding = WHOLE
            elif not is_whole(snap.holding) and not is_whole(holding):
                snap.holding = union(snap.holding, holding)
            snap.nbytes = nbytes(snap.tensors)
            return snap.holding

    def get(self, run: str, index: int) -> Optional[Snapshot]:
        with self._lock:
            return self._complete(run, index)

    def _complete(self, run: str, index: int) -> Optional[Snapshot]:
        """The complete snapshot ``index`` of ``run`` (the caller holds the lock)."""
        return next((s for s in self._snaps if self.run == run and s.index == index and s.complete.is_set()), None)

    def read(self, run: str, index: int, fn: Callable[[Snapshot], T]) -> T:
        """``fn(snapshot)`` for the complete snapshot ``index``, under the store's lock.

        Why the lock: the controller reads a worker's snapshot from another thread of the
        actor (to move a leaving or stuck worker's shards, or to persist them), and a commit
        of the worker's own train thread meanwhile could recycle, lend or drop the buffers
        being read: a torn copy. Every path that hands buffers back for reuse takes this
        lock, so ``fn`` must finish its copy before it returns (``ray.put``, ``torch.save``);
        a commit waits for it. Rare and off the steady training path."""
        with self._lock:
            snap = self._complete(run, index)
            if snap is None:
                raise RuntimeError(f"no complete in-memory snapshot {index} here")
            return fn(snap)

    def drop_after(self, run: str, index: int) -> None:
        """Forget snapshots newer than the restore point (a rolled-back future)."""
        with self._lock:
            if self.run == run:
                self._snaps = [s for s in self._snaps if s.index <= index]

    def wait_pending(self, timeout_s: float = 30.0, own_only: bool = False) -> None:
        """Let in-flight tensor copies finish (a stopping worker's last snapshot).

        ``own_only`` (the attempt was aborted or failed: a peer may be gone): wait only for the copies
        out of the live state, which the next attempt writes, not for a sharded
        snapshot's peer copy, which runs from host buffers in its own thread. That copy
        may be blocked on the vanished peer until the side group's timeout, and waiting
        for it kept a survivor past the abort window: it was replaced and its snapshot
        lost (a 51.6M ZeRO-3 run then fell back to storage)."""
        with self._lock:
            snaps = list(self._snaps)
        deadline = time.monotonic() + timeout_s
        for snap in snaps:
            settle = snap.settle  # (the exchange thread clears it when the commit ends)
            if own_only and settle is not None:
                settle()  # a lean commit: its own shard out of the live state now
            while not (snap.done.is_set() or (own_only and snap.complete.is_set())):
                if time.monotonic() >= deadline or snap.done.wait(0.005):
                    break
            settle = snap.settle
            if not snap.done.is_set() and settle is not None:
                settle()  # given up on: the next attempt must not meet its late vote

    def clear(self) -> None:
        """Forget every snapshot: the run ended, and this process may serve another
        (a kept worker, ``ScalingConfig.keep_workers_s``)."""
        with self._lock:
            self._snaps, self.run = [], None

    def nbytes(self) -> int:
        """Host bytes the kept snapshots hold, with the peer shards still arriving."""
        with self._lock:
            return sum(s.nbytes + s.incoming_nbytes for s in self._snaps)

    def held(self) -> List[Snapshot]:
        """The snapshots held now, oldest first (for memory accounting)."""
        with self._lock:
            return list(self._snaps)


STORE = SnapshotStore()


__all__ = ["Snapshot", "SnapshotStore", "STORE"]
