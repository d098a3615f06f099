"""The restore plan: from what every member holds, where the next group restores from, and
what must move before workers leave. Pure: no Ray, no torch, no events.

Why pure: these are the decisions a node loss hinges on (memory or storage, which
snapshot, who receives a leaving worker's shards), and they are made from plain facts
the controller already has (each member's complete snapshots and the holdings of its
striped copies), so they are unit-tested without a cluster. The controller's
``controller/memory_restore.py`` runs the plan: it makes the actor calls and writes the
events.

A member here is anything with ``wid``, ``snapshots`` (complete snapshot indices),
``stripes`` (index -> holding of its striped copies) and ``holding(index)``: the
worker group's ``WorkerHandle``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from raylastic._internal.protocol import RestoreInfo
from raylastic._internal.snapshots.placement import (
    Holding,
    covered,
    is_whole,
    restore_from_memory_possible,
    union,
)


def plan_restore(members: Sequence[Any], restart_count: int, latest: Optional[Any], skip_memory: bool) -> RestoreInfo:
    """Newest state every member can get: an in-memory snapshot all snapshot holders
    share and whose shards they cover together (holders send what others lack), else
    ``latest``, the last valid committed checkpoint in storage. ``skip_memory``: the last
    in-memory snapshot did not fit the train function's objects."""
    mem = (
        None
        if skip_memory
        else restore_from_memory_possible({m.wid: m.snapshots for m in members}, {m.wid: m.stripes for m in members})
    )
    if mem is not None and (latest is None or mem >= latest.index):
        return RestoreInfo(
            checkpoint_rel=latest.rel if latest else None,
            index=mem,
            restart_count=restart_count,
            memory_index=mem,
            broadcast=any(mem not in m.snapshots or mem in m.stripes for m in members),
        )
    return RestoreInfo(
        checkpoint_rel=latest.rel if latest else None, index=latest.index if latest else 0, restart_count=restart_count
    )


def why_storage(members: Sequence[Any], latest: Optional[Any]) -> Optional[Tuple[str, Optional[int]]]:
    """Members held in-memory snapshots, yet the group restores from storage: (why, the
    newest snapshot they share), or None when nothing was lost by it."""
    holders = [m for m in members if m.snapshots]
    if not holders:
        return None
    common = set.intersection(*(set(m.snapshots) for m in holders))
    newest = max(common, default=None)
    if newest is not None and (latest is None or newest > latest.index):
        return (
            f"the surviving workers' shards of snapshot {newest} do not cover the state "
            "(a node and the node holding the second copy of its shard were both lost, or, with "
            "lean_snapshots='in_place', a node was lost while the new copy of its shard was arriving)"
        ), newest
    if newest is None:
        return "the surviving workers share no in-memory snapshot", None
    return None  # the checkpoint in storage is as new as memory: nothing lost


def evacuation(members: Sequence[Any], leaving: Sequence[Any], index: int) -> Optional[Tuple[Any, List[Any]]]:
    """(target, holders) when leaving members hold shards of snapshot ``index`` that the
    staying ones lack: the target receives the holders' shards (a staying holder, or a
    leaving one that then writes it to storage). None: nothing to move."""
    staying = [m for m in members if m not in leaving]
    holders = [m for m in members if index in m.snapshots]
    stay_holders = [m for m in holders if m in staying]
    if not leaving or not holders or (stay_holders and covered([m.holding(index) for m in stay_holders])):
        return None
    return (stay_holders or holders)[0], holders


def adds_shards(theirs: Holding, have: Holding) -> bool:
    """Does a copy holding ``theirs`` hold shards a copy holding ``have`` lacks?"""
    return not (is_whole(have) or (not is_whole(theirs) and set(theirs[1]) <= set(have[1])))


def rescue_target(hung: Any, stopped: Sequence[Any]) -> Optional[Tuple[int, Any]]:
    """(snapshot index, stopped member) to move a hung worker's shards to: the newest
    snapshot the stopped members cover once that member has the hung worker's shards,
    if it is newer than what they cover already. None: moving adds nothing.

    Why not simply the newest snapshot they share: a sharded snapshot counts as complete
    once a rank's own shard is copied, while its peer copies still travel. When the node
    is lost mid-exchange, the newest snapshot may lack the lost rank's shard everywhere,
    and moving its shards still leaves it uncovered, while the previous snapshot, the
    one the restore can use, stayed split between the hung worker and the others (a
    ZeRO-2 run then restarted from the beginning)."""

    def covers_after(index: int, to: Any) -> bool:
        snapshots = {m.wid: m.snapshots for m in stopped}
        stripes = {m.wid: dict(m.stripes) for m in stopped}
        merged = union(to.holding(index), hung.holding(index))
        if is_whole(merged):
            stripes[to.wid].pop(index, None)
        else:
            stripes[to.wid][index] = merged
        return restore_from_memory_possible(snapshots, stripes) == index

    now = restore_from_memory_possible({m.wid: m.snapshots for m in stopped}, {m.wid: m.stripes for m in stopped})
    for index in sorted(set(hung.snapshots), reverse=True):
        if now is not None and index <= now:
            return None
        for m in stopped:
            if index in m.snapshots and adds_shards(hung.holding(index), m.holding(index)) and covers_after(index, m):
                return index, m
    return None


__all__ = ["plan_restore", "why_storage", "evacuation", "adds_shards", "rescue_target"]
