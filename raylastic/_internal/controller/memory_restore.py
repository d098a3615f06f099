"""Restoring from peer memory, the controller's side: runs the restore plan and keeps
in-memory snapshots alive while workers leave.

``ElasticState`` snapshots live in the workers' processes (striped: each rank holds
some shards of each, see ``_internal/snapshots/``). The plan (memory or storage, what
must move before workers leave) is made by ``snapshots/planner.py`` from what every
member holds; this module says why in the event log when memory was not enough, and
before workers leave (a drain, a migration, a hung worker being replaced) moves the
shards only they hold to a worker that stays, over Ray, or writes the snapshot to storage
when nobody stays.

Why it stays here rather than in ``snapshots/``: it drives the worker group, the
checkpoint manager and the event log, which the snapshot package must not depend on (the
worker imports that package). The worker group (``WorkerGroup``) makes the actor calls.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

from raylastic._internal.snapshots.placement import covered, is_whole
from raylastic._internal.snapshots.planner import adds_shards, evacuation, plan_restore, rescue_target, why_storage
from raylastic._internal.worker_group.group import Interrupted, WorkerGroup
from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic.checkpoint.manager import CheckpointManager, CommittedCheckpoint
from raylastic.events import EventKind, EventLog
from raylastic._internal.protocol import RestoreInfo

logger = logging.getLogger("raylastic")


class MemoryRestore:
    def __init__(self, group: WorkerGroup, ckpt: CheckpointManager, events: EventLog):
        self._group = group
        self._ckpt = ckpt
        self._events = events
        # Set when an in-memory snapshot did not fit the train function's objects: the
        # next group restores from storage (and the members drop the newer snapshots).
        self.skip_next = False

    def mark_unusable(self, index: int, epoch: int, reason: str) -> None:
        """In-memory snapshot ``index`` does not fit the train function's objects (ranks
        raised ``SnapshotMismatchError``): say so; the next group restores from storage."""
        latest = self._ckpt.latest_valid()
        self._events.emit(
            EventKind.CHECKPOINT_INVALID,
            f"in-memory snapshot {index} is unusable ({reason}); falling back to "
            + (f"committed checkpoint {latest.index}" if latest else "a fresh start (nothing committed)"),
            source="memory",
            index=index,
            epoch=epoch,
            reason=reason,
            fallback_index=latest.index if latest else None,
        )
        self.skip_next = True

    # -- planning ------------------------------------------------------------------------
    def refresh(self, members: Sequence[WorkerHandle]) -> None:
        """Ask the members that hold snapshots what they hold now, just before planning.
        Why: the view from their last poll can predate the end of the newest snapshot's
        peer copy (it runs in the background after the commit), so a node lost a moment
        later made the plan pick the snapshot before it, one step to redo, although the
        survivors' copies covered the newest (seen in a 51.6M ZeRO-3 run). A member that
        does not answer keeps its last view."""
        holders = [m for m in members if m.snapshots]
        if not holders:
            return
        try:
            self._group.refresh_holdings(holders)
        except Exception as e:  # noqa: BLE001 - the last polled view is still a valid plan input
            logger.debug("snapshot holdings not refreshed before the restore plan: %s", e)

    def plan(
        self, members: Sequence[WorkerHandle], restart_count: int, latest: Optional[CommittedCheckpoint]
    ) -> RestoreInfo:
        """Newest state every member can get: an in-memory snapshot all snapshot holders
        share and whose shards they cover together (holders send what others lack), else
        ``latest``, the last valid committed checkpoint in storage."""
        return plan_restore(members, restart_count, latest, self.skip_next)

    def record(
        self, epoch: int, members: Sequence[WorkerHandle], restore: RestoreInfo, latest: Optional[CommittedCheckpoint]
    ) -> None:
        """Say where the group of ``epoch`` restores from (and, when it is storage although
        members held snapshots, why). The members then drop the snapshots newer than
        ``restore.index`` (the controller then clears ``skip_next``)."""
        if restore.memory_index is not None:
            self._events.emit(
                EventKind.CHECKPOINT_RESTORED,
                epoch=epoch,
                index=restore.index,
                source="memory",
                broadcast=restore.broadcast,
                striped=any(restore.index in m.stripes for m in members),
            )
        else:
            self._explain_storage_restore(members, latest)
            if latest:
                self._events.emit(
                    EventKind.CHECKPOINT_RESTORED, epoch=epoch, index=latest.index, path=latest.rel, source="storage"
                )

    def _explain_storage_restore(self, members: Sequence[WorkerHandle], latest: Optional[CommittedCheckpoint]) -> None:
        """Members held in-memory snapshots, yet the group restores from storage: say why
        in the event log (a node and its snapshot peer lost, or no shared snapshot)."""
        reason = None if self.skip_next else why_storage(members, latest)
        if reason is None:
            return
        why, newest = reason
        self._events.emit(
            EventKind.DECISION,
            f"{why}; restoring from " + (f"checkpoint {latest.index} in storage" if latest else "the start"),
            decision="memory_restore_impossible",
            snapshot_index=newest,
            fallback_index=latest.index if latest else 0,
        )

    # -- keeping snapshots while workers leave ---------------------------------------------
    def evacuate(
        self, members: Sequence[WorkerHandle], leaving: Sequence[WorkerHandle], index: int, epoch: int
    ) -> None:
        """Keep snapshot ``index`` when leaving members hold shards of it the staying ones
        lack: their shards move to a staying holder, or, when every holder is leaving
        (all members were on draining nodes), the snapshot is assembled on one of them
        and written to storage before they go, so the next group loses nothing. (A stop
        normally makes every rank take a full copy; this covers the rest.)"""
        plan = evacuation(members, leaving, index)
        if plan is None:
            return
        target, holders = plan
        staying = [m for m in members if m not in leaving]
        try:
            if not self._gather(target, holders, index):
                return
            if target in staying:
                self._events.emit(
                    EventKind.DECISION,
                    f"moved the leaving workers' shards of snapshot "
                    f"{index} to rank {target.prev_rank} before their nodes go",
                    decision="evacuate",
                    index=index,
                    to_rank=target.prev_rank,
                )
                return
            out = self._group.persist_snapshot(target, index, epoch)
            if self._ckpt.commit_evacuation(index, out.rel, out.files, out.upload_s) is None:
                logger.warning(
                    "snapshot %s was persisted to %s but not committed (not a checkpoint directory of this run)",
                    index,
                    out.rel,
                )
                return
            self._events.emit(
                EventKind.DECISION,
                f"no remaining worker holds snapshot {index}: persisted it to storage before the node goes",
                decision="evacuate",
                index=index,
                upload_s=round(out.upload_s, 3),
            )
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001 - fall back to the last committed checkpoint
            logger.warning("could not move or persist snapshot %s before evacuation: %s", index, e)

    def rescue(self, hung: WorkerHandle, stopped: List[WorkerHandle]) -> None:
        """A worker about to be replaced (its train thread stuck in a collective) still
        answers calls, and its snapshots are intact (no optimizer step ran since): move
        the shards the stopped workers lack to one of them, so replacing it does not turn
        a memory restore into a storage read. ``hung``'s holdings come from its last words."""
        if not stopped:
            return
        try:  # fresh views: snapshots may have completed since the last poll
            self._group.refresh_holdings(stopped)
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001 - the restore then falls back as planned
            logger.warning("stopped ranks do not answer: %s", e)
            return
        pick = rescue_target(hung, stopped)
        if pick is None:
            return
        index, to = pick  # the newest shared snapshot: the one a restore would use
        try:
            if not self._merge(hung, to, index):
                return  # the receiver lacks nothing the hung worker has
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001 - the restore then falls back as planned
            logger.warning("could not move snapshot %s's shards off hung rank %s: %s", index, hung.prev_rank, e)
            return
        self._events.emit(
            EventKind.DECISION,
            f"moved hung rank {hung.prev_rank}'s shards of snapshot {index} to rank {to.prev_rank} before replacing it",
            decision="evacuate",
            index=index,
            to_rank=to.prev_rank,
        )

    def _gather(self, target: WorkerHandle, holders: List[WorkerHandle], index: int) -> bool:
        """Merge other holders' shards of snapshot ``index`` into ``target`` until it holds
        all of it. False (and a log line) when the holders together do not cover it."""
        if not covered([m.holding(index) for m in holders]):
            logger.warning("the holders of snapshot %s do not cover it; not moving it", index)
            return False
        for m in holders:
            if is_whole(target.holding(index)):
                break
            if m is not target:
                self._merge(m, target, index)
        if not is_whole(target.holding(index)):
            logger.warning(
                "snapshot %s is still not whole on rank %s after merging (%s)",
                index,
                target.prev_rank,
                target.holding(index),
            )
            return False
        return True

    def _merge(self, frm: WorkerHandle, to: WorkerHandle, index: int) -> bool:
        """Copy ``frm``'s shards of snapshot ``index`` that ``to`` lacks into ``to``'s copy.
        False when ``frm`` adds nothing."""
        if not adds_shards(frm.holding(index), to.holding(index)):
            return False
        self._group.merge_shards(frm, to, index)
        return True
