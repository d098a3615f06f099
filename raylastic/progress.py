"""One live status line while ``fit()`` runs: step, world size, samples/s, last loss, ETA,
recoveries so far.

- In a terminal or a Jupyter cell: a tqdm bar (``tqdm.auto``; the notebook widget when
  ipywidgets is installed, else the text bar), redrawn in place.
- Anywhere else (``ray job submit`` logs, CI, output piped to a file): a plain line at
  most every ``plain_interval_s`` seconds, plus one when the run ends, because carriage
  returns make a mess of log files.
- ``ProgressLine(enabled=False)``: does nothing.

The driver polls the controller about every 0.5 s and passes its status dict to
:meth:`ProgressLine.update`::

    {"state": "Running", "epoch": 2, "world_size": 3, "metrics": {"loss": 0.12, ...},
     "index": 120, "total_steps": 1000, "samples_per_step": 96, "recoveries": 1}

``index`` is the last report index of rank 0; ``total_steps`` (optional) enables the bar
and the ETA; ``samples_per_step`` (optional) is the samples one report covers across the
whole group at the current world size (without it the rate is shown in steps/s).
Throughput is measured over a sliding window and restarts after a restore (the index
going backwards), so the re-trained steps after a recovery do not inflate it.
"""

from __future__ import annotations

import collections
import math
import sys
import time
from typing import Any, Callable, Deque, Dict, Mapping, Optional, TextIO, Tuple

__all__ = ["ProgressLine", "format_status"]


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()
    except Exception:  # noqa: BLE001
        return False
    return ip is not None and type(ip).__name__ in ("ZMQInteractiveShell", "Shell")


