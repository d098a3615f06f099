"""Transport: moving snapshot tensors between workers.

One interface, :class:`Transport` (torchft's ``CheckpointTransport`` idea: the copy code
says which piece goes where, the transport how it travels): tagged point-to-point
``send`` / ``recv``, ``broadcast`` from one holder, and small facts gathered or shared. Two
groups stand behind it:

- :meth:`Transport.side`, a gloo group of its own over the whole training group, moving
  host tensors. Used for the **peer copies during training** (:class:`PeerExchange`, in a
  thread of its own: never on the training thread or the training group, where a
  collective from another thread would interleave with the training's own) and for the
  **point-to-point sends of a sharded restore** (``sharded.reshard.reshard_from_memory``
  sends each old piece to the ranks whose new boxes overlap it), whatever the training
  backend is;
- :meth:`Transport.training`, the training group itself. Used for the **broadcasts of a
  replicated restore** (``replicated.assemble``); NCCL moves CUDA tensors only, so pieces
  are staged on the device and back.

The fourth route moves whole snapshots **through Ray**, between actors that share no
group with the receiver: evacuation before a drain and a hung worker's shards
(``TrainWorker.export_snapshot`` / ``merge_snapshot`` and ``SnapshotStore.merge``). It is not
a :class:`Transport`: its sender may be outside every group, so the worker group drives it
with actor calls.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from raylastic._internal.distributed.process_group import untracked


class Transport:
    """Moves tensors and small facts between the ranks of one ``torch.distributed`` group.
    Every method but :meth:`send` / :meth:`recv` is a collective over the group; sends and
    receives pair up by (peer, tag). Every group here spans the whole training group, so
    its ranks are the training group's (what torch's p2p and broadcast calls take)."""

    def __init__(self, group: Any = None):
        self.group = group  # None: the training (default) group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        # gloo moves host tensors; the training group's backend decides for it
        self.device = torch.device("cpu") if group is not None else collective_device()

    @classmethod
    def side(cls, timeout_s: float) -> "Transport":
        """Over a new gloo group of the whole training group (collective: every rank calls
        it): host tensors, moved off the training thread or whatever the backend is."""
        with untracked():  # its transfers finish or fail on their own; an abort does not cut them
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=max(timeout_s, 10)))
        return cls(group)

    @classmethod
    def training(cls) -> "Transport":
        return cls(None)

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order (pickled: small facts only)."""
        everyone: List[Any] = [None] * self.world
        dist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def share(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s ``obj`` on every rank (pickled: small facts only)."""
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` is true on every rank (a one-integer all-reduce)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def send(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        """Start sending host tensor ``t`` to rank ``dst``; returns the work to :meth:`wait` on."""
        return dist.isend(t.contiguous(), dst=dst, group=self.group, tag=tag)

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> Any:
        """Start receiving into host tensor ``buf`` from rank ``src``."""
        return dist.irecv(buf, src=src, group=self.group, tag=tag)

    @staticmethod
    def wait(works: Sequence[Any]) -> None:
        for w in works:
            assert w is not None  # None only for a rank outside the group
            w.wait()

    def broadcast(self, t: Optional[torch.Tensor], meta: torch.Tensor, src: int) -> torch.Tensor:
        """Send ``t`` (on rank ``src``) or receive into a new host tensor shaped like ``meta``."""
        if self.device.type == "cpu":
            t = t if t is not None else torch.empty(meta.shape, dtype=meta.dtype)
            dist.broadcast(t, src=src, group=self.group)
            return t
        staged = t.to(self.device) if t is not None else torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        dist.broadcast(staged, src=src, group=self.group)
        return t if t is not None else staged.cpu()


class PeerExchange:
    """Sends this rank's shard of each snapshot to the ranks that back it up and receives
    the shards this rank backs up, over a gloo group of its own, in a thread of its own
    (never on the training thread, never on the training group: a collective there from
    another thread would interleave with the training's own). Snapshots are exchanged in
    commit order; every rank commits the same snapshots, so sends and receives pair up.
    A peer that dies mid-exchange fails it (connection closed, or the group timeout): the
    snapshot then holds only this rank's own shard, which the controller sees. ``transport``:
    :meth:`Transport.side`'s, used from this thread only."""

    def __init__(self, transport: Transport, held: Sequence[Sequence[int]]):
        self._transport = transport
        self._rank = transport.rank
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

    def exchange(
        self, own: Sequence[torch.Tensor], incoming: Mapping[int, Sequence[torch.Tensor]], index: int = 0
    ) -> None:
        """Send ``own`` to every receiver, receive into ``incoming[src]`` (host tensors).
        Tags carry the snapshot index: a peer that skipped a snapshot can only stall this
        exchange (the group timeout fails it), never fill it with another step's shard."""
        tr, works = self._transport, []
        base = _tag_base(own, incoming, index)
        for dst in self.receivers():
            for j, t in enumerate(own):
                if t.numel():
                    works.append(tr.send(t, dst, base + j))
        for src, bufs in incoming.items():
            for j, t in enumerate(bufs):
                if t.numel():
                    works.append(tr.recv(t, src, base + j))
        tr.wait(works)

    def all_true(self, flag: bool) -> bool:
        """Whether every rank's peer copy of this snapshot ended well (the lean vote)."""
        return self._transport.all_true(flag)

    def exchange_all(
        self,
        own: Sequence[torch.Tensor],
        incoming: Mapping[int, Sequence[torch.Tensor]],
        index: int = 0,
        stage_bytes: int = 64 << 20,
    ) -> Tuple[bool, bool, Optional[BaseException]]:
        """:meth:`exchange` for a lean commit, whose ``own`` tensors are the live state
        (CUDA ones are staged through host memory, ``stage_bytes`` at a time). Every
        receive is posted first, and every send and receive is waited for, failed or not:
        once this returns, nothing reads ``own`` any more. Returns (all sends ended well,
        all receives did, the first error)."""
        tr = self._transport
        base = _tag_base(own, incoming, index)
        errors: List[BaseException] = []

        def settle(works: List[Any]) -> bool:
            ok = True
            for w in works:
                try:
                    w.wait()
                except Exception as e:  # noqa: BLE001 - the caller votes on it
                    errors.append(e)
                    ok = False
            return ok

        recvs: List[Any] = []
        received = True
        try:
            for src, bufs in incoming.items():
                recvs += [tr.recv(t, src, base + j) for j, t in enumerate(bufs) if t.numel()]
        except Exception as e:  # noqa: BLE001 - what was posted is still waited for
            errors.append(e)
            received = False
        sent, batch, staged = True, [], 0
        try:
            for dst in self.receivers():
                for j, t in enumerate(own):
                    if not t.numel():
                        continue
                    host = t.detach().to("cpu") if t.is_cuda else t.detach()
                    batch.append(tr.send(host, dst, base + j))
                    staged += host.numel() * host.element_size() if t.is_cuda else 0
                    if staged >= stage_bytes:  # the staged copies of CUDA pieces are freed per batch
                        sent = settle(batch) and sent
                        batch, staged = [], 0
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            sent = False
        sent = settle(batch) and sent
        received = settle(recvs) and received
        return sent, received, (errors[0] if errors else None)


def _tag_base(own: Sequence[Any], incoming: Mapping[int, Sequence[Any]], index: int) -> int:
    """The first tag of snapshot ``index``'s peer copy (piece j goes as base + j)."""
    if len(own) >= 100_000 or any(len(b) >= 100_000 for b in incoming.values()):
        raise ValueError("more than 100,000 sharded tensors per rank")
    return (index % 4096) * 100_000


def collective_device() -> torch.device:
    """NCCL moves only CUDA tensors; gloo moves CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


__all__ = ["Transport", "PeerExchange", "collective_device"]
