"""Live progress line (TTY / notebook / plain logs) and the TensorBoard logger."""

from __future__ import annotations

import io
import logging

import pytest

from raylastic.progress import ProgressLine, format_status
from raylastic.tensorboard import TensorBoardLogger


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def status(index, ws=3, loss=0.5, **kw):
    return {"state": "Running", "epoch": 1, "world_size": ws, "metrics": {"loss": loss},
            "index": index, "recoveries": 0, **kw}


def test_plain_lines_are_rate_limited_and_the_last_is_printed_on_close():
    out, clock = io.StringIO(), Clock()
    p = ProgressLine(file=out, interactive=False, plain_interval_s=10, clock=clock)
    for i in range(1, 41):  # 20 s of updates every 0.5 s, 2 steps/s
        clock.t = i * 0.5
        p.update(status(i, total_steps=100, samples_per_step=32, recoveries=1))
    p.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 3  # t=0.5, t=10.5, close
    assert "\r" not in out.getvalue()
    last = lines[-1]
    assert last.startswith("[raylastic] step 40/100 (40%)")
    for needle in ("world 3", "64.0 samples/s", "loss 0.5", "ETA 00:30", "recoveries 1", "Running"):
        assert needle in last, needle


def test_disabled_is_a_no_op():
    out = io.StringIO()
    p = ProgressLine(enabled=False, file=out, interactive=False)
    p.update(status(1))
    p.close()
    assert out.getvalue() == ""


def test_tty_uses_one_updating_tqdm_line():
    out, clock = io.StringIO(), Clock()
    with ProgressLine(file=out, interactive=True, clock=clock) as p:
        for i in range(1, 6):
            clock.t = i
            p.update(status(i, total_steps=10))
    text = out.getvalue()
    assert "\r" in text and "5/10" in text and "world 3" in text and "loss 0.5" in text


def test_rate_restarts_after_a_restore_and_eta_needs_a_total():
    clock = Clock()
    out = io.StringIO()
    p = ProgressLine(file=out, interactive=False, plain_interval_s=0, clock=clock)
    for t, i in [(0, 10), (1, 12), (2, 14), (3, 11), (4, 12)]:  # restored to 10 at t=3
        clock.t = t
        p.update(status(i))
    assert out.getvalue().splitlines()[-1].endswith("world 3 | 1 steps/s | loss 0.5 | recoveries 0 | Running")
    assert "ETA" not in out.getvalue()


def test_update_never_raises_on_odd_status():
    p = ProgressLine(file=io.StringIO(), interactive=False)
    p.update({})
    p.update({"index": "x", "metrics": None, "total_steps": "?"})
    p.close()
    p.update(status(1))  # after close: ignored


def test_format_status_without_rate():
    assert format_status({"world_size": 2, "metrics": {"loss": 1.23456789}}, None) == (
        "world 2 | - steps/s | loss 1.235 | recoveries 0")


# ----------------------------------------------------------------------------- TensorBoard

def _scalars(logdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    tb = TensorBoardLogger(str(tmp_path / "tb"), samples_per_step=8)
    t0 = 1_700_000_000.0
    tb.observe_event({"ts": t0, "kind": "price_table", "usd_per_hour": {"spot": 3.6}})
    tb.observe_event({"ts": t0, "kind": "worker_ready", "node_id": "n1", "wid": 1,
                      "node_type": "spot"})
    for i in range(1, 4):
        tb.log_metrics(i, {"loss": 1.0 / i, "note": "text", "flag": True}, 2, ts=t0 + 10 * i)
    tb.log_scalar("custom/x", 7, 3)
    tb.close()
    s = _scalars(tmp_path / "tb")
    assert s["train/loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3))]
    assert "train/note" not in s and "train/flag" not in s
    assert s["elastic/world_size"][0] == (1, 2.0)
    assert s["elastic/steps_per_s"] == [(2, pytest.approx(0.1)), (3, pytest.approx(0.1))]
    assert s["elastic/samples_per_s"][-1] == (3, pytest.approx(0.8))
    assert s["elastic/cost_usd"][-1] == (3, pytest.approx(3.6 * 30 / 3600))
    assert s["custom/x"] == [(3, 7.0)]


def test_tensorboard_missing_is_a_no_op_with_one_warning(tmp_path, caplog):
    tb = TensorBoardLogger(str(tmp_path / "tb"), writer_factory=lambda d, f: None)
    with caplog.at_level(logging.WARNING, logger="raylastic"):
        tb.log_metrics(1, {"loss": 1.0}, 1)
        tb.log_metrics(2, {"loss": 1.0}, 1)
        tb.log_scalar("a", 1.0, 1)
        tb.close()
    warnings = [r for r in caplog.records if "TensorBoard logging disabled" in r.getMessage()]
    assert len(warnings) == 1 and not tb.enabled
    assert not (tmp_path / "tb").exists()


def test_tensorboard_for_remote_storage_uploads_on_close(tmp_path):
    pytest.importorskip("tensorboard")
    uploads = []

    class FakeStorage:
        is_local = False

        def upload_dir(self, local_dir, rel):
            import os

            uploads.append((rel, sorted(os.listdir(local_dir))))

    tb = TensorBoardLogger.for_run(FakeStorage(), "bucket-run")
    tb.log_metrics(1, {"loss": 1.0}, 1)
    tb.close()
    assert uploads and uploads[-1][0] == "bucket-run/tensorboard"
    assert any(name.startswith("events.out.tfevents") for name in uploads[-1][1])
