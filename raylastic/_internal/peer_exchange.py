"""Peer copies of sharded snapshots during training: which shards each rank holds
(``holders_for``) and the thread that sends and receives them (``PeerExchange``). Split from
``sharded.py`` (layouts, resharding and reading shard files), which the exchange does not need.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


class PeerExchange:
    """Sends this rank's shard of each snapshot to the ranks that back it up and receives
    the shards this rank backs up, over a gloo group of its own, in a thread of its own
    (never on the training thread, never on the training group: a collective there from
    another thread would interleave with the training's own). Snapshots are exchanged in
    commit order; every rank commits the same snapshots, so sends and receives pair up.
    A peer that dies mid-exchange fails it (connection closed, or the group timeout): the
    snapshot then holds only this rank's own shard, which the controller sees."""

    def __init__(self, group: Any, rank: int, holders: Sequence[Sequence[int]]):
        self._group = group
        self._rank = rank
        # shards each rank holds (its own first); rank r sends shard r to every q holding it
        self.holders = [tuple(h) for h in holders]
        self._q: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="raylastic-peer-exchange", daemon=True)
        self._thread.start()

    def receivers(self) -> List[int]:
        return [q for q, h in enumerate(self.holders) if q != self._rank and self._rank in h]

    def sources(self) -> List[int]:
        return [s for s in self.holders[self._rank] if s != self._rank]

    def submit(self, job: Callable[[], None]) -> None:
        self._q.put(job)

    def close(self) -> None:
        self._q.put(None)

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            job()

    def exchange(self, own: Sequence[torch.Tensor], incoming: Mapping[int, Sequence[torch.Tensor]],
                 index: int = 0) -> None:
        """Send ``own`` to every receiver, receive into ``incoming[src]`` (host tensors).
        Tags carry the snapshot index: a peer that skipped a snapshot can only stall this
        exchange (the group timeout fails it), never fill it with another step's shard."""
        works = []
        base = (index % 4096) * 100_000
        if len(own) >= 100_000 or any(len(b) >= 100_000 for b in incoming.values()):
            raise ValueError("more than 100,000 sharded tensors per rank")
        for dst in self.receivers():
            for j, t in enumerate(own):
                if t.numel():
                    works.append(dist.isend(t, dst=dst, group=self._group, tag=base + j))
        for src, bufs in incoming.items():
            for j, t in enumerate(bufs):
                if t.numel():
                    works.append(dist.irecv(t, src=src, group=self._group, tag=base + j))
        for w in works:
            assert w is not None  # None only for a rank outside the group
            w.wait()


def holders_for(world: int, stripe: Sequence[int], rank: int) -> Tuple[int, ...]:
    """Shards this rank holds of each sharded snapshot: its own, plus the ones
    ``plan_stripes`` gives it (the second copies); with 2 ranks each backs the other up."""
    if world == 1:
        return (0,)
    if world == 2:
        return (rank, 1 - rank)
    mine = set(stripe) if stripe else {rank}
    return tuple([rank] + sorted(mine - {rank}))


# -- restoring -----------------------------------------------------------------------------------
