"""A fake ``WorkerGroup`` for stepping the controller by hand, without Ray.

Each fake worker is a tiny train function simulated at poll time: every poll of a
running worker is one report (a ``ReportRecord``; rank 0 writes a real checkpoint file
to the run's storage every ``checkpoint_every`` reports). Tests script faults on it:
a lost node, a rank that raises, a drained node, a worker that stalls, a stop that
blocks until the controller is interrupted. Instances hold all their state (no
class-level state), so tests do not leak into each other.
"""

from __future__ import annotations

import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

from raylastic._internal.worker_group.group import (
    Formed, Interrupted, MembersLost, PollBatch, StopOutcome, order_by_node,
)
from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic._internal.protocol import Holdings
from raylastic._internal.worker_group.results import PersistedSnapshot, PollResult, StopAnswer, WorkerStatus
from raylastic.session import GroupSpec, ReportRecord, RestoreInfo, checkpoint_rel


@dataclass
class FakeWorker:
    handle: WorkerHandle
    status: str = WorkerStatus.IDLE
    epoch: int = -1
    rank: int = -1
    index: int = 0
    stop_at: Optional[int] = None
    raise_at: Optional[int] = None
    raise_message: str = ""  # what it raises at raise_at (default: a ValueError)
    stalled: bool = False  # reports nothing (a slow step that never ends)
    dead: bool = False
    crashed: bool = False  # died on a live node (a real failure), not a node loss
    # A report with a checkpoint reaches the controller this many polls late (its upload
    # still running), whatever the worker does meanwhile (raise, stop).
    late_checkpoints: int = 0
    refuses_stops: bool = False  # answers every stop request as already past it
    polls: int = 0
    held: List[tuple] = field(default_factory=list)  # (poll it arrives at, record)
    restores: List[RestoreInfo] = field(default_factory=list)


