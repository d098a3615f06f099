"""``ElasticState``: training state that survives a node loss without a storage read.

Register what must survive (model, optimizer, LR scheduler, the elastic data loader,
plain attributes such as ``step``, ``stateful={"name": obj}``) and commit once per step::

    state = raylastic.ElasticState(model=model, optimizer=opt, loader=loader, step=0)
    while state.step < total:
        ... one training step ...
        state.step += 1
        state.commit({"loss": loss.item()})     # snapshot + report (+ persist every N steps)

Constructing it restores, in order of preference, the newest snapshot the surviving
workers hold in host memory (no storage read), the latest checkpoint in storage, or
nothing. This class is the facade; the snapshots themselves live in
``raylastic/_internal/snapshots/``. The contract (what is saved, the async copy's rule,
memory per mode, limits): ``docs/recovery.md`` and ``docs/sharded.md``.
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
        registry.add_objects({"lr_scheduler": lr_scheduler, "loader": loader}, extra)
        half = tensor_half(sess, registry, model, optimizer, engine, async_snapshot, striped, lean_snapshots)
        # (through __dict__: __setattr__ is for the registered attributes)
        self.__dict__.update(_registry=registry, _attrs=registry.attrs.values, _sess=sess, _half=half)
        self.__dict__.update(_persist_every=persist_every, _snapshot_every=snapshot_every, restored_from="none")
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
            self.__dict__["restored_from"] = "memory"
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
        self.__dict__["restored_from"] = "storage"

    # -- commit --------------------------------------------------------------------
    def commit(self, metrics: Optional[Dict[str, Any]] = None) -> None:
        """Snapshot this step's state and report ``metrics`` (default ``attrs``).

        The copy goes into recycled buffers and overlaps the next step until its
        ``optimizer.step()``; ``snapshot_every=k`` copies every k-th commit only, and every
        ``persist_every``-th one rank 0 also writes to storage, off the training path.
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
