"""Replicated training state (DDP, or one process): the half of ``ElasticState`` where
every rank holds the whole model and optimizer state.

Why striped copies: the group's snapshots are replicas of one state, so each rank copies
only its stripe (``placement.plan_stripes``: 2 of W shards, every shard on two nodes), as
``meta`` placeholders for the rest (shape and dtype, no memory), so every rank's copy has
the full structure. Rank 0 copies the whole state for a snapshot it persists, and every
rank does once the group is asked to stop (a resize or a drain: whichever ranks leave,
the rest hold it all).

Restoring (:func:`assemble`): the members of the new group tell each other which shards
of the chosen snapshot they hold, and every tensor some member lacks is broadcast from
the lowest rank that holds it. Workers that joined hold nothing and receive everything.
Losing a node *and* the node holding its shard's second copy leaves a shard uncovered:
the controller then restores from storage (``placement.covered`` decides).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from raylastic._internal.snapshots.capture import (
    StateCopier,
    clone_to_cpu,
    fingerprint,
    held_leaves,
    keep_mask,
    leaves,
    map_leaves,
    to_meta,
)
from raylastic._internal.snapshots.persist import whole_writer
from raylastic._internal.snapshots.placement import HOLDS_NONE, WHOLE, Holding, covered, is_whole
from raylastic._internal.snapshots.store import STORE, Snapshot
from raylastic._internal.snapshots.transport import Transport


class ReplicatedState:
    """The replicated half of one ``ElasticState`` (``registry.Half``): the registry's
    tensor contributors (model, optimizer), copied by a :class:`StateCopier`."""

    snapshot_on_stop = True  # a stopping group snapshots every commit, whole on every rank
    lean = False  # two snapshots, the oldest recycled

    def __init__(self, tensors: Dict[str, Any], sess: Any, *, striped: bool, overlap: bool):
        self._objs = tensors
        self._sess = sess
        self._striped = striped
        self.copier = StateCopier(tensors.get("model"), tensors.get("optimizer"), overlap=overlap)

    # -- commit --------------------------------------------------------------------------------
    def capture(self, snap: Snapshot, old: Optional[Snapshot], persist: bool) -> Callable[[], None]:
        def finished(error: Optional[BaseException]) -> None:
            snap.error = error
            if error is None:
                snap.complete.set()
            snap.done.set()

        snap.holding = self._holding(persist)
        snap.tensors, start = self.copier.copy(old.tensors if old is not None else None, finished, snap.holding)
        return start

    def _holding(self, persist: bool) -> Holding:
        """This commit's share of the state: the rank's stripe, or all of it when rank 0
        writes this snapshot to storage, or when the group is stopping (a drain or a
        resize: a full copy on every rank, whichever ranks leave)."""
        sess = self._sess
        if not self._striped or not sess.spec.stripe or (persist and sess.spec.rank == 0) or sess.stop_requested:
            return WHOLE
        return (sess.spec.world_size, tuple(sess.spec.stripe))

    def writer(self, snap: Snapshot) -> Optional[Callable[[str], None]]:
        return whole_writer(snap) if self._sess.spec.rank == 0 else None  # rank 0 holds it whole

    def shard_bytes(self) -> Optional[int]:
        return None

    # -- restore -------------------------------------------------------------------------------
    def restore_memory(self, index: int, snap: Optional[Snapshot]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Load snapshot ``index``, assembled first when the controller planned a broadcast
        (shards some rank lacks come from a holder)."""
        sess = self._sess
        if sess.restore.broadcast and dist.is_initialized() and dist.get_world_size() > 1:
            snap = self._assemble(index, snap)
        if snap is None or not is_whole(snap.holding):
            raise RuntimeError(
                f"rank {sess.spec.rank}: the in-memory snapshot {index} the controller chose "
                "is not here in full (and no broadcast was planned)"
            )
        self._load(snap.tensors)
        return snap.plain, snap.rng

    def restore_storage(self, directory: str, blob: Dict[str, Any]) -> None:
        self._load(blob["tensors"])

    def _assemble(self, index: int, snap: Optional[Snapshot]) -> Snapshot:
        """Every rank gets all of snapshot ``index``: shards (or all of it) that some
        rank lacks are broadcast from a holder. Workers that joined hold nothing; they
        keep their own RNG streams. This rank's snapshot is completed in place."""
        tensors, plain = assemble(
            index, snap.tensors if snap else None, snap.plain if snap else None, snap.holding if snap else HOLDS_NONE
        )
        if snap is not None:
            # in place (a writer's pins stay on it): the assembled tensors fill the placeholders
            STORE.merge(self._sess.run_rel, index, WHOLE, held_leaves(tensors))
            return snap
        full = Snapshot(index=index, plain=plain, tensors=tensors, rng={})
        full.complete.set()
        full.done.set()
        return full

    def _load(self, tensors: Dict[str, Any]) -> None:
        missing = set(self._objs) - set(tensors)
        if missing:
            raise ValueError(
                f"the saved state has no {sorted(missing)}: it was saved by an "
                "ElasticState with other objects registered"
            )
        for name, obj in self._objs.items():
            try:
                obj.load_state_dict(clone_to_cpu(tensors[name]))
            except (RuntimeError, ValueError, KeyError) as e:
                raise ValueError(
                    f"cannot restore {name}: the saved state does not fit it (different model shape or optimizer?): {e}"
                ) from None


