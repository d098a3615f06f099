"""The control-plane benchmark's harness at 4 workers, for correctness only.

Why: ``benchmarks/control_plane.py`` is how the controller's scaling is measured
(docs/scaling.md); this keeps its harness working, and runs the watched-group path
(``WorkerGroup.watch``: rank 0 every tick, everyone only every 1 s here) on a real
cluster: a node loss must still be seen through the pending watch calls, and
checkpoints must still commit when most polls ask rank 0 only. No timing asserts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import ray.cloudpickle

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "control_plane.py")


def _bench():
    spec = importlib.util.spec_from_file_location("control_plane_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    ray.cloudpickle.register_pickle_by_value(mod)  # Ray's copy: workers cannot import it by name
    return mod


def test_harness_measures_a_watched_group_and_its_recovery():
    bench = _bench()
    r = bench.measure(4, window_s=3.0, step_s=0.05, poll_interval_s=0.1, timeout_s=120,
                      max_polls_per_s=4.0, checkpoint_every=5)
    assert "stop_error" not in r, r
    steady = r["steady"]
    assert steady["partial_polls"] > steady["polls"] >= 1, steady  # mostly rank 0 only
    assert 0 < steady["controller_process_cpu_share"] and steady["poll_rtt_ms_median"] > 0, steady
    # Bytes in the 3 s window can be 0 on a loaded box (rank 0 reported nothing then: seen
    # once with the unit tests and DeepSpeed's build beside it); over the run they cannot.
    assert steady["event_log_bytes_per_min"] >= 0 and r["event_log_bytes_total"] > 0, (steady, r)
    loss = r["loss"]
    assert loss["workers_lost"] == 1, loss
    for key in ("to_decision_s", "to_resize_s", "to_group_formed_s", "to_training_started_s", "setup_s"):
        assert loss[key] is not None, (key, loss)
    assert loss["to_decision_s"] <= loss["to_group_formed_s"] <= loss["to_first_step_s"], loss
    # Checkpoints commit on the watched path. How many depends on the full polls the box
    # allows (the harness caps them at 4/s): with two busy loops beside it, 3 full polls in
    # the 3 s window and 4 commits in one run, 1 in another (2026-11-27), so at least one.
    # The harness waits (bounded) for the first commit before the node loss: on a loaded
    # box none had committed by then in three clean-clone runs, and rank 0 logged no report
    # in the window at all. (The whole result as text: a dict message is cut short.)
    assert r["checkpoints_committed"] >= 1 and r["event_counts"].get("checkpoint_committed", 0) >= 1, \
        json.dumps(r, default=str)
