"""Lean sharded snapshots (``ElasticState(lean_snapshots=True)``): one snapshot kept, 2x
the rank's own shard between commits and 3x during a commit's peer copy, instead of 4x
(``"in_place"``: 2x while commits succeed, see the end).

Why the default holds 4x: a commit copies the own shard of step k+1 into host buffers of
its own while the next step runs, and the shards of step k stay whole until every peer
copy of k+1 has landed, so that a loss at any instant restores from memory
(``docs/sharded.md``). Here the own shard of k+1 is not copied to a buffer of its own:

1. the commit sends it **from the live state** to the ranks that back it up (CUDA pieces
   staged through host memory a batch at a time) and receives the shards this rank
   backs up into new buffers (the third shard of memory);
2. every rank then says whether its sends and receives all ended well
   (:meth:`Transport.all_true`, a one-integer all-reduce on the side group);
3. if all did, snapshot k goes: the own shard of k+1 is copied out of the live state into
   k's own buffers, and k's peer buffers are freed (2x again);
4. the optimizer's next ``step()`` waits for all of that (its step pre-hook): the live
   state is the only copy of the own shard of k+1 until step 3 ends. That wait is the
   price: the peer copy no longer overlaps the next step's optimizer update.

If a peer dies in between, the rank keeps snapshot k whole, and keeps k+1 too: its own
shard copied out of the live state into new host memory (on failures only: 4x until
the restore) plus the shards it received whole. Whatever instant the node goes, each
shard of k or of k+1 is then held by a survivor: before any rank has step 2's answer, no
rank dropped k; once one has, every peer copy of k+1 has landed. On an abort the
optimizer's hook does not let the step run (the live state must not change while a send
may still read it): it copies the own shard out and unwinds the train function
(``StopTraining``), as ``report()`` does. A stopping worker's ``wait_pending`` settles
the snapshot the same way (``Snapshot.settle``), so it never waits for a peer copy to a
vanished peer.

``lean_snapshots="in_place"``: 2x at every instant. At the commit the held snapshots
give up the shards this rank backs up (``SnapshotStore.lend_peer_shards``), and the
peer copy lands in those buffers; after the vote, or a settle, the own shard moves into
the older snapshot's own buffers and it goes (a settle keeps it: one more shard until the
restore, see ``_settle``). The price: from the commit until the vote,
no snapshot in memory holds a backup that a loss in that window needs whole (the older
ones gave theirs up, the newer one is still arriving), so such a loss restores from
storage (the controller sees the holdings and plans it). A loss after a sender's peer
copies landed still restores the newer snapshot from memory.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from raylastic._internal.snapshots.capture import copy_into

logger = logging.getLogger("raylastic")


class LeanCommit:
    """One lean commit of the sharded half: its peer copy, the vote, and the copy of the
    own shard out of the live state. ``run`` runs in the peer-exchange thread (the copy
    thread for a single rank); ``wait`` is the optimizer's step pre-hook; ``settle`` is
    for an attempt that ends before ``run`` does.

    ``snap``: the new snapshot (its own shard still ``meta``); ``sources``: what to send,
    the own shard's live tensors (model buffers already copied: the forward writes them);
    ``incoming``: buffers for the shards this rank backs up; ``merge(snap, tensors)``:
    put own and received tensors into ``snap`` and mark what it holds; ``take_older()``:
    take every older snapshot out of the store, returning one whose buffers may be reused;
    ``exchange``: the ``PeerExchange`` (None for a single rank); ``ready``: for CUDA
    sources, an event on the training stream that this thread waits for before reading
    them; ``aborted``: whether the attempt was aborted."""

    def __init__(
        self,
        snap: Any,
        rank: int,
        sources: Sequence[torch.Tensor],
        incoming: Dict[int, List[torch.Tensor]],
        *,
        exchange: Any,
        ready: Any = None,
        merge: Callable[[Any, Dict[int, List[torch.Tensor]]], None],
        take_older: Callable[[], Tuple[bool, Optional[Any]]],
        aborted: Callable[[], bool],
        stop: Callable[[], BaseException],
        root: str,
        in_place: bool = False,
    ):
        self.snap = snap
        self.rank = rank
        self.sources = list(sources)
        self.incoming = incoming
        self._exchange = exchange
        self._ready = ready  # CUDA sources: an event recorded after the step that wrote them
        self._merge = merge
        self._take_older = take_older
        self._aborted = aborted
        self._stop = stop
        self._root = root
        self._in_place = in_place  # ``incoming`` are the older snapshots' buffers (see the module)
        self._lock = threading.Lock()
        self.over = False  # finished (the vote passed) or settled: the snapshot is complete
        self._received = False  # every receive of the peer copy ended well
        self.released = threading.Event()  # the live state may be written again
        self.error: Optional[BaseException] = None

    # -- the exchange thread -------------------------------------------------------------
    def run(self) -> None:
        sent = agreed = False
        try:
            if self._ready is not None:
                self._ready.synchronize()
            if self._exchange is None:
                sent = agreed = True
                self._received = True
            else:
                try:
                    sent, received, error = self._exchange.exchange_all(self.sources, self.incoming, self.snap.index)
                except Exception as e:  # noqa: BLE001 - nothing was posted: vote no all the same
                    sent, received, error = False, False, e
                with self._lock:
                    self._received = received  # a settle() from now on keeps what landed
                if error is not None:
                    logger.warning("snapshot %s: peer copy failed (%s); %s", self.snap.index, error, self._kept())
                agreed = self._exchange.all_true(sent and received)  # every rank votes, always
        except Exception as e:  # noqa: BLE001 - the vote failed: a peer is gone
            logger.warning("snapshot %s: peers did not all answer (%s); %s", self.snap.index, e, self._kept())
        try:
            with self._lock:
                if not self.over:
                    if not (agreed and self._finish()):
                        self._settle()
                elif self._received:  # settled by the training thread before the copy landed
                    self._merge(self.snap, self.incoming)
        except BaseException as e:  # noqa: BLE001 - surfaced by wait() and the writer
            self.error = self.snap.error = e
            logger.warning("snapshot %s: lean commit failed: %s", self.snap.index, e)
        finally:
            self.snap.pins -= 1
            self.snap.incoming_nbytes = 0
            self.snap.settle = None
            self.sources, self.incoming = [], {}  # the old attempt's live tensors are not kept
            self.snap.done.set()
            self.released.set()

    def _kept(self) -> str:
        if self._in_place:
            return "it is kept as far as it goes; the one before it gave up its backups (in place)"
        return "the snapshot before it is kept"

    def _finish(self) -> bool:
        """Every peer copy of this snapshot landed: the older snapshots go, and the own
        shard moves out of the live state into the newest older one's buffers. False when
        a restore dropped this snapshot meanwhile (it was not complete in time): then the
        store is left as the restore made it."""
        present, old = self._take_older()
        if not present:
            return False
        bufs = (old.tensors.get(self._root, {}).get(self.rank) if old is not None else None) or []
        own = [copy_into(bufs[j] if j < len(bufs) else None, t) for j, t in enumerate(self.sources)]
        self._merge(self.snap, {self.rank: own, **self.incoming})
        self.over = True
        self.snap.voted = True
        self.snap.complete.set()
        return True

    def _settle(self) -> None:
        """Keep this snapshot as far as it goes: the own shard in new host memory, the
        shards received whole. The older snapshots stay, in place too (one more shard
        until the restore): a rank whose peer unwound before committing this snapshot
        holds only the older one, which every rank's own shard of it then restores."""
        own = [copy_into(None, t) for t in self.sources]
        tensors: Dict[int, List[torch.Tensor]] = {self.rank: own}
        if self._received:
            tensors.update(self.incoming)
        self._merge(self.snap, tensors)
        self.over = True
        self.snap.complete.set()

    # -- the training thread -------------------------------------------------------------
    def settle(self) -> None:
        """The attempt ends: make this snapshot independent of the live state now."""
        with self._lock:
            if not self.over:
                self._settle()

    def wait(self) -> None:
        """The optimizer's step pre-hook: the live state is the only copy of the own shard
        until ``run`` ends. On an abort: settle and unwind instead of stepping."""
        while not self.released.wait(0.05):
            if self._aborted():
                self.settle()
                raise self._stop()
        if self.error is not None:
            raise RuntimeError(f"snapshot {self.snap.index}: lean commit failed: {self.error}") from self.error


__all__ = ["LeanCommit"]
