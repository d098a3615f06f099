"""``ElasticState``: training state that survives a node loss without a storage read.

Register what must survive (model, optimizer, LR scheduler, the elastic data loader,
plain attributes such as ``step``) and call :meth:`ElasticState.commit` once per step::

    state = raylastic.ElasticState(model=model, optimizer=opt, loader=loader, step=0)
    while state.step < total:
        ... one training step ...
        state.step += 1
        state.commit({"loss": loss.item()})     # snapshot + report (+ persist every N steps)

Constructing the state restores into the given objects, in order of preference:
1. the newest snapshot the surviving workers hold in host memory (a resize or a
   failure: no storage read; shards some member lacks, and everything for workers that
   joined, are broadcast from a holder over the new process group);
2. the latest committed checkpoint in storage (a fresh cluster, or a node lost together
   with the node holding the second copy of its shard);
3. nothing (a fresh start).
Attributes must load back with ``torch.load(weights_only=True)``: checked when set and at each
commit, not at a restore (numpy scalars become Python scalars; ``_internal/state_values.py``).

Why peer memory works for data parallel training: under DDP every rank holds the same
model and optimizer state, so the group's snapshots are replicas of one state. With 3 or
more workers (``striped=True``, the default) each rank copies only its stripe: 2 of W
shards, placed so that every shard has copies on two nodes (``_internal/stripes.py``).
Losing any one node leaves every shard on a survivor; each rank copies and holds 2/W of
the state per step instead of all of it. Per-rank state (RNG) comes back from the rank's
own snapshot when the rank survived.

Sharded models (FSDP2 ``fully_shard``, recognised by their DTensor parameters; DeepSpeed
ZeRO 1-3 through ``ElasticState(engine=...)``) have no replicas: each rank snapshots its
own shard and a peer copies it in the background, and a restore re-partitions the old
shards for the new world size (``_internal/sharded_state.py``, ``docs/sharded.md``).

Cost: ``commit()`` copies the state into host buffers recycled from the snapshot before
last (no allocation, no page faults). By default (``async_snapshot=True``, an optimizer
registered) the copy of parameters and optimizer state runs in a background thread (CUDA:
a side stream into pinned memory) while the next step's forward and backward run; the
optimizer's next ``step()`` waits for it (see ``_internal/snapshot_copy.py``). Contract:
between ``commit()`` and the next ``optimizer.step()``, do not change parameters in place
other than through the optimizer (or pass ``async_snapshot=False``).
Serialising and uploading a persisted snapshot happen in a background thread; rank 0
copies the whole state for a snapshot it persists, and every rank does once the group
is asked to stop (a resize or a drain: whichever ranks leave, the rest hold it all).
Memory: two snapshots per worker (2/W of the state each when striped), double-buffered
(a commit copies into the buffers of the older one), plus one more while a persisted
snapshot is being written to storage; full size for rank 0's persisted snapshots and for a
snapshot assembled on a restore, until the next commits recycle them.
"""

from __future__ import annotations

import copy
import os
import random
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from raylastic import session as _session
from raylastic.errors import SnapshotMismatchError
from raylastic._internal.snapshot_copy import StateCopier, clone_to_cpu, nbytes
from raylastic._internal.state_values import check_state_args, storable_attr, storable_plain
from raylastic._internal.holdings import HOLDS_NONE, WHOLE, Holding, is_whole, restore_from_memory_possible
from raylastic._internal import sharded as _sharded_mod
from raylastic._internal.stripes import assemble, held_leaves, leaves, map_leaves

STATE_FILE = "elastic_state.pt"


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
    pins: int = 0  # a background writer is reading the tensors: do not recycle
    # (nshards, shards) this copy holds of the replicated state (the rest are meta
    # placeholders, see ``_internal/stripes.py``); WHOLE: a full copy.
    holding: Holding = WHOLE

    def save(self, directory: str) -> None:
        """Write the restorable part (what ``ElasticState`` reads back from storage)."""
        if not is_whole(self.holding):
            raise RuntimeError(f"snapshot {self.index} holds only shards {self.holding[1]} of "
                               f"{self.holding[0]}: assemble it before writing it to storage")
        torch.save({"plain": self.plain, "tensors": self.tensors}, os.path.join(directory, STATE_FILE))


