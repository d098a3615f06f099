"""Who holds which shards of an in-memory snapshot: the torch-free half of striping.

The controller plans stripes, checks coverage and picks restore points without touching
a tensor, so it must not import torch (``stripes.py`` holds the tensor half: splitting a
state into shards, copying and assembling them). See ``stripes.py`` for why snapshots
are striped at all.

A :data:`Holding` says what one copy of a snapshot holds: ``(nshards, shards)``, or
:data:`WHOLE` for all of it. It is never None. Only in a list of several members'
holdings (``covered``) does None appear, and there it means "this member holds none of
the snapshot" (:data:`HOLDS_NONE`).
"""

from __future__ import annotations

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


__all__ = ["Holding", "WHOLE", "HOLDS_NONE", "is_whole", "plan_stripes", "covered",
           "restore_from_memory_possible"]
