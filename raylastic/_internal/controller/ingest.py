"""The one path by which workers' reports enter the run.

Every poll the controller makes (running, during a graceful stop, collecting survivors'
last reports after a loss, a replaced worker's last words) hands its answers here:
checkpoint records go to the checkpoint manager (which commits a checkpoint once every
rank has uploaded its part), rank 0's metrics go to the event log, TensorBoard and the
status view, and rank 0's report times give the step-time estimate that places
graceful stops. The run's hooks (``hooks.py``) see every record and what it committed.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from raylastic._internal.controller.hooks import RunHooks
from raylastic._internal.controller.states import Progress
from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic._internal.worker_group.results import PollResult
from raylastic.checkpoint.manager import CheckpointManager
from raylastic.events import EventKind, EventLog


class ReportIngest:
    def __init__(
        self, ckpt: CheckpointManager, events: EventLog, tb: Optional[Any] = None, hooks: Optional[RunHooks] = None
    ):
        self._ckpt = ckpt
        self._hooks = hooks or RunHooks()
        self._events = events
        self._tb = tb
        self.step_time_s = 0.05  # running estimate (s per report), used to place graceful stops
        self.last_rank0: Optional[Tuple[int, float]] = None  # (index, monotonic time)
        self._lock = threading.Lock()  # status() reads the metrics from another thread
        self._latest_metrics: Dict[str, Any] = {}

    @property
    def latest_metrics(self) -> Dict[str, Any]:
        with self._lock:
            return dict(self._latest_metrics)

    @property
    def last_index(self) -> int:
        return self.last_rank0[0] if self.last_rank0 else 0

    def ingest(
        self,
        progress: Progress,
        members: Sequence[WorkerHandle],
        results: Mapping[int, PollResult],
        first_step: bool = True,
    ) -> None:
        """Take the answers of one poll (wid -> result) of ``members``. ``first_step``
        False: a group being stopped; its late first report is no ``first_step`` event
        (the report would read it as the end of a recovery that began after it)."""
        for m in members:
            r = results.get(m.wid)
            if r is not None:
                self._take(progress, len(members), m, r, first_step)

    def _take(self, progress: Progress, world_size: int, m: WorkerHandle, r: PollResult, first_step: bool) -> None:
        progress.last_index[m.wid] = max(progress.last_index.get(m.wid, 0), r.index)
        if not r.records:
            return
        self._hooks.records(r.records, self._ckpt.on_records(r.records))
        for rec in r.records:
            if rec.rank != 0:
                continue
            now = time.monotonic()
            if self.last_rank0 is not None and rec.index > self.last_rank0[0]:
                dt = (now - self.last_rank0[1]) / (rec.index - self.last_rank0[0])
                self.step_time_s = 0.8 * self.step_time_s + 0.2 * max(dt, 1e-4)
            self.last_rank0 = (rec.index, now)
            with self._lock:
                self._latest_metrics = rec.metrics
            self._events.metrics(
                {"ts": rec.ts, "index": rec.index, "epoch": rec.epoch, "world_size": world_size, "metrics": rec.metrics}
            )
            if self._tb is not None:
                self._tb.log_metrics(rec.index, rec.metrics, world_size, rec.ts)
            if first_step and not progress.first_step_seen:
                progress.first_step_seen = True
                self._events.emit(
                    EventKind.FIRST_STEP, epoch=rec.epoch, index=rec.index, world_size=world_size, report_ts=rec.ts
                )