class SnapshotStore:
    """Process-wide: snapshots outlive a train function that was unwound for a resize."""

    def __init__(self, keep: int = 2):
        self._keep = keep
        self._lock = threading.Lock()
        self._snaps: List[Snapshot] = []
        self.run: Optional[str] = None

    def add(self, run: str, snap: Snapshot) -> None:
        with self._lock:
            if self.run != run:
                self._snaps, self.run = [], run
            self._snaps = [s for s in self._snaps if s.index < snap.index][-(self._keep - 1):] + [snap]

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

    def complete_indices(self, run: str) -> List[int]:
        with self._lock:
            if self.run != run:
                return []
            return [s.index for s in self._snaps if s.complete.is_set()]

    def stripes(self, run: str) -> Dict[int, Tuple[int, Tuple[int, ...]]]:
        """Complete snapshots that hold only some shards: index -> (nshards, shards)."""
        with self._lock:
            if self.run != run:
                return {}
            return {s.index: s.holding for s in self._snaps if s.complete.is_set() and not is_whole(s.holding)}

    def merge(self, run: str, index: int, holding: Holding, tensors: Dict[int, torch.Tensor]) -> Holding:
        """Fill snapshot ``index``'s placeholders with another copy's tensors (by leaf
        position); returns what it holds now (WHOLE: all of it)."""
        with self._lock:
            snap = next((s for s in self._snaps if self.run == run and s.index == index
                         and s.complete.is_set()), None)
            if snap is None:
                raise RuntimeError(f"no complete in-memory snapshot {index} to merge into")
            snap.tensors = map_leaves(snap.tensors, lambda j, t: tensors[j] if t.is_meta and j in tensors else t)
            if not any(t.is_meta for t in leaves(snap.tensors)):
                snap.holding = WHOLE
            elif not is_whole(snap.holding) and not is_whole(holding):
                snap.holding = (snap.holding[0], tuple(sorted(set(snap.holding[1]) | set(holding[1]))))
            snap.nbytes = nbytes(snap.tensors)
            return snap.holding

    def get(self, run: str, index: int) -> Optional[Snapshot]:
        with self._lock:
            if self.run != run:
                return None
            for s in self._snaps:
                if s.index == index and s.complete.is_set():
                    return s
        return None

    def drop_after(self, run: str, index: int) -> None:
        """Forget snapshots newer than the restore point (a rolled-back future)."""
        with self._lock:
            if self.run == run:
                self._snaps = [s for s in self._snaps if s.index <= index]

    def wait_pending(self, timeout_s: float = 30.0) -> None:
        """Let in-flight tensor copies finish (a stopping worker's last snapshot)."""
        with self._lock:
            snaps = list(self._snaps)
        for snap in snaps:
            snap.done.wait(timeout_s)

    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes for s in self._snaps)


STORE = SnapshotStore()