def _fmt_eta(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(max(0.0, seconds)))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def _fmt_num(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _fmt_rate(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


class _Rate:
    """Steps per second over the last ``window_s`` seconds of (time, index) samples."""

    def __init__(self, window_s: float) -> None:
        self._window_s = window_s
        self._samples: Deque[Tuple[float, int]] = collections.deque()

    def add(self, t: float, index: int) -> None:
        if self._samples and index < self._samples[-1][1]:
            self._samples.clear()  # restored from a checkpoint: the old rate is stale
        if self._samples and index == self._samples[-1][1]:
            return
        self._samples.append((t, index))
        while len(self._samples) > 2 and t - self._samples[0][0] > self._window_s:
            self._samples.popleft()

    def per_s(self) -> Optional[float]:
        if len(self._samples) < 2:
            return None
        (t0, i0), (t1, i1) = self._samples[0], self._samples[-1]
        return (i1 - i0) / (t1 - t0) if t1 > t0 and i1 > i0 else None


def format_status(
    status: Mapping[str, Any], steps_per_s: Optional[float], metric_keys: Tuple[str, ...] = ("loss",)
) -> str:
    """The status fields after the step counter, e.g.
    ``world 3 | 1,200 samples/s | loss 0.1234 | ETA 01:02 | recoveries 1 | Running``."""
    parts = [f"world {status.get('world_size', 0)}"]
    sps = status.get("samples_per_step")
    if steps_per_s is None:
        parts.append("- samples/s" if sps else "- steps/s")
    elif sps:
        parts.append(f"{_fmt_rate(steps_per_s * float(sps))} samples/s")
    else:
        parts.append(f"{_fmt_rate(steps_per_s)} steps/s")
    metrics = status.get("metrics") or {}
    for key in metric_keys:
        if key in metrics:
            parts.append(f"{key} {_fmt_num(metrics[key])}")
    total, index = status.get("total_steps"), status.get("index")
    if total and index is not None:
        eta = (total - index) / steps_per_s if steps_per_s else None
        parts.append(f"ETA {_fmt_eta(eta)}")
    parts.append(f"recoveries {int(status.get('recoveries') or 0)}")
    if status.get("state"):
        parts.append(str(status["state"]))
    return " | ".join(parts)


class ProgressLine:
    """Call :meth:`update` with the controller's status every ~0.5 s and :meth:`close` at
    the end (or use it as a context manager). Never raises from update/close: a broken
    progress display must not stop training."""

    def __init__(
        self,
        enabled: bool = True,
        *,
        total_steps: Optional[int] = None,
        file: Optional[TextIO] = None,
        desc: str = "raylastic",
        plain_interval_s: float = 30.0,
        rate_window_s: float = 30.0,
        metric_keys: Tuple[str, ...] = ("loss",),
        interactive: Optional[bool] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self._file = file
        self._desc = desc
        self._total = total_steps
        self._plain_interval_s = plain_interval_s
        self._metric_keys = tuple(metric_keys)
        self._clock = clock
        self._rate = _Rate(rate_window_s)
        self._bar = None
        self._last_plain: Optional[float] = None
        self._last_line = ""
        self._closed = False
        self._interactive = interactive
        self._status: Dict[str, Any] = {}

    # -- mode ------------------------------------------------------------------------
    @property
    def interactive(self) -> bool:
        """A TTY or a Jupyter kernel: redraw one line in place."""
        if self._interactive is None:
            out = self._out()
            try:
                tty = bool(out.isatty())
            except Exception:  # noqa: BLE001
                tty = False
            self._interactive = tty or _in_notebook()
        return self._interactive

    def _out(self) -> TextIO:
        return self._file if self._file is not None else sys.stdout

    def _make_bar(self, total: Optional[int]):
        fmt = (
            "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}{postfix}"
            if total
            else "{desc}: step {n_fmt}{postfix}"
        )
        kwargs = dict(total=total, desc=self._desc, bar_format=fmt, dynamic_ncols=True, leave=True, file=self._out())
        try:
            from tqdm.auto import tqdm

            return tqdm(**kwargs)
        except ImportError:  # tqdm.notebook without ipywidgets raises on creation
            try:
                from tqdm.std import tqdm

                return tqdm(**kwargs)
            except ImportError:
                self._interactive = False  # no tqdm at all: plain lines
                return None

    # -- API -------------------------------------------------------------------------
    def update(self, status: Mapping[str, Any]) -> None:
        if not self.enabled or self._closed:
            return
        try:
            self._update(status)
        except Exception:  # noqa: BLE001 - never break fit() over a status line
            self.enabled = False

    def _update(self, status: Mapping[str, Any]) -> None:
        now = self._clock()
        self._status = dict(status)
        total = status.get("total_steps") or self._total
        if total:
            self._status["total_steps"] = total
        index = status.get("index")
        if index is not None:
            self._rate.add(now, int(index))
        text = format_status(self._status, self._rate.per_s(), self._metric_keys)
        if self.interactive:
            if self._bar is None:
                self._bar = self._make_bar(total)
            if self._bar is not None:
                if total and self._bar.total != total:
                    self._bar.total = total
                self._bar.n = int(index or 0)
                self._bar.set_postfix_str(text, refresh=False)
                self._bar.refresh()
                return
        if self._last_plain is None or now - self._last_plain >= self._plain_interval_s:
            self._emit_plain(text)
            self._last_plain = now

    def _plain_text(self, text: str) -> str:
        index, total = self._status.get("index"), self._status.get("total_steps")
        step = (
            "step -"
            if index is None
            else f"step {index}" + (f"/{total} ({100.0 * index / total:.0f}%)" if total else "")
        )
        return f"[{self._desc}] {step} | {text}"

    def _emit_plain(self, text: str) -> None:
        line = self._plain_text(text)
        print(line, file=self._out(), flush=True)
        self._last_line = line

    def close(self) -> None:
        """Leave the final status on screen (a TTY/notebook) or print it (plain logs)."""
        if not self.enabled or self._closed:
            self._closed = True
            return
        self._closed = True
        try:
            if self._bar is not None:
                self._bar.close()
            elif self._status:
                line = self._plain_text(format_status(self._status, self._rate.per_s(), self._metric_keys))
                if line != self._last_line:
                    print(line, file=self._out(), flush=True)
        except Exception:  # noqa: BLE001
            pass

    def __enter__(self) -> "ProgressLine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