def assemble(
    index: int, tensors: Optional[Any], plain: Optional[Dict[str, Any]], holding: Optional[Holding]
) -> Tuple[Any, Dict[str, Any]]:
    """Collective over the default process group: every rank ends with all tensors of
    snapshot ``index``. ``tensors``/``plain``: this rank's copy (None when it holds
    none); ``holding``: which shards it holds (``WHOLE`` for a full copy). Returns
    (full tensors, plain state)."""
    tr = Transport.training()
    world, rank = tr.world, tr.rank
    mine = holding if tensors is not None else HOLDS_NONE
    # Every check below is made on the same gathered facts by every rank, so all raise
    # together (none is left waiting in a broadcast for a rank that gave up).
    # per rank: [what it holds, its tree's fingerprint]
    everyone = tr.gather([mine, fingerprint(tensors) if tensors is not None else None])
    holdings: List[Optional[Holding]] = [h for h, _fp in everyone]
    problem = None
    if len({fp for h, fp in everyone if h is not HOLDS_NONE}) > 1:
        problem = "the ranks' copies differ in tensor shapes or dtypes (not copies of one replicated state)"
    elif not covered(holdings):
        problem = f"the ranks' shards {holdings} do not cover the state"
    if problem is not None:
        tr.barrier()  # no rank tears the group down while another still reads the gather
        raise RuntimeError(f"snapshot {index}: {problem}")
    ref = min(r for r, h in enumerate(holdings) if h is not HOLDS_NONE)
    shared = tr.share({"plain": plain, "skeleton": to_meta(tensors)} if rank == ref else None, ref)
    skeleton = shared["skeleton"]
    masks = [None if h is HOLDS_NONE else (keep_mask(skeleton, h) or [True] * len(leaves(skeleton))) for h in holdings]
    own = leaves(tensors) if tensors is not None else None

    def fill(j: int, meta: torch.Tensor) -> torch.Tensor:
        holders = [r for r, m in enumerate(masks) if m is not None and m[j]]
        mine = masks[rank]
        if mine is not None and mine[j]:
            assert own is not None  # a rank that holds leaf j has its tensors
            if len(holders) == world:
                return own[j]
            return tr.broadcast(own[j], meta, holders[0])
        return tr.broadcast(None, meta, holders[0])

    full = map_leaves(skeleton, fill)
    return full, (plain if plain is not None else shared["plain"])


__all__ = ["ReplicatedState", "assemble"]