class ElasticState:
    """See the module docstring."""

    _TENSOR_OBJECTS = ("model", "optimizer")
    _PLAIN_OBJECTS = ("lr_scheduler", "loader")

    def __init__(self, *, model: Optional[torch.nn.Module] = None,
                 optimizer: Optional[torch.optim.Optimizer] = None, lr_scheduler: Any = None,
                 loader: Any = None, persist_every: Optional[int] = None, snapshot_every: int = 1,
                 async_snapshot: bool = True, striped: bool = True, engine: Any = None, **attrs: Any):
        check_state_args(persist_every=persist_every, snapshot_every=snapshot_every,
                         async_snapshot=async_snapshot, striped=striped)
        if engine is not None:  # DeepSpeed: the engine owns the module and the (ZeRO) optimizer
            if model is not None or optimizer is not None:
                raise ValueError("ElasticState(engine=...) takes the DeepSpeed engine instead of model= and "
                                 "optimizer=: pass engine= alone")
            model = getattr(engine, "module", None)
            if model is None:
                raise ValueError(f"ElasticState(engine={type(engine).__name__}) is not a DeepSpeed engine "
                                 "(no .module): pass the engine deepspeed.initialize() returned")
        object.__setattr__(self, "_objs", {k: v for k, v in {
            "model": model, "optimizer": optimizer, "lr_scheduler": lr_scheduler, "loader": loader,
        }.items() if v is not None})
        object.__setattr__(self, "_attrs", {k: storable_attr(k, v) for k, v in attrs.items()})
        object.__setattr__(self, "_persist_every", persist_every)
        object.__setattr__(self, "_snapshot_every", snapshot_every)
        object.__setattr__(self, "_striped", striped)
        object.__setattr__(self, "restored_from", "none")
        sess = _session._get_session()
        object.__setattr__(self, "_sess", sess)
        # Overlapping the copy with the next step needs a point where it must be over:
        # the registered optimizer's next step(). Without an optimizer, copies are synchronous.
        object.__setattr__(self, "_sharded", self._sharded_state(model, optimizer, engine, async_snapshot))
        if self._sharded is not None:
            self._objs.pop("model", None)
            self._objs.pop("optimizer", None)
            object.__setattr__(self, "_copier", StateCopier(None, None, overlap=False))
            if self._sharded.overlap:
                self._sharded.adapter.optimizer.register_step_pre_hook(lambda _o, _a, _k: self._sharded.wait())
        else:
            object.__setattr__(self, "_copier", StateCopier(model, optimizer, overlap=async_snapshot))
        self._restore()

    # -- plain attributes ----------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        attrs = object.__getattribute__(self, "_attrs")
        if name in attrs:
            return attrs[name]
        raise AttributeError(f"ElasticState has no attribute {name!r}; register it: ElasticState(..., {name}=...)")

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._attrs:
            self._attrs[name] = storable_attr(name, value)
        else:
            object.__setattr__(self, name, value)

    # -- restore -------------------------------------------------------------------
    def _sharded_state(self, model, optimizer, engine, overlap: bool):
        """The sharded-state half (FSDP2 or DeepSpeed), or None for replicated models."""
        adapter: _sharded_mod.ShardedAdapter
        if engine is not None:
            from raylastic._internal.sharded_deepspeed import DeepSpeedAdapter
            adapter = DeepSpeedAdapter(engine)
            optimizer = adapter.optimizer  # the torch optimizer inside ZeRO's (it has step hooks)
        elif _sharded_mod.uses_dtensors(model):
            adapter = _sharded_mod.FSDP2Adapter(model, optimizer)
        else:
            return None
        from raylastic._internal.sharded_state import ShardedSnapshots
        spec = self._sess.spec
        return ShardedSnapshots(adapter, store=STORE, state_file=STATE_FILE, rank=spec.rank, world=spec.world_size, stripe=tuple(spec.stripe),
                                timeout_s=spec.timeout_s, overlap=bool(overlap and optimizer is not None
                                                                      and hasattr(optimizer, "register_step_pre_hook")))

    def _restore(self) -> None:
        sess = self._sess
        mem = sess.restore.memory_index
        if mem is not None:
            try:
                self._restore_memory(mem)
            except ValueError as e:
                raise SnapshotMismatchError(
                    f"rank {sess.spec.rank}: in-memory snapshot {mem} does not fit: {e}") from None
            object.__setattr__(self, "restored_from", "memory")
            return
        # Snapshots newer than where this attempt resumes are a rolled-back future (and
        # must not be offered to the controller as restore points again).
        STORE.drop_after(sess.run_rel, sess.restore.index)
        ckpt = sess.get_checkpoint()
        if ckpt is None:
            return
        with ckpt.as_directory() as d:
            path = os.path.join(d, STATE_FILE)
            if not os.path.exists(path):
                return  # a checkpoint written by the user's own code, not by ElasticState
            blob = torch.load(path, weights_only=True)
            if self._sharded is not None:  # the per-rank shard files, read while here
                try:
                    self._sharded.restore_storage(d, blob)
                except ValueError as e:
                    raise ValueError(f"rank {sess.spec.rank}: checkpoint {sess.restore.checkpoint_rel} does not "
                                     f"fit this model: {e}. Nothing was loaded; start a new run (another "
                                     "RunConfig.name) or restore the matching model") from None
        if self._sharded is not None:
            self._load_plain(blob["plain"], {})
        else:
            self._load(blob["plain"], blob["tensors"], {})
        object.__setattr__(self, "restored_from", "storage")

    def _restore_memory(self, mem: int) -> None:
        """Load in-memory snapshot ``mem``: sharded state is re-partitioned for this group
        from the members' shards; replicated state is assembled (shards some rank lacks
        are broadcast from a holder). ValueError: it does not fit."""
        sess = self._sess
        snap = STORE.get(sess.run_rel, mem)
        if self._sharded is not None:
            plain = self._sharded.restore_memory(snap)
            STORE.drop_after(sess.run_rel, mem)
            self._load_plain(plain, snap.rng if snap is not None else {})  # a survivor keeps its RNG streams
            return
        if sess.restore.broadcast and dist.is_initialized() and dist.get_world_size() > 1:
            snap = self._assemble(mem, snap)
        if snap is None or not is_whole(snap.holding):
            raise RuntimeError(
                f"rank {sess.spec.rank}: the in-memory snapshot {mem} the controller chose "
                "is not here in full (and no broadcast was planned)")
        STORE.drop_after(sess.run_rel, mem)
        self._load(snap.plain, snap.tensors, snap.rng)

    def _assemble(self, index: int, snap: Optional[Snapshot]) -> Snapshot:
        """Every rank gets all of snapshot ``index``: shards (or all of it) that some
        rank lacks are broadcast from a holder. Workers that joined hold nothing; they
        keep their own RNG streams. This rank's snapshot is completed in place."""
        tensors, plain = assemble(index, snap.tensors if snap else None, snap.plain if snap else None,
                                  snap.holding if snap else HOLDS_NONE)
        if snap is not None:
            # in place (a writer's pins stay on it): the assembled tensors fill the placeholders
            STORE.merge(self._sess.run_rel, index, WHOLE, held_leaves(tensors))
            return snap
        full = Snapshot(index=index, plain=plain, tensors=tensors, rng={})
        full.complete.set()
        full.done.set()
        return full

    def _load(self, plain: Dict[str, Any], tensors: Dict[str, Any], rng: Dict[str, Any]) -> None:
        want = set(self._objs) & set(self._TENSOR_OBJECTS)
        missing = want - set(tensors)
        if missing:
            raise ValueError(f"the saved state has no {sorted(missing)}: it was saved by an "
                             "ElasticState with other objects registered")
        for name in want:
            try:
                self._objs[name].load_state_dict(clone_to_cpu(tensors[name]))
            except (RuntimeError, ValueError, KeyError) as e:
                raise ValueError(f"cannot restore {name}: the saved state does not fit it "
                                 f"(different model shape or optimizer?): {e}") from None
        self._load_plain(plain, rng)

    def _load_plain(self, plain: Dict[str, Any], rng: Dict[str, Any]) -> None:
        for name in set(self._objs) & set(self._PLAIN_OBJECTS):
            if name in plain.get("_objects", {}):
                self._objs[name].load_state_dict(copy.deepcopy(plain["_objects"][name]))
        self._attrs.update(copy.deepcopy(plain.get("attrs", {})))
        if plain.get("datasets") is not None and self._sess.data is not None:
            self._sess.data.restore_positions(plain["datasets"])  # Ray Data positions (ray_data.py)
        if rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])

    # -- commit --------------------------------------------------------------------
    def commit(self, metrics: Optional[Dict[str, Any]] = None) -> None:
        """Snapshot this step's state and report ``metrics`` (default ``attrs``).

        The copy starts now, into recycled buffers, and (``async_snapshot``) overlaps the
        next step until its ``optimizer.step()``; with ``snapshot_every=k`` only every
        k-th commit copies (an unannounced loss then redoes up to k steps, for 1/k of the
        copy cost). Every ``persist_every`` commits (or
        ``CheckpointConfig.persist_every``), rank 0 also writes the snapshot to storage,
        off the training path.
        """
        sess = self._sess
        index = sess.current_index() + 1
        every = self._persist_every or sess.persist_every
        persist = bool(every and index % every == 0) and not sess.persist_busy()  # busy: skipped
        # A stop was asked for (a resize, a drain): snapshot every commit from now on,
        # whole (see _holding), so the stop index is a restore point whoever leaves.
        # (Sharded state: every rank must take the same snapshots, their peer copies pair up.)
        if index % self._snapshot_every and not persist and (self._sharded is not None or not sess.stop_requested):
            sess.report_snapshot(dict(metrics) if metrics is not None else dict(self._attrs), None, persist=False)
            return
        plain = storable_plain({"attrs": copy.deepcopy(self._attrs),  # (a list attribute may have grown)
                                "_objects": {k: copy.deepcopy(o.state_dict()) for k, o in self._objs.items()
                                             if k in self._PLAIN_OBJECTS}})
        if sess.data is not None:  # the split datasets' positions ride with the snapshot
            plain["datasets"] = sess.data.positions()
        snap = Snapshot(index=index, plain=plain,
                        rng={"torch": torch.get_rng_state(), "python": random.getstate()})
        old = STORE.recycle(sess.run_rel)
        holding = self._holding(persist)

        def finished(error: Optional[BaseException]) -> None:
            snap.error = error
            if error is None:
                snap.complete.set()
            snap.done.set()

        if self._sharded is not None:
            def own_copied(error: Optional[BaseException]) -> None:
                snap.error = error
                if error is None:
                    snap.complete.set()
            start = self._sharded.copy(snap, old, own_copied)
        else:
            snap.holding = holding
            snap.tensors, start = self._copier.copy(old.tensors if old is not None else None, finished, holding)
        snap.nbytes = nbytes(snap.tensors)
        STORE.add(sess.run_rel, snap)  # listed as complete only once finished()
        start()
        if self._sharded is not None:  # every rank writes its own shard
            writer = self._sharded.writer(snap, with_plain=sess.spec.rank == 0) if persist else None
        else:
            writer = self._writer(snap) if persist and sess.spec.rank == 0 else None
        sess.report_snapshot(dict(metrics) if metrics is not None else dict(self._attrs), writer,
                             persist=persist)

    def _holding(self, persist: bool) -> Holding:
        """This commit's share of the state: the rank's stripe, or all of it when rank 0
        writes this snapshot to storage, or when the group is stopping (a drain or a
        resize: a full copy on every rank, whichever ranks leave)."""
        sess = self._sess
        if not self._striped or not sess.spec.stripe or (persist and sess.spec.rank == 0) \
                or sess.stop_requested:
            return WHOLE
        return (sess.spec.world_size, tuple(sess.spec.stripe))

    @staticmethod
    def _writer(snap: Snapshot):
        """Serialises ``snap`` for a persisted checkpoint, in the upload thread."""
        snap.pins += 1  # released once written: the buffers must not be recycled meanwhile

        def write(directory: str) -> None:
            try:
                snap.done.wait()
                if snap.error is not None:
                    raise RuntimeError(f"snapshot {snap.index} was not copied: {snap.error}")
                snap.save(directory)
            finally:
                snap.pins -= 1

        return write

    def snapshot_bytes(self) -> int:
        """Host memory held by this process's snapshots."""
        return STORE.nbytes()

    def shard_bytes(self) -> Optional[int]:
        """Sharded models (FSDP2, ZeRO): bytes of this rank's own shard of the state (what
        one snapshot copies; ``docs/sharded.md`` bounds the snapshots' memory by it).
        None for replicated models."""
        if self._sharded is None:
            return None
        return sum(t.numel() * t.element_size() for _c, t in self._sharded.adapter.live_chunks())


__all__ = ["ElasticState", "SnapshotStore", "STORE", "STATE_FILE", "restore_from_memory_possible"]