class FakeGroup:
    def __init__(self, storage, run_rel: str, total: int = 1000, checkpoint_every: Optional[int] = None):
        self.pool = None  # no capacity driver in these tests
        self._storage = storage
        self._run_rel = run_rel
        self._total = total
        self._checkpoint_every = checkpoint_every
        self.workers: Dict[int, FakeWorker] = {}
        self._new: List[WorkerHandle] = []
        self._next_wid = 0
        self.dead_peer_graces: List[float] = []  # how long the controller would look for a dead peer
        self.dead_peer_silent: List[bool] = []  # and whether a peer that only does not answer counts
        self.draining: Dict[str, int] = {}
        self.last_ready_at: Optional[float] = None
        self.starting_count = 0  # workers placed and starting (not ready): what starting() says
        self.targets: Dict[Optional[str], int] = {}
        self._interrupt = threading.Event()
        self.block_stop = False  # stop() waits for the controller's interrupt
        self.stop_calls: List[bool] = []  # graceful flag of each stop()
        self.persisted: List[tuple] = []  # (wid, index) of each persist_snapshot()
        self.on_report: Optional[Callable[[int, int], None]] = None  # (rank, index) before each report
        # A node lost while a call to every member is in flight (the others answer).
        self.lose_on_start: Optional[str] = None
        self.lose_on_request_stop: Optional[str] = None
        # What a member would answer if asked for its snapshot holdings now (wid -> view);
        # the handles keep what their last poll said until refresh_holdings() is called.
        self.holdings_now: Dict[int, Holdings] = {}
        self.refreshed: List[List[int]] = []  # wids of each refresh_holdings()

    # -- scripting -----------------------------------------------------------------
    def add_worker(self, node: str) -> WorkerHandle:
        wid = self._next_wid
        self._next_wid += 1
        h = WorkerHandle(wid, actor=None, info_ref=None, created_at=time.monotonic(),
                         info={"node_id": node, "pid": 1000 + wid, "node_type": None, "market": None})
        self._new.append(h)
        return h

    def lose_node(self, node: str) -> None:
        for w in self.workers.values():
            if w.handle.node_id == node:
                w.dead = True

    def worker(self, h: WorkerHandle) -> FakeWorker:
        return self.workers[h.wid]

    # -- WorkerGroup's interface -----------------------------------------------------
    def interrupt(self) -> None:
        self._interrupt.set()

    def refresh(self) -> List[WorkerHandle]:
        newly, self._new = self._new, []
        for h in newly:
            h.ready_at = self.last_ready_at = time.monotonic()
            self.workers[h.wid] = FakeWorker(h)
        return newly

    def fill(self) -> None:
        pass  # replacements arrive only when a test adds them

    def starting(self) -> int:
        return self.starting_count

    def ready_spares(self, members: Sequence[WorkerHandle]) -> List[WorkerHandle]:
        ids = {m.wid for m in members}
        return [w.handle for w in self.workers.values() if w.handle.wid not in ids]

    def ready_workers(self) -> List[WorkerHandle]:
        return [w.handle for w in self.workers.values()]

    def is_member(self, h: WorkerHandle) -> bool:
        return h.wid in self.workers

    def set_target(self, node_type, count: int) -> None:
        self.targets[node_type] = count

    def remove(self, h: WorkerHandle) -> None:
        self.workers.pop(h.wid, None)

    def shutdown(self) -> None:
        self.workers.clear()

    def setup(self, members: List[WorkerHandle], epoch: int, backend: str) -> Formed:
        members = order_by_node(members)
        specs = [GroupSpec(epoch=epoch, rank=r, world_size=len(members), local_rank=0, local_world_size=1,
                           node_rank=r, master_addr="127.0.0.1", master_port=1, backend=backend)
                 for r in range(len(members))]
        for r, m in enumerate(members):
            m.prev_rank = r
            w = self.worker(m)
            w.epoch, w.rank = epoch, r
        return Formed(members, specs)

    def start(self, formed: Formed, train_func, config, restore: RestoreInfo) -> None:
        self._lose_during_call(formed.members, "lose_on_start")
        for m in formed.members:
            w = self.worker(m)
            w.status, w.index, w.stop_at = WorkerStatus.RUNNING, restore.index, None
            w.restores.append(restore)
        self._raise_if_lost(formed.members)

    def _lose_during_call(self, members: Sequence[WorkerHandle], knob: str) -> None:
        node = getattr(self, knob)
        if node is not None:
            setattr(self, knob, None)
            self.lose_node(node)

    def _raise_if_lost(self, members: Sequence[WorkerHandle]) -> None:
        dead = [m for m in members if self.worker(m).dead]
        if dead:
            raise MembersLost(PollBatch(lost=dead, causes={m.wid: None for m in dead}))

    def poll(self, members: Sequence[WorkerHandle]) -> PollBatch:
        batch = PollBatch()
        for m in members:
            w = self.workers.get(m.wid)
            if w is None or w.dead:
                batch.lost.append(m)
                batch.causes[m.wid] = None
                continue
            batch.results[m.wid] = self._advance(w)
        return batch

    def watch(self, members: Sequence[WorkerHandle]) -> PollBatch:
        """The running group's poll (the real one polls a subset on most ticks)."""
        return self.poll(members)

    def _advance(self, w: FakeWorker) -> PollResult:
        """One report of a running worker (the simulated train function)."""
        records, error = [], None
        w.polls += 1
        records += [rec for due, rec in w.held if due <= w.polls]
        w.held = [(due, rec) for due, rec in w.held if due > w.polls]
        if w.status == WorkerStatus.RUNNING and not w.stalled:
            if w.stop_at is not None and w.index >= w.stop_at:
                w.status = WorkerStatus.STOPPED
            elif w.raise_at is not None and w.index + 1 == w.raise_at:
                w.status, error = WorkerStatus.ERROR, (w.raise_message
                                                       or f"ValueError: rank {w.rank} failed at {w.raise_at}")
                w.raise_at = None
            else:
                w.index += 1
                if self.on_report is not None:
                    self.on_report(w.rank, w.index)
                rec = self._record(w)
                if rec.checkpoint_rel and w.late_checkpoints:
                    w.held.append((w.polls + w.late_checkpoints, rec))
                else:
                    records.append(rec)
                if w.index >= self._total:
                    w.status = WorkerStatus.FINISHED
        return PollResult(status=w.status, epoch=w.epoch, records=records, error=error, index=w.index,
                          return_value={"rank": w.rank} if w.status == WorkerStatus.FINISHED else None)

    def _record(self, w: FakeWorker) -> ReportRecord:
        rec = ReportRecord(index=w.index, rank=w.rank, epoch=w.epoch, ts=time.time(), metrics={"step": w.index})
        if self._checkpoint_every and w.index % self._checkpoint_every == 0 and w.rank == 0:
            rel = checkpoint_rel(self._run_rel, w.index, w.epoch)
            rec.checkpoint_rel, rec.files = rel, self._write_state(rel, f"state at {w.index}")
        return rec

    def _write_state(self, rel: str, text: str) -> list:
        """A one-file checkpoint directory ``rel``; returns its manifest's file list."""
        data = text.encode()
        self._storage.write_bytes(f"{rel}/state.bin", data)
        return [["state.bin", len(data), f"crc32:{zlib.crc32(data):08x}"]]

    def wait_for_dead_peer(self, others: Sequence[WorkerHandle], grace_s: float, silent_is_dead: bool = True):
        self.dead_peer_graces.append(grace_s)
        self.dead_peer_silent.append(silent_is_dead)
        return {m.wid: None for m in others if self.workers.get(m.wid) is None or self.worker(m).dead}

    def is_crash(self, m: WorkerHandle, cause) -> bool:
        w = self.workers.get(m.wid)
        return bool(w and w.crashed)

    def drained(self, members: Sequence[WorkerHandle], fresh: bool = False) -> List[WorkerHandle]:
        return [m for m in members if m.node_id in self.draining]

    def time_to_deadline(self, leaving: Sequence[WorkerHandle]) -> float:
        return float("inf")

    def request_stop_at(self, members: Sequence[WorkerHandle], index: int) -> List[StopAnswer]:
        self._lose_during_call(members, "lose_on_request_stop")
        self._raise_if_lost(members)
        answers = []
        for m in members:
            w = self.worker(m)
            if w.refuses_stops:
                answers.append(StopAnswer(ok=False, index=index))
            elif w.index > index:
                answers.append(StopAnswer(ok=False, index=w.index))
            else:
                w.stop_at = index
                answers.append(StopAnswer(ok=True, index=w.index))
        return answers

    def abort(self, members: Sequence[WorkerHandle], epoch: int) -> list:
        for m in members:
            w = self.workers.get(m.wid)
            if w is not None and w.epoch == epoch and w.status == WorkerStatus.RUNNING:
                w.status = WorkerStatus.STOPPED
        return []

    def refresh_holdings(self, members: Sequence[WorkerHandle]) -> None:
        self.refreshed.append([m.wid for m in members])
        for m in members:
            if self.worker(m).dead:
                raise RuntimeError(f"worker {m.wid} does not answer")
        for m in members:
            if m.wid in self.holdings_now:
                m.update_holdings(self.holdings_now[m.wid])

    def persist_snapshot(self, m: WorkerHandle, index: int, epoch: int) -> PersistedSnapshot:
        """``m`` writes its in-memory snapshot ``index`` to storage (a leaving worker)."""
        rel = checkpoint_rel(self._run_rel, index, epoch)
        self.persisted.append((m.wid, index))
        return PersistedSnapshot(rel, self._write_state(rel, f"snapshot {index} of wid {m.wid}"), 0.0)

    def stop(self, members: Sequence[WorkerHandle], epoch: int, graceful: bool, abort_join_s: float) -> StopOutcome:
        self.stop_calls.append(graceful)
        if self.block_stop:  # like an evacuation call that takes long: only a stop ends it
            if not self._interrupt.wait(30):
                raise AssertionError("the controller was never interrupted")
            raise Interrupted("stop requested")
        if not graceful:
            self.abort(members, epoch)
        return StopOutcome([m for m in members if m.wid in self.workers], [])
