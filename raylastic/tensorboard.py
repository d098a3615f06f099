"""TensorBoard scalars for a run, under ``<run>/tensorboard``.

Scalars (x axis: the report index; wall time: the report's ``ts``):

- ``train/<key>``: every numeric metric rank 0 reported (``train/loss``, ...)
- ``elastic/world_size``: workers in the group that made the report
- ``elastic/steps_per_s`` (and ``elastic/samples_per_s`` when ``samples_per_step`` is
  known): throughput since the previous report of the same group
- ``elastic/cost_usd``: cost so far, once a ``price_table`` event and ``worker_ready``
  events have been passed to :meth:`TensorBoardLogger.observe_event`
- ``elastic/failures``: ``failure`` events so far (seen through ``observe_event``)

Scalars are written with the ``tensorboard`` package's own event-file writer (what
``torch.utils.tensorboard`` writes through), tensorboardX's ``SummaryWriter`` where
``tensorboard`` is missing, imported on first use; with neither installed the logger warns
once and does nothing. Not ``torch.utils.tensorboard`` itself: the logger runs in the
controller, which never imports torch otherwise (tensorboardX imports it too).
View with ``tensorboard --logdir <run>/tensorboard``. On object stores the event files are
written to a local staging directory and uploaded on :meth:`flush` (at most every
``sync_interval_s`` from ``log_metrics``) and :meth:`close`.
"""

from __future__ import annotations

import logging
import math
import tempfile
import time
from typing import Any, Callable, Dict, Mapping, Optional, Set, Tuple

logger = logging.getLogger("raylastic")

__all__ = ["TensorBoardLogger", "TENSORBOARD_DIR"]

TENSORBOARD_DIR = "tensorboard"


def _default_writer_factory(logdir: str, flush_secs: int):
    try:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter
    except ImportError:
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return None
        return SummaryWriter(log_dir=logdir, flush_secs=flush_secs)
    return _ScalarWriter(EventFileWriter(logdir, flush_secs=flush_secs))


class _ScalarWriter:
    """``add_scalar`` / ``flush`` / ``close`` over tensorboard's ``EventFileWriter``: the
    same event files as ``SummaryWriter``, without importing torch."""

    def __init__(self, events) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        self._events, self._event, self._summary = events, Event, Summary

    def add_scalar(self, tag: str, value: float, global_step: int, walltime: Optional[float] = None) -> None:
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._events.add_event(
            self._event(
                summary=summary, step=int(global_step), wall_time=time.time() if walltime is None else float(walltime)
            )
        )

    def flush(self) -> None:
        self._events.flush()

    def close(self) -> None:
        self._events.close()


class _CostMeter:
    """Cost so far from worker_ready/worker_lost/worker_released and price_table events
    (the same node-hours rule as ``raylastic report``: a node is paid from its first ready
    worker until its last worker goes)."""

    def __init__(self) -> None:
        self.prices: Dict[str, float] = {}
        self._held: Dict[str, Tuple[str, float, Set[Any]]] = {}  # node -> (type, since, wids)
        self._closed: Dict[str, float] = {}  # node type -> node-seconds of finished holds

    def observe(self, e: Mapping[str, Any]) -> None:
        kind, ts = e.get("kind"), float(e.get("ts") or time.time())
        if kind in ("price_table", "prices") and isinstance(e.get("usd_per_hour"), Mapping):
            self.prices.update({str(k): float(v) for k, v in e["usd_per_hour"].items()})
        elif kind == "worker_ready" and e.get("node_id"):
            ntype, since, wids = self._held.get(e["node_id"], (e.get("node_type") or "default", ts, set()))
            wids.add(e.get("wid"))
            self._held[e["node_id"]] = (ntype, since, wids)
        elif kind in ("worker_lost", "worker_released") and e.get("node_id") in self._held:
            ntype, since, wids = self._held[e["node_id"]]
            wids.discard(e.get("wid"))
            if not wids or e.get("wid") is None:
                del self._held[e["node_id"]]
                self._closed[ntype] = self._closed.get(ntype, 0.0) + max(0.0, ts - since)

    def cost_usd(self, now: float) -> Optional[float]:
        seconds = dict(self._closed)
        for ntype, since, _ in self._held.values():
            seconds[ntype] = seconds.get(ntype, 0.0) + max(0.0, now - since)
        if not seconds or any(t not in self.prices for t in seconds):
            return None
        return sum(self.prices[t] * s / 3600.0 for t, s in seconds.items())


