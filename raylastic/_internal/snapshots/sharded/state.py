"""The sharded half of ``ElasticState`` (FSDP2, DeepSpeed ZeRO): snapshots of the rank's
own shard plus peer copies, restored at any world size. See ``sharded/__init__`` for why.

A sharded snapshot keeps its tensors as ``{"sharded": {s: [tensor, ...]}}``: one list per
old rank ``s`` of the group that took it, in that rank's chunk order, with ``meta``
placeholders for the shards this rank does not hold. That is the leaf layout the
replicated snapshots use, so the worker's export/merge of shards (evacuation before a
drain, rescuing a hung worker) and the controller's coverage checks need no new code.
The layout (every old rank's chunks) and the adapter's plain state ride in
``plain["sharded"]``.

Memory per rank: a complete snapshot holds the rank's own shard and the shard(s) it
backs up (``placement.plan_stripes``: one other with the same number of workers per node,
so 2x the own shard); two snapshots are kept (the newer is written while the older stays
restorable), so at most 4x the own shard's state plus the re-partition's transfer buffers
(one old shard's pieces) during a restore.

Storage: every rank writes its own shard to ``sharded/rank_<r>.pt`` of a persisted
checkpoint; rank 0 also writes ``elastic_state.pt`` with the plain state and the layout
(``persist``). Loading at any world size memory-maps the files and reads the overlaps only.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from raylastic._internal.snapshots.capture import COPY_THREAD, CopyWaiter, PendingCopy, map_leaves, nbytes, plan_copy
from raylastic._internal.snapshots.persist import read_shards, shard_writer
from raylastic._internal.snapshots.placement import held_shards, union
from raylastic._internal.snapshots.sharded.lean import LeanCommit
from raylastic._internal.snapshots.sharded.layout import ROOT, Chunk, dtype_of, layout_fingerprint, meta
from raylastic._internal.snapshots.sharded.reshard import fill_from_files, reshard_from_memory
from raylastic._internal.snapshots.store import STORE
from raylastic._internal.snapshots.transport import PeerExchange, Transport
from raylastic._internal.state_values import IN_PLACE
from raylastic.session import StopTraining

logger = logging.getLogger("raylastic")


class ShardedState(CopyWaiter):
    """The sharded half of one ``ElasticState`` (``registry.Half``): one per train-function
    attempt. ``overlap``: the copy of the own shard runs until the optimizer's next step."""

    snapshot_on_stop = False  # every rank must take the same snapshots: their peer copies pair up

    def __init__(self, adapter: Any, sess: Any, *, overlap: bool, lean: Union[bool, str] = False, store: Any = STORE):
        super().__init__()  # the copy of the own shard the next optimizer step waits for
        spec = sess.spec
        rank, world, stripe = spec.rank, spec.world_size, tuple(spec.stripe)
        self.adapter = adapter
        self._sess = sess
        self._store = store
        self.rank, self.world = rank, world
        self.overlap = overlap
        self.lean = bool(lean)  # one snapshot kept: ``lean.py``
        self.in_place = lean == IN_PLACE  # the peer copy lands in the buffers it replaces
        self._side: Optional[Transport] = None
        self._exchange: Optional[PeerExchange] = None
        self._layout: Optional[Dict[int, List[Chunk]]] = None
        self._local_fp: Optional[str] = None
        self.holds = held_shards(world, stripe, rank)
        if dist.is_initialized() and world > 1:
            # Its own gloo group: peer copies run in a background thread and the restore
            # moves host tensors whatever the training backend is (NCCL moves CUDA only).
            self._side = Transport.side(spec.timeout_s)
            self._exchange = PeerExchange(self._side, self._side.gather(self.holds))
        if overlap:  # the optimizer's next step waits for the copy of the own shard
            adapter.optimizer.register_step_pre_hook(lambda _o, _a, _k: self.wait())

    # -- restore -----------------------------------------------------------------------------
    def restore_memory(self, index: int, snap: Optional[Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Collective: fill the live state from in-memory snapshot ``snap`` (None on a
        rank holding none of it). Returns the snapshot's (plain, rng). ValueError: it does
        not fit (the same on every rank)."""
        layout: Optional[Dict[int, List[Chunk]]] = None
        held: Dict[int, List[torch.Tensor]] = {}
        plain: Optional[Dict[str, Any]] = None
        if snap is not None:
            if ROOT not in snap.plain:
                raise ValueError("the snapshot holds replicated (DDP) state; this model is sharded")
            layout = {int(s): [Chunk.of(t) for t in cs] for s, cs in snap.plain[ROOT]["layout"].items()}
            tree = snap.tensors.get(ROOT, {})
            held = {int(s): ts for s, ts in tree.items() if ts and not any(t.is_meta for t in ts)}
            held.update({int(s): [] for s, ts in tree.items() if not ts})  # a shard with no pieces
            plain = snap.plain
        if self._side is None and not dist.is_initialized():
            if not held or layout is None or set(held) != set(layout):
                raise ValueError("this single process does not hold every shard of the snapshot")
            targets = self.adapter.restore_targets([c for cs in layout.values() for c in cs])
            fill_from_files(
                targets, {s: {"chunks": [c.as_tuple() for c in layout[s]], "tensors": held[s]} for s in held}
            )
        else:
            transport = self._side if self._side is not None else Transport.training()  # one rank
            plain = reshard_from_memory(transport, self.adapter.restore_targets, layout, held, plain)
        assert plain is not None  # held shards came with the snapshot's plain; reshard returns it
        self.adapter.finish_restore(plain[ROOT]["adapter"])
        return plain, (snap.rng if snap is not None else {})  # a survivor keeps its RNG streams

    def restore_storage(self, directory: str, blob: Dict[str, Any]) -> None:
        """Fill the live state from a persisted sharded checkpoint in ``directory`` (the
        per-rank shard files, read while it is there)."""
        try:
            self._restore_storage(directory, blob)
        except ValueError as e:
            raise ValueError(
                f"rank {self.rank}: checkpoint {self._sess.restore.checkpoint_rel} does not "
                f"fit this model: {e}. Nothing was loaded; start a new run (another "
                "RunConfig.name) or restore the matching model"
            ) from None

    def _restore_storage(self, directory: str, blob: Dict[str, Any]) -> None:
        plain = blob["plain"]
        if ROOT not in plain:
            raise ValueError("the checkpoint holds replicated (DDP) state; this model is sharded")
        layout = {int(s): cs for s, cs in plain[ROOT]["layout"].items()}
        targets = self.adapter.restore_targets([Chunk.of(c) for cs in layout.values() for c in cs])
        everyone = [c for c, _t in targets]
        if dist.is_initialized() and self.world > 1:
            # Every rank restores from the same checkpoint here (collective): the saved
            # state is checked against the whole group's pieces, before any file is read.
            gathered = Transport.training().gather([c.as_tuple() for c in everyone])
            everyone = [Chunk.of(t) for cs in gathered for t in cs]
        files = read_shards(directory, layout, blob.get("tensors", {}).get(ROOT))
        fill_from_files(targets, files, everyone)
        self.adapter.finish_restore(plain[ROOT]["adapter"])

    # -- commit ------------------------------------------------------------------------------
    def _gather_layout(self, chunks: List[Chunk]) -> Dict[int, List[Chunk]]:
        fp = layout_fingerprint(chunks)
        if self._layout is None or fp != self._local_fp:
            # Every rank gets here at the same commit (SPMD: optimizer state appears on the
            # same step everywhere); over the training group, from the training thread.
            mine = [c.as_tuple() for c in chunks]
            everyone = Transport.training().gather(mine) if dist.is_initialized() and self.world > 1 else [mine]
            self._layout = {s: [Chunk.of(t) for t in cs] for s, cs in enumerate(everyone)}
            self._local_fp = fp
        return self._layout

    def capture(self, snap: Any, old: Optional[Any], persist: bool) -> Callable[[], None]:
        """Fill ``snap`` (tensors, plain layout, holding) with this commit's shard; returns
        ``start()``. ``snap`` is complete once this rank's own shard is copied; the peer
        copies follow in the exchange thread, which sets ``snap.done``."""

        def own_copied(error: Optional[BaseException]) -> None:
            snap.error = error
            if error is None:
                snap.complete.set()

        return self._copy(snap, old, own_copied)

    def _copy(
        self, snap: Any, old: Optional[Any], on_own_copied: Callable[[Optional[BaseException]], None]
    ) -> Callable[[], None]:
        self.wait()
        t0 = time.perf_counter()
        live = self.adapter.live_chunks()
        layout = self._gather_layout([c for c, _t in live])
        old_tree = (old.tensors.get(ROOT, {}) if old is not None else {}) or {}
        if self.lean:
            return self._copy_lean(snap, live, layout, old_tree, t0)
        pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        own_old = old_tree.get(self.rank) or [None] * len(live)
        own_old = own_old if len(own_old) == len(live) else [None] * len(live)
        own = [plan_copy(d, t, self._defer(c), pending) for (c, t), d in zip(live, own_old)]
        tree: Dict[int, List[torch.Tensor]] = {}
        for s in range(len(layout)):
            tree[s] = own if s == self.rank else [meta(c) for c in layout[s]]
        snap.tensors = {ROOT: tree}
        snap.plain[ROOT] = self._plain(layout)
        snap.holding = (len(layout), (self.rank,))
        self.blocked_s += time.perf_counter() - t0
        incoming = self._recv_buffers(layout, old_tree)

        exchanging = self._exchange is not None and bool(incoming or self._exchange.receivers())
        if exchanging:
            snap.pins += 1  # not recycled while its buffers are on the wire (pinned before it is complete)
            snap.incoming_nbytes = nbytes(incoming)

        def own_done(error: Optional[BaseException]) -> None:
            if error is not None and exchanging:
                snap.pins -= 1
                snap.incoming_nbytes = 0
            on_own_copied(error)
            if error is not None or not exchanging:
                snap.done.set()
                return
            exchange = self._exchange
            assert exchange is not None  # exchanging
            exchange.submit(lambda: self._exchange_job(snap, own, incoming, layout))

        if not pending:
            return lambda: own_done(None)
        self._pending = PendingCopy(pending, own_done)
        return self._pending.start

    def _copy_lean(
        self,
        snap: Any,
        live: List[Tuple[Chunk, torch.Tensor]],
        layout: Dict[int, List[Chunk]],
        old_tree: Dict[int, Any],
        t0: float,
    ) -> Callable[[], None]:
        """A lean commit (``lean.py``): the own shard is sent from the live state, and
        copied out of it once every peer copy landed; the next optimizer step waits."""
        # Model buffers change in the next forward: copied now (they are small).
        sources = [t.detach().to("cpu", copy=True) if _is_buffer(c) else t for c, t in live]
        snap.tensors = {ROOT: {s: [meta(c) for c in layout[s]] for s in range(len(layout))}}
        snap.plain[ROOT] = self._plain(layout)
        snap.holding = (len(layout), ())
        if self.in_place:  # the older snapshots give up the shards this rank backs up
            if self._sess.aborted:  # not for a commit no peer will pair with: keep them whole
                raise StopTraining("membership change")
            old_tree = self._store.lend_peer_shards(self._sess.run_rel, ROOT, self.rank)
        incoming = self._recv_buffers(layout, old_tree)
        snap.pins += 1  # released when the commit is over
        snap.incoming_nbytes = nbytes(incoming)
        sess = self._sess
        cuda = next((t.device for t in sources if t.is_cuda), None)
        ready = None
        if cuda is not None:  # the exchange thread's copies must follow the step that wrote them
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(cuda))
        commit = LeanCommit(
            snap,
            self.rank,
            sources,
            incoming,
            ready=ready,
            exchange=self._exchange,
            merge=self._lean_merge,
            take_older=lambda: self._store.take_older(sess.run_rel, snap),
            in_place=self.in_place,
            aborted=lambda: sess.aborted,
            stop=lambda: StopTraining("membership change"),
            root=ROOT,
        )
        snap.settle = commit.settle
        self._store.trim_lean(sess.run_rel)
        self._pending = commit
        self.blocked_s += time.perf_counter() - t0

        def start() -> None:
            if self._exchange is not None:
                self._exchange.submit(commit.run)
            else:
                COPY_THREAD.submit(commit.run)
            if not self.overlap:  # no optimizer hook to wait in: wait here
                self.wait()

        return start

    def _lean_merge(self, snap: Any, tensors: Dict[int, List[torch.Tensor]]) -> None:
        with self._store._lock:  # the same lock the worker's export/merge take
            tree = dict(snap.tensors.get(ROOT, {}))
            tree.update(tensors)
            snap.tensors = {ROOT: tree}
            snap.holding = union(snap.holding, (snap.holding[0], tuple(tensors)))
            snap.nbytes = nbytes(snap.tensors)

    def _plain(self, layout: Dict[int, List[Chunk]]) -> Dict[str, Any]:
        """What a snapshot says of its shards besides their tensors: every old rank's chunks."""
        return {
            "layout": {s: [c.as_tuple() for c in cs] for s, cs in layout.items()},
            "adapter": self.adapter.plain(),
            "world": len(layout),
        }

    def _defer(self, c: Chunk) -> Callable[[torch.Tensor], bool]:
        """Whether ``c``'s copy may wait for the optimizer step hook (buffers never do)."""
        return lambda _t: self.overlap and not _is_buffer(c)

    def _recv_buffers(self, layout: Dict[int, List[Chunk]], old_tree: Dict[int, Any]) -> Dict[int, List[torch.Tensor]]:
        out: Dict[int, List[torch.Tensor]] = {}
        if self._exchange is None:
            return out
        for s in self._exchange.sources():
            prev = old_tree.get(s) or []
            bufs = []
            for j, c in enumerate(layout[s]):
                p = prev[j] if j < len(prev) else None
                if (
                    isinstance(p, torch.Tensor)
                    and not p.is_meta
                    and tuple(p.shape) == c.sizes
                    and str(p.dtype) == c.dtype
                ):
                    bufs.append(p)
                else:
                    bufs.append(torch.empty(c.sizes, dtype=dtype_of(c.dtype)))
            out[s] = bufs
        return out

    def _exchange_job(
        self,
        snap: Any,
        own: List[torch.Tensor],
        incoming: Dict[int, List[torch.Tensor]],
        layout: Dict[int, List[Chunk]],
    ) -> None:
        try:
            assert self._exchange is not None  # a job is submitted only while exchanging
            self._exchange.exchange(own, incoming, snap.index)
            starts, pos = {}, 0
            for s in range(len(layout)):
                starts[s] = pos
                pos += len(layout[s])
            leaves = {starts[s] + j: t for s, ts in incoming.items() for j, t in enumerate(ts)}
            if incoming:
                self._merge(self._store, snap, leaves)
        except Exception as e:  # noqa: BLE001 - the snapshot keeps only the own shard
            logger.warning(
                "snapshot %s: peer copy failed (%s); it holds only rank %s's own shard", snap.index, e, self.rank
            )
        finally:
            snap.pins -= 1
            snap.incoming_nbytes = 0  # merged (counted in nbytes) or dropped
            snap.done.set()

    def _merge(self, store: Any, snap: Any, leaves: Dict[int, torch.Tensor]) -> None:
        with store._lock:  # the same lock the worker's export/merge take
            snap.tensors = map_leaves(snap.tensors, lambda j, t: leaves[j] if t.is_meta and j in leaves else t)
            snap.holding = union(snap.holding, (snap.holding[0], self.holds))
            snap.nbytes = nbytes(snap.tensors)
            snap.incoming_nbytes = 0

    def writer(self, snap: Any) -> Optional[Callable[[str], None]]:
        """Writes this rank's own shard of ``snap`` (rank 0: and the plain state)."""
        return shard_writer(snap, self.rank, ROOT, with_plain=self.rank == 0)

    def shard_bytes(self) -> Optional[int]:
        """Bytes of this rank's own shard of the state (what one snapshot copies)."""
        return sum(t.numel() * t.element_size() for _c, t in self.adapter.live_chunks())

    def close(self) -> None:
        if self._exchange is not None:
            self._exchange.close()


def _is_buffer(c: Chunk) -> bool:
    """A model buffer (BatchNorm's statistics): the forward pass writes it, not the optimizer."""
    return c.key.startswith("buffer/")


def own_shard_bytes(snap: Any, rank: int) -> int:
    tree = snap.tensors.get(ROOT, {})
    return sum(t.numel() * t.element_size() for t in tree.get(rank, []) if not t.is_meta)


def held_shard_bytes(snap: Any) -> Dict[int, int]:
    """Bytes of each rank's shard a sharded snapshot holds (its taker's own and the ones it
    backs up), by the rank at the snapshot's world size: a snapshot taken before a resize
    holds shards of that world size's size (after growing from 2 to 3 workers, 1.5x the
    new shard), so its memory is bounded by them, not by today's shard."""
    return {r: b for r in snap.tensors.get(ROOT, {}) if (b := own_shard_bytes(snap, r))}


__all__ = ["ShardedState", "own_shard_bytes", "held_shard_bytes"]
