"""``ElasticState``: training state that survives a node loss without a storage read.

Register what must survive (model, optimizer, LR scheduler, the elastic data loader,
plain attributes such as ``step``, any object with ``state_dict()`` / ``load_state_dict()``
given as ``stateful={"name": obj}``) and call :meth:`ElasticState.commit` once per step::

    state = raylastic.ElasticState(model=model, optimizer=opt, loader=loader, step=0)
    while state.step < total:
        ... one training step ...
        state.step += 1
        state.commit({"loss": loss.item()})     # snapshot + report (+ persist every N steps)

Constructing the state restores into the given objects, in order of preference:
1. the newest snapshot the surviving workers hold in host memory (a resize or a
   failure: no storage read; shards some member lacks, and everything for workers that
   joined, are sent from a holder over the new process group);
2. the latest committed checkpoint in storage (a fresh cluster, or a node lost together
   with the node holding the second copy of its shard);
3. nothing (a fresh start).
Attributes and ``state_dict()`` s must load back with ``torch.load(weights_only=True)``
(checked when set and at each commit; ``_internal/state_values.py``).

How, and what it costs (``raylastic/_internal/snapshots/``): replicated models (DDP) copy
a stripe of the state per rank (``striped=True``), sharded ones (FSDP2 ``fully_shard``,
DeepSpeed ZeRO 1-3 through ``engine=``) their own shard, which a peer backs up and a
restore re-partitions for the new world size. The copy overlaps the next step until its
``optimizer.step()`` (``async_snapshot=True``): do not change parameters in place other
than through the optimizer in between. A surviving rank gets its RNG streams back from
its own snapshot. Memory per mode, and ``lean_snapshots``:
``docs/recovery.md`` and ``docs/sharded.md``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Union

import torch

from raylastic import session as _session
from raylastic._internal.snapshots.capture import nbytes
from raylastic._internal.snapshots.persist import STATE_FILE, read_state
from raylastic._internal.snapshots.placement import restore_from_memory_possible
from raylastic._internal.snapshots.registry import Registry, check_stateful, engine_module, rng_state, tensor_half
from raylastic._internal.snapshots.store import STORE, Snapshot, SnapshotStore
from raylastic._internal.state_values import check_state_args, storable_attr
from raylastic.errors import SnapshotMismatchError


class ElasticState:
    """See the module docstring. ``stateful``: more objects with ``state_dict()`` /
    ``load_state_dict()``, by name; each is snapshotted, persisted and restored like the
    LR scheduler (its state dict must load back with ``weights_only=True``)."""

    def __init__(
        self,
        *,
        model: Optional[torch.nn.Module] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        lr_scheduler: Any = None,
        loader: Any = None,
        persist_every: Optional[int] = None,
        snapshot_every: int = 1,
        async_snapshot: bool = True,
        striped: bool = True,
        engine: Any = None,
        stateful: Optional[Mapping[str, Any]] = None,
        lean_snapshots: Union[bool, str] = False,
        **attrs: Any,
    ):
        check_state_args(
            persist_every=persist_every,
            snapshot_every=snapshot_every,
            async_snapshot=async_snapshot,
            striped=striped,
            lean_snapshots=lean_snapshots,
        )
        model = engine_module(engine, model, optimizer)
        extra = check_stateful(stateful)
        registry = Registry(attrs)  # (checks the attributes before a session is looked up)
        sess = _session._get_session()
        registry.add_data(sess.data)
        registry.add_object("lr_scheduler", lr_scheduler)
        registry.add_object("loader", loader)
        for name, obj in extra.items():
            registry.add_object(name, obj, label=f"ElasticState(stateful={{{name!r}: ...}})")
        object.__setattr__(self, "_registry", registry)
        object.__setattr__(self, "_attrs", registry.attrs.values)
        object.__setattr__(self, "_persist_every", persist_every)
        object.__setattr__(self, "_snapshot_every", snapshot_every)
        object.__setattr__(self, "restored_from", "none")
        object.__setattr__(self, "_sess", sess)
        object.__setattr__(
            self,
            "_half",
            tensor_half(sess, registry, model, optimizer, engine, async_snapshot, striped, lean_snapshots),
        )
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
    def _restore(self) -> None:
        sess, half = self._sess, self._half
        mem = sess.restore.memory_index
        if mem is not None:
            try:
                plain, rng = half.restore_memory(mem, STORE.get(sess.run_rel, mem))
                STORE.drop_after(sess.run_rel, mem)
                self._registry.load_plain(plain, rng)
            except ValueError as e:
                raise SnapshotMismatchError(
                    f"rank {sess.spec.rank}: in-memory snapshot {mem} does not fit: {e}"
                ) from None
            object.__setattr__(self, "restored_from", "memory")
            return
        # Snapshots newer than where this attempt resumes are a rolled-back future (and
        # must not be offered to the controller as restore points again).
        STORE.drop_after(sess.run_rel, sess.restore.index)
        ckpt = sess.get_checkpoint()
        if ckpt is None:
            return
        with ckpt.as_directory() as d:
            blob = read_state(d)
            if blob is None:
                return  # a checkpoint written by the user's own code, not by ElasticState
            half.restore_storage(d, blob)  # (sharded: the per-rank shard files, read while here)
        self._registry.load_plain(blob["plain"], {})
        object.__setattr__(self, "restored_from", "storage")

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
        sess, half = self._sess, self._half
        index = sess.current_index() + 1
        every = self._persist_every or sess.persist_every
        persist = bool(every and index % every == 0) and not sess.persist_busy()  # busy: skipped
        # A stop was asked for (a resize, a drain): replicated state is snapshotted every
        # commit from now on, whole, so the stop index is a restore point whoever leaves.
        if index % self._snapshot_every and not persist and not (half.snapshot_on_stop and sess.stop_requested):
            sess.report_snapshot(dict(metrics) if metrics is not None else dict(self._attrs), None, persist=False)
            return
        snap = Snapshot(index=index, plain=self._registry.plain(), rng=rng_state())
        start = half.capture(snap, None if half.lean else STORE.recycle(sess.run_rel), persist)
        snap.nbytes = nbytes(snap.tensors)
        STORE.add(sess.run_rel, snap, trim=not half.lean)  # listed as complete only once copied
        start()
        writer = half.writer(snap) if persist else None
        sess.report_snapshot(dict(metrics) if metrics is not None else dict(self._attrs), writer, persist=persist)

    def snapshot_bytes(self) -> int:
        """Host memory held by this process's snapshots."""
        return STORE.nbytes()

    def shard_bytes(self) -> Optional[int]:
        """Sharded models (FSDP2, ZeRO): bytes of this rank's own shard of the state (what
        one snapshot copies; ``docs/sharded.md`` bounds the snapshots' memory by it).
        None for replicated models."""
        return self._half.shard_bytes()


__all__ = ["ElasticState", "SnapshotStore", "Snapshot", "STORE", "STATE_FILE", "restore_from_memory_possible"]
