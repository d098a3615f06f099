"""Transport: moving snapshot tensors between workers.

Why one module: the routes differ in who runs them and on which group, and each has
reasons that are easy to break from elsewhere:

- **peer copies during training** (:class:`PeerExchange`): a sharded rank's own shard to
  the ranks that back it up, over a gloo group of its own (:func:`side_group`), in a
  thread of its own: never on the training thread or the training group, where a
  collective from another thread would interleave with the training's own;
- **broadcasts on a replicated restore** (:func:`broadcast`): over the training group
  (NCCL moves CUDA tensors only, so pieces are staged on the device and back);
- **point-to-point on a sharded restore**: ``sharded.reshard.reshard_from_memory`` sends
  each old piece to the ranks whose new boxes overlap it, over the side group;
- **through Ray**, between actors (evacuation before a drain, a hung worker's shards):
  ``TrainWorker.export_snapshot`` / ``merge_snapshot`` and ``SnapshotStore.merge``.

The first three are torch.distributed calls and live here or next to the arithmetic
that decides what to send; the fourth is actor calls made by the worker group.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch
import torch.distributed as dist

from raylastic._internal.distributed.process_group import untracked


def side_group(timeout_s: float) -> Any:
    """A gloo group over the whole training group, for host tensors moved off the training
    thread (peer copies) or whatever the training backend is (restores)."""
    with untracked():  # its transfers finish or fail on their own; an abort does not cut them
        return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(timeout_s, 10)))


class PeerExchange:
    """Sends this rank's shard of each snapshot to the ranks that back it up and receives
    the shards this rank backs up, over a gloo group of its own, in a thread of its own
    (never on the training thread, never on the training group: a collective there from
    another thread would interleave with the training's own). Snapshots are exchanged in
    commit order; every rank commits the same snapshots, so sends and receives pair up.
    A peer that dies mid-exchange fails it (connection closed, or the group timeout): the
    snapshot then holds only this rank's own shard, which the controller sees."""

    def __init__(self, group: Any, rank: int, held: Sequence[Sequence[int]]):
        self._group = group
        self._rank = rank
        # shards each rank holds (its own first); rank r sends shard r to every q holding it
        self.held = [tuple(h) for h in held]
        self._q: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="raylastic-peer-exchange", daemon=True)
        self._thread.start()

    def receivers(self) -> List[int]:
        return [q for q, h in enumerate(self.held) if q != self._rank and self._rank in h]

    def sources(self) -> List[int]:
        return [s for s in self.held[self._rank] if s != self._rank]

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


def collective_device() -> torch.device:
    """NCCL moves only CUDA tensors; gloo moves CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast(t: Optional[torch.Tensor], meta: torch.Tensor, src: int, device: torch.device) -> torch.Tensor:
    """Send ``t`` (the source) or receive into a new host tensor shaped like ``meta``."""
    if device.type == "cpu":
        t = t if t is not None else torch.empty(meta.shape, dtype=meta.dtype)
        dist.broadcast(t, src=src)
        return t
    staged = t.to(device) if t is not None else torch.empty(meta.shape, dtype=meta.dtype, device=device)
    dist.broadcast(staged, src=src)
    return t if t is not None else staged.cpu()


__all__ = ["PeerExchange", "side_group", "broadcast", "collective_device"]
