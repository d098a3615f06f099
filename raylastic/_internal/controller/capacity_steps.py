"""The controller's capacity steps (spot / on-demand): run the capacity policy each tick,
carry out a migration to spot or giving up. Part of ``Controller`` (a mixin, so that
``controller.py`` stays one screenful per state); it uses the controller's collaborators.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Dict, List, Optional

from raylastic._internal.controller.states import Errored, Resizing, Running, State
from raylastic._internal.worker_group.pool import spares_holding_needed_state
from raylastic.policies.capacity import DeadlineUnreachable, GiveUp, MigrateToSpot
from raylastic.policies.node_types import Market

if TYPE_CHECKING:
    from raylastic._internal.cluster.capacity_driver import CapacityDriver
    from raylastic._internal.controller.ingest import ReportIngest
    from raylastic._internal.worker_group.group import WorkerGroup
    from raylastic._internal.worker_group.pool import WorkerHandle
    from raylastic._internal.worker_group.results import PollResult
    from raylastic.checkpoint.manager import CheckpointManager


class CapacitySteps:
    """Mixed into ``Controller``; not used on its own."""

    # The controller's collaborators and methods this mixin uses (set by Controller).
    _state: State
    _ckpt: CheckpointManager
    _group: WorkerGroup
    _capacity: Optional[CapacityDriver]
    _ingest: ReportIngest
    _last_committed_seen: Optional[int]

    if TYPE_CHECKING:

        def _abort_all(self, reason: str) -> None: ...
        def _stop_members(self, members: List[WorkerHandle], graceful: bool) -> Dict[int, PollResult]: ...
        def _set_state(self, new: State, check: bool = True) -> None: ...

    def _capacity_step(self) -> None:
        """Run the capacity policy; carry out a migration or giving up."""
        assert self._capacity is not None  # the controller runs this step only with a capacity policy
        st = self._state
        members = list(getattr(st, "members", []))
        latest = self._ckpt.latest()
        # A migration is carried out only from Running: elsewhere no boundary is offered,
        # so the policy does not propose (and log) one that would be dropped.
        boundary = isinstance(st, Running) and (
            (latest is not None and latest.index != self._last_committed_seen)
            or bool(members and all(m.snapshots for m in members))
        )
        self._last_committed_seen = latest.index if latest else None
        self._group.drained(members)  # refresh the draining view the policy excludes
        # Keep the group's members (also while a graceful stop runs over several ticks),
        # and the ready workers that hold in-memory snapshots the members do not have
        # newer copies of: they are the state the next group restores from (trimming them
        # would force a storage read). Once the running group holds newer snapshots, a
        # worker that left it (an on-demand worker moved off) is released and its node
        # stops costing money.
        protect = members + spares_holding_needed_state(self._group.ready_workers(), members, isinstance(st, Running))
        training = isinstance(st, Running) and st.progress.reached(default=-1) >= 0
        d = self._capacity.tick(
            members, self._group.draining, boundary, protect=protect, index=self._ingest.last_index, training=training
        )
        if isinstance(d, (GiveUp, DeadlineUnreachable)):
            self._abort_all(
                f"capacity wait exhausted: {d.reason}" if isinstance(d, GiveUp) else f"capacity: {d.reason}"
            )
            self._stop_members(members, graceful=False)
            self._set_state(Errored(d.error()))
        elif isinstance(d, MigrateToSpot) and isinstance(st, Running):
            self._set_state(self._migrate(st, d))

    def _migrate(self, st: Running, migration: MigrateToSpot) -> State:
        """Swap on-demand members for ready spot workers at this boundary."""
        assert self._capacity is not None  # a migration comes from the capacity policy
        od = {t.name for t in self._capacity.policy.node_types if t.market is Market.ON_DEMAND}
        on_demand = [m for m in st.members if m.node_type in od]
        leaving = sorted(on_demand, key=lambda m: -m.prev_rank)[: migration.workers]
        for name in od:  # do not refill the slots being given back
            self._group.set_target(name, migration.target.get(name, 0))
        return Resizing(
            epoch=st.epoch,
            members=st.members,
            reason=migration.reason,
            graceful=True,
            started_at=time.monotonic(),
            leaving=leaving,
            progress=st.progress,
        )