class TensorBoardLogger:
    """Writes a run's scalars for TensorBoard. Never raises from logging calls: a broken
    or missing TensorBoard must not stop training."""

    def __init__(
        self,
        logdir: str,
        *,
        flush_secs: int = 10,
        samples_per_step: Optional[float] = None,
        writer_factory: Optional[Callable[[str, int], Any]] = None,
        upload: Optional[Callable[[str], None]] = None,
        sync_interval_s: float = 30.0,
    ) -> None:
        self.logdir = logdir
        self._flush_secs = flush_secs
        self._samples_per_step = samples_per_step
        self._factory = writer_factory or _default_writer_factory
        self._upload = upload
        self._sync_interval_s = sync_interval_s
        self._last_sync = time.monotonic()
        self._writer: Any = None
        self._disabled = False
        self._prev: Optional[Tuple[int, float, int]] = None  # (index, ts, world_size)
        self._cost = _CostMeter()
        self._failures = 0

    @classmethod
    def for_run(cls, storage, run_rel: str, **kwargs: Any) -> "TensorBoardLogger":
        """``<run>/tensorboard`` on the run's storage. Object stores get a local staging
        directory uploaded on flush/close (TensorBoard appends to its event files)."""
        rel = f"{run_rel.rstrip('/')}/{TENSORBOARD_DIR}"
        if storage.is_local:
            return cls(storage.path(rel), **kwargs)
        staging = tempfile.mkdtemp(prefix="raylastic-tb-")

        def upload(local_dir: str) -> None:
            storage.upload_dir(local_dir, rel)

        return cls(staging, upload=upload, **kwargs)

    # -- writer ------------------------------------------------------------------------
    def _get_writer(self) -> Any:
        if self._writer is None and not self._disabled:
            try:
                self._writer = self._factory(self.logdir, self._flush_secs)
            except Exception as e:  # noqa: BLE001
                logger.warning("TensorBoard logging disabled: cannot open %s (%s)", self.logdir, e)
                self._writer = None
            if self._writer is None:
                if not self._disabled:
                    logger.warning(
                        "TensorBoard logging disabled: neither tensorboard nor tensorboardX "
                        "could be imported (pip install tensorboard)"
                    )
                self._disabled = True
        return self._writer

    @property
    def enabled(self) -> bool:
        return self._get_writer() is not None

    # -- logging -------------------------------------------------------------------------
    def log_scalar(self, name: str, value: float, index: int, ts: Optional[float] = None) -> None:
        w = self._get_writer()
        if w is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            return
        if not math.isfinite(float(value)):
            return
        try:
            w.add_scalar(name, float(value), global_step=int(index), walltime=ts)
        except Exception as e:  # noqa: BLE001
            logger.warning("TensorBoard: could not log %s: %s", name, e)

    def log_metrics(self, index: int, metrics: Mapping[str, Any], world_size: int, ts: Optional[float] = None) -> None:
        """One rank-0 report: its numeric metrics, world size, throughput, cost so far."""
        if self._get_writer() is None:
            return
        ts = time.time() if ts is None else float(ts)
        for key, value in (metrics or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.log_scalar(f"train/{key}", value, index, ts)
            elif hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
                try:
                    self.log_scalar(f"train/{key}", float(value.item()), index, ts)
                except Exception:  # noqa: BLE001
                    pass
        self.log_scalar("elastic/world_size", world_size, index, ts)
        prev = self._prev
        if prev is not None and index > prev[0] and ts > prev[1] and world_size == prev[2]:
            steps_per_s = (index - prev[0]) / (ts - prev[1])
            self.log_scalar("elastic/steps_per_s", steps_per_s, index, ts)
            if self._samples_per_step:
                self.log_scalar("elastic/samples_per_s", steps_per_s * self._samples_per_step, index, ts)
        self._prev = (index, ts, world_size)
        cost = self._cost.cost_usd(ts)
        if cost is not None:
            self.log_scalar("elastic/cost_usd", cost, index, ts)
        self.log_scalar("elastic/failures", self._failures, index, ts)
        if self._upload is not None and time.monotonic() - self._last_sync >= self._sync_interval_s:
            self.flush()

    def observe_event(self, event: Mapping[str, Any]) -> None:
        """Feed every event-log record (price_table, worker_ready/lost/released, failure)."""
        try:
            self._cost.observe(event)
            if event.get("kind") == "failure":
                self._failures += 1
            if event.get("kind") == "group_formed":
                self._prev = None  # throughput restarts with each group
        except Exception:  # noqa: BLE001
            pass

    def flush(self) -> None:
        w = self._writer
        try:
            if w is not None:
                w.flush()
            if self._upload is not None and w is not None:
                self._upload(self.logdir)
        except Exception as e:  # noqa: BLE001
            logger.warning("TensorBoard: could not flush/upload %s: %s", self.logdir, e)
        self._last_sync = time.monotonic()

    def close(self) -> None:
        """Close the writer (its last events reach disk) and upload once more."""
        w, self._writer = self._writer, None
        self._disabled = True
        if w is None:
            return
        try:
            w.close()
            if self._upload is not None:
                self._upload(self.logdir)
        except Exception as e:  # noqa: BLE001
            logger.warning("TensorBoard: could not close/upload %s: %s", self.logdir, e)
