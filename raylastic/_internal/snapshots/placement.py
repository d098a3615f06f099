"""Which rank holds which shards of an in-memory snapshot: pure functions of the group.

The controller plans stripes, checks coverage and picks restore points without touching
a tensor, so this module must not import torch (``capture`` and ``replicated`` hold the
tensor side: splitting a state into shards, copying and assembling them).

Why stripes: under DDP every rank holds the same model and optimizer state, so W full
snapshots per step are W-1 copies too many; the copy costs memory bandwidth every step
and host memory. Surviving the loss of any one node needs every byte on two nodes, not on
W. So (as Gemini, SOSP'23, places checkpoint replicas) the state's tensors are split into
W shards of about equal bytes (:func:`shard_of_leaves`); rank r copies shard r and one
other rank's shard, chosen on another node (:func:`plan_stripes`). Each rank then copies
about 2/W of the state per step and holds 2/W of it per snapshot: 2/3 with 3 workers, 1/4
with 8 (with the same number of workers on every node). Sharded state (FSDP2, ZeRO) uses
the same plan for its peer copies (:func:`held_shards`).

A :data:`Holding` says what one copy of a snapshot holds: ``(nshards, shards)``, or
:data:`WHOLE` for all of it. It is never None. Only in a list of several members'
holdings (``covered``) does None appear, and there it means "this member holds none of
the snapshot" (:data:`HOLDS_NONE`).
"""

from __future__ import annotations

import functools
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

Holding = Tuple[int, Tuple[int, ...]]
"""(nshards, shards held) of a snapshot's copy; :data:`WHOLE` is a full copy."""

WHOLE: Holding = (0, ())
HOLDS_NONE = None  # in a list of members' holdings: this member holds none of it


def is_whole(holding: Holding) -> bool:
    return holding[0] == 0


def plan_stripes(nodes: Sequence[str]) -> Optional[List[Tuple[int, ...]]]:
    """Shards each rank copies, given each rank's node id (rank order). None when
    striping saves nothing (fewer than 3 ranks).

    Shard s's first copy is rank s; its second goes to the least loaded rank on another
    node (ties: the next rank after s in ring order), so losing any one node leaves a
    copy of every shard. With all ranks on one node the second copy is on another rank
    (a crashed worker process is survived; a lost node takes every copy anyway). With
    one node per rank, or the same number of ranks per node, each rank holds 2 shards;
    with uneven nodes a rank alone on its node can hold the second copy of every other
    node's shards (e.g. 7 ranks on one node and 1 on another: that one holds all 8)."""
    world = len(nodes)
    if world < 3:
        return None
    load = [1] * world
    held: List[set] = [{r} for r in range(world)]
    for s in range(world):
        others = [r for r in range(world) if r != s]
        cands = [r for r in others if nodes[r] != nodes[s]] or others
        r = min(cands, key=lambda q: (load[q], (q - s) % world))
        load[r] += 1
        held[r].add(s)
    return [tuple(sorted(h)) for h in held]


def union(a: Holding, b: Holding) -> Holding:
    """What a copy holding ``a`` holds after merging a copy holding ``b``."""
    if is_whole(a) or is_whole(b):
        return WHOLE
    return (a[0], tuple(sorted(set(a[1]) | set(b[1]))))


def covered(holdings: Sequence[Optional[Holding]]) -> bool:
    """Do these members' holdings of one snapshot (:data:`HOLDS_NONE` for a member
    holding none of it) together cover it?"""
    have = [h for h in holdings if h is not HOLDS_NONE]
    if any(is_whole(h) for h in have):
        return True
    if not have:
        return False
    nshards = have[0][0]
    return set().union(*(set(h[1]) for h in have)) >= set(range(nshards))


def restore_from_memory_possible(
    indices_per_member: Mapping[int, Sequence[int]],
    stripes_per_member: Optional[Mapping[int, Mapping[int, Holding]]] = None,
) -> Optional[int]:
    """The newest snapshot index every member that holds snapshots has and whose
    shards those members together cover. ``stripes_per_member``: member -> index ->
    holding for striped copies; an index not listed is a whole copy."""
    stripes_per_member = stripes_per_member or {}
    holders: Dict[int, set] = {m: set(v) for m, v in indices_per_member.items() if v}
    if not holders:
        return None
    for index in sorted(set.intersection(*holders.values()), reverse=True):
        if covered([stripes_per_member.get(m, {}).get(index, WHOLE) for m in holders]):
            return index
    return None


def shard_of_leaves(sizes: Sequence[int], nshards: int) -> List[int]:
    """Shard id of each tensor (by its bytes): largest first onto the lightest shard.
    Deterministic in ``sizes``, so every rank computes the same split."""
    return list(_shard_of_leaves(tuple(sizes), nshards))


@functools.lru_cache(maxsize=16)  # the same split every commit: not worth recomputing
def _shard_of_leaves(sizes: Tuple[int, ...], nshards: int) -> Tuple[int, ...]:
    load = [0] * nshards
    out = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        s = min(range(nshards), key=lambda k: (load[k], k))
        out[j] = s
        load[s] += sizes[j]
    return tuple(out)


def held_shards(world: int, stripe: Sequence[int], rank: int) -> Tuple[int, ...]:
    """Shards this rank holds of each sharded snapshot: its own, plus the ones
    ``plan_stripes`` gives it (the second copies); with 2 ranks each backs the other up."""
    if world == 1:
        return (0,)
    if world == 2:
        return (rank, 1 - rank)
    mine = set(stripe) if stripe else {rank}
    return tuple([rank] + sorted(mine - {rank}))


__all__ = [
    "Holding",
    "WHOLE",
    "HOLDS_NONE",
    "is_whole",
    "union",
    "plan_stripes",
    "covered",
    "restore_from_memory_possible",
    "shard_of_leaves",
    "held_shards",
]
