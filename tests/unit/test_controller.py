"""The controller's loop stepped by hand against a fake worker group: no Ray.

Each test scripts a fault on ``FakeGroup`` (tests/unit/fake_group.py), calls
``Controller.tick()`` and asserts the exact sequence of states and the event log. The
checkpoint manager and event log write to a real local storage directory.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
from typing import Callable, List


from raylastic._internal.controller.controller import Controller
from raylastic._internal.controller.states import Errored, Finished, Resizing, Running, Scheduling
from raylastic.checkpoint.storage import RetryPolicy, Storage
from raylastic.config import FailureConfig, RunConfig, ScalingConfig
from raylastic.errors import TrainingAborted, TrainingFailedError
from raylastic.events import EventKind, load_events
from raylastic.policies.scaling import ElasticScalingPolicy

from fake_group import FakeGroup

RUN = "run"


def _controller(tmp_path, group_kw=None, min_w=2, max_w=3, retry=None, **run_kw):
    storage = Storage(str(tmp_path), retry=retry)
    group = FakeGroup(storage, RUN, **(group_kw or {}))
    run = RunConfig(name=RUN, storage_path=str(tmp_path), verbose=False, poll_interval_s=0.001, **run_kw)
    ctrl = Controller(
        lambda: None, None, ScalingConfig(min_workers=min_w, max_workers=max_w), run, storage, RUN, RUN,
        # no settle window: workers added by a test join at the next tick
        scaling_policy=ElasticScalingPolicy(min_workers=min_w, max_workers=max_w, settle_s=0.0),
        group=group)
    return ctrl, group


def _tick_until(ctrl: Controller, done: Callable[[object], bool], max_ticks: int = 500) -> List[str]:
    """Tick until ``done(state)``; returns the state names seen after each tick, with
    consecutive repeats collapsed."""
    seen: List[str] = []
    for _ in range(max_ticks):
        ctrl.tick()
        name = type(ctrl._state).__name__
        if not seen or seen[-1] != name:
            seen.append(name)
        if done(ctrl._state):
            return seen
    raise AssertionError(f"not done after {max_ticks} ticks; states {seen}")


def _running(n: int):
    return lambda st: isinstance(st, Running) and len(st.members) == n


def _events(tmp_path, ctrl, kind=None):
    events = load_events(os.path.join(str(tmp_path), RUN))
    return [e for e in events if kind is None or e["kind"] == kind.value]


def _start(ctrl, group, nodes):
    handles = [group.add_worker(n) for n in nodes]
    assert _tick_until(ctrl, _running(len(nodes))) == ["Running"]
    return handles


def test_the_first_group_waits_for_a_placed_worker_that_is_still_starting(tmp_path):
    """min_workers (2) ready and a third placed on its node but importing torch: the run
    forms with all three once it is ready, not with two and a resize right after."""
    ctrl, group = _controller(tmp_path)
    group.add_worker("na"), group.add_worker("nb")
    group.starting_count = 1
    for _ in range(20):
        ctrl.tick()
        assert isinstance(ctrl._state, Scheduling)
    group.starting_count = 0
    group.add_worker("nc")
    assert _tick_until(ctrl, _running(3)) == ["Running"]
    assert _events(tmp_path, ctrl, EventKind.RESIZE) == []


def test_node_loss_resizes_and_the_survivors_run_on(tmp_path):
    ctrl, group = _controller(tmp_path)
    a, b, c = _start(ctrl, group, ["na", "nb", "nc"])
    _tick_until(ctrl, lambda st: st.progress.reached() >= 5)
    group.lose_node("nc")

    assert _tick_until(ctrl, _running(2)) == ["Resizing", "Scheduling", "Running"]
    st = ctrl._state
    assert [m.wid for m in st.members] == [a.wid, b.wid]  # the survivors, warm, same ranks
    assert st.epoch == 2 and group.stop_calls == [False]  # aborted, not stopped gracefully
    lost = _events(tmp_path, ctrl, EventKind.WORKER_LOST)
    assert [(e["wid"], e["cause"]) for e in lost] == [(c.wid, "node_lost")]
    resize = _events(tmp_path, ctrl, EventKind.RESIZE)
    assert [r["graceful"] for r in resize] == [False]
    assert ctrl._counts.node_losses == 1 and ctrl._counts.errors == 0 and ctrl._recoveries == 1


def test_the_restore_plan_asks_the_survivors_what_they_hold_now(tmp_path):
    """The newest snapshot's peer copies finish after the last poll: the survivors' polled
    view says they hold only their own shards of it, but asked at planning time they cover
    it, and the next group restores it rather than the one before (a step less to redo)."""
    from raylastic._internal.protocol import Holdings

    ctrl, group = _controller(tmp_path)
    a, b, c = _start(ctrl, group, ["na", "nb", "nc"])
    _tick_until(ctrl, lambda st: st.progress.reached() >= 5)
    a.snapshots, a.stripes = [4, 5], {4: (3, (0, 2)), 5: (3, (0,))}  # as of the last poll
    b.snapshots, b.stripes = [4, 5], {4: (3, (0, 1)), 5: (3, (1,))}
    group.holdings_now = {a.wid: Holdings(snapshots=[4, 5], stripes={4: (3, (0, 2)), 5: (3, (0, 2))}),
                          b.wid: Holdings(snapshots=[4, 5], stripes={4: (3, (0, 1)), 5: (3, (0, 1))})}
    group.lose_node("nc")

    _tick_until(ctrl, _running(2))
    restore = group.worker(a).restores[-1]
    assert restore.memory_index == 5 and restore.index == 5
    assert [sorted(w) for w in group.refreshed] == [[a.wid, b.wid]]
    # a member that cannot answer keeps its polled view: the plan still runs on it
    group.holdings_now = {}
    a.snapshots, a.stripes = [7], {7: (2, (0, 1))}
    b.snapshots, b.stripes = [7], {7: (2, (0, 1))}
    group.lose_node("nb")
    group.add_worker("nd")
    _tick_until(ctrl, lambda st: isinstance(st, Running) and b not in st.members and len(st.members) == 2)
    assert group.worker(a).restores[-1].memory_index == 7


def test_preemption_notice_stops_every_rank_at_one_index_then_shrinks(tmp_path):
    ctrl, group = _controller(tmp_path)
    a, b, c = _start(ctrl, group, ["na", "nb", "nc"])
    _tick_until(ctrl, lambda st: st.progress.reached() >= 3)
    group.draining["nc"] = 0

    seen = _tick_until(ctrl, _running(2))
    assert seen == ["Resizing", "Scheduling", "Running"]
    stop_at = [e["stop_at"] for e in _events(tmp_path, ctrl, EventKind.DECISION) if e.get("decision") == "stop_at"]
    assert len(stop_at) == 1
    # every rank stopped right after the agreed report: the new group resumes there
    assert ctrl._state.members[0].wid == a.wid
    assert [group.worker(h).restores[-1].index for h in (a, b)] == [0, 0]  # nothing committed: fresh
    assert group.stop_calls == [True]
    lost = _events(tmp_path, ctrl, EventKind.WORKER_LOST)
    assert [(e["wid"], e["cause"]) for e in lost] == [(c.wid, "preempted")]
    assert ctrl._counts.node_losses == 0 and ctrl._recoveries == 0  # planned: not a failure


def test_workers_noticed_after_their_group_stopped_keep_the_newest_snapshot(tmp_path):
    """Notices a moment apart: the group stops for nc's, and na and nb are noticed while it
    stops. Their workers, idle now, hold the only copy of the newest in-memory snapshot:
    it is persisted before they go, and the next group restores it, not the start."""
    ctrl, group = _controller(tmp_path, min_w=1)
    a, b, c = _start(ctrl, group, ["na", "nb", "nc"])
    _tick_until(ctrl, lambda st: st.progress.reached() >= 3)
    group.draining["nc"] = 0
    _tick_until(ctrl, lambda st: isinstance(st, Resizing))
    group.draining.update(na=0, nb=0)
    _tick_until(ctrl, lambda st: isinstance(st, Scheduling))
    index = group.worker(a).index
    for h in (a, b):  # what their last polls said: whole copies of snapshot `index`
        h.snapshots = [index]
    d = group.add_worker("nd")

    _tick_until(ctrl, _running(1))
    assert group.persisted == [(a.wid, index)]
    assert [m.wid for m in ctrl._state.members] == [d.wid]
    restore = group.worker(d).restores[-1]
    assert restore.index == index and restore.checkpoint_rel.endswith(f"checkpoint_{index:08d}-e1")
    evacuated = [e for e in _events(tmp_path, ctrl, EventKind.DECISION) if e.get("decision") == "evacuate"]
    assert [e["index"] for e in evacuated] == [index]


def test_scale_up_waits_for_the_checkpoint_boundary_and_resumes_from_it(tmp_path):
    ctrl, group = _controller(tmp_path, group_kw={"checkpoint_every": 5})
    a, b = _start(ctrl, group, ["na", "nb"])
    _tick_until(ctrl, lambda st: len(ctrl._ckpt.committed) >= 2 and st.progress.reached() % 5 == 1)
    c = group.add_worker("nc")

    assert _tick_until(ctrl, _running(3)) == ["Resizing", "Scheduling", "Running"]
    stop_at = next(e["stop_at"] for e in _events(tmp_path, ctrl, EventKind.DECISION)
                   if e.get("decision") == "stop_at")
    assert stop_at % 5 == 0  # the next checkpoint boundary, so the new group redoes nothing
    assert group.worker(a).index == group.worker(b).index == stop_at
    restore = group.worker(c).restores[-1]
    assert restore.index == stop_at and restore.checkpoint_rel.endswith(f"checkpoint_{stop_at:08d}-e1")
    formed = _events(tmp_path, ctrl, EventKind.GROUP_FORMED)
    assert [e["world_size"] for e in formed] == [2, 3]
    resize = _events(tmp_path, ctrl, EventKind.RESIZE)[-1]
    assert resize["graceful"] and resize["lost_steps"] == 0


def test_rank_errors_are_retried_within_the_failure_budget_then_fail(tmp_path):
    ctrl, group = _controller(tmp_path, failure_config=FailureConfig(max_failures=1))
    a, b = _start(ctrl, group, ["na", "nb"])
    group.worker(b).raise_at = group.worker(b).index + 2

    assert _tick_until(ctrl, lambda st: isinstance(st, Running) and st.epoch == 2) == [
        "Running", "Resizing", "Scheduling", "Running"]
    assert ctrl._counts.errors == 1
    group.worker(b).raise_at = group.worker(b).index + 2
    assert _tick_until(ctrl, lambda st: isinstance(st, Errored)) == ["Running", "Errored"]
    err = ctrl._state.error
    assert isinstance(err, TrainingFailedError) and "rank 1" in str(err)
    failures = _events(tmp_path, ctrl, EventKind.FAILURE)
    assert [e["decision"] for e in failures] == ["Retry", "Raise"]


def test_a_storage_failure_ends_the_run_with_training_failed_error(tmp_path):
    ctrl, group = _controller(tmp_path, group_kw={"checkpoint_every": 5}, retry=RetryPolicy(max_attempts=1))
    blocked = os.path.join(str(tmp_path), RUN, "checkpoints", "checkpoint_00000010-e1")

    def block(rank, index):  # once checkpoint 5 is in, make checkpoint 10's manifest unwritable
        if index == 7 and not os.path.exists(blocked):
            with open(blocked, "w") as f:
                f.write("a file where the checkpoint directory must go")

    group.on_report = block
    for n in ("na", "nb"):
        group.add_worker(n)
    outcome = ctrl.run()

    err = outcome["error"]
    assert isinstance(err, TrainingFailedError)
    assert "could not write to the run's storage" in str(err) and "resume" in str(err)
    assert outcome["checkpoint_index"] == 5  # the last committed one survives
    assert isinstance(ctrl._state, Errored)


def _request_stop_when(ctrl: Controller, ready: Callable[[], bool]) -> dict:
    """Request a stop from another thread (like Ctrl-C reaching the actor) once
    ``ready()``; returns when it was requested."""
    out = {}

    def watch():
        deadline = time.monotonic() + 30
        while not ready() and time.monotonic() < deadline:
            time.sleep(0.005)
        out["at"] = time.monotonic()
        ctrl.request_stop()

    threading.Thread(target=watch, daemon=True).start()
    return out


def test_a_stop_request_ends_a_long_graceful_stop_between_ticks(tmp_path):
    ctrl, group = _controller(tmp_path)
    a, b, c = _start(ctrl, group, ["na", "nb", "nc"])
    for h in (a, b, c):
        group.worker(h).stalled = True  # a step that never ends: the stop index is never reached
    group.draining["nc"] = 0
    asked = _request_stop_when(ctrl, lambda: isinstance(ctrl._state, Resizing) and ctrl._state.stop is not None
                               and ctrl._state.stop.target is not None)
    outcome = ctrl.run()

    took = time.monotonic() - asked["at"]
    assert isinstance(outcome["error"], TrainingAborted)
    states = [e["state"] for e in _events(tmp_path, ctrl, EventKind.STATE)]
    assert states[-2:] == ["Resizing", "Errored"]  # ended in the middle of the stop
    # The stop had up to 35 s left (JOIN_TIMEOUT_S + margin); the request cut it short.
    assert took < 5.0, took


def test_a_stop_request_interrupts_a_blocking_group_call(tmp_path):
    ctrl, group = _controller(tmp_path)
    _start(ctrl, group, ["na", "nb", "nc"])
    group.block_stop = True  # stopping the survivors hangs until the controller is interrupted
    group.lose_node("nc")
    asked = _request_stop_when(ctrl, lambda: bool(group.stop_calls))
    outcome = ctrl.run()

    took = time.monotonic() - asked["at"]
    assert isinstance(outcome["error"], TrainingAborted)
    assert [e["decision"] for e in _events(tmp_path, ctrl, EventKind.DECISION)
            if e.get("decision") == "abort"] == ["abort"]
    assert took < 5.0, took  # the fake's call would have blocked 30 s


def test_run_finishes_when_every_rank_returns(tmp_path):
    ctrl, group = _controller(tmp_path, group_kw={"total": 20})
    for n in ("na", "nb"):
        group.add_worker(n)
    outcome = ctrl.run()

    assert outcome["error"] is None and outcome["return_value"] == {"rank": 0}
    assert outcome["world_sizes"] == [2]
    assert [e["state"] for e in _events(tmp_path, ctrl, EventKind.STATE)] == ["Running", "Finished"]
    assert isinstance(ctrl._state, Finished)


def test_a_group_stopped_before_its_first_report_records_no_first_step(tmp_path):
    """First-step events end recoveries in the report: one from a group that is being
    stopped (its first report arrives during the stop) would end a recovery that began
    after it. Only Running's polls record them."""
    ctrl, group = _controller(tmp_path)
    handles = _start(ctrl, group, ["na", "nb", "nc"])
    for h in handles:
        group.worker(h).stalled = True  # no report yet when the notice comes
    group.draining["nc"] = 0
    _tick_until(ctrl, lambda st: isinstance(st, Resizing) and st.stop is not None and st.stop.target is not None)
    for h in handles:
        group.worker(h).stalled = False  # the first reports arrive during the stop
    _tick_until(ctrl, lambda st: isinstance(st, Running) and st.progress.first_step_seen)

    firsts = _events(tmp_path, ctrl, EventKind.FIRST_STEP)
    assert [e["epoch"] for e in firsts] == [2]


def test_a_node_lost_while_the_group_starts_is_a_node_loss(tmp_path):
    ctrl, group = _controller(tmp_path)
    for n in ("na", "nb", "nc"):
        group.add_worker(n)
    group.lose_on_start = "nc"  # its start() call fails; the others entered the train function

    assert _tick_until(ctrl, lambda st: isinstance(st, Running) and st.epoch == 2) == [
        "Running", "Resizing", "Scheduling", "Running"]
    assert len(ctrl._state.members) == 2
    lost = _events(tmp_path, ctrl, EventKind.WORKER_LOST)
    assert [e["cause"] for e in lost] == ["node_lost"]
    assert ctrl._counts.node_losses == 1 and ctrl._counts.errors == 0


def test_a_node_lost_while_a_graceful_stop_is_agreed_is_a_node_loss(tmp_path):
    ctrl, group = _controller(tmp_path, min_w=1)
    a, b, c = _start(ctrl, group, ["na", "nb", "nc"])
    group.draining["nc"] = 0
    group.lose_on_request_stop = "nb"  # gone between the stop's first poll and its request

    seen = _tick_until(ctrl, lambda st: isinstance(st, Running) and st.epoch == 2)
    assert seen == ["Resizing", "Scheduling", "Running"]
    assert [m.wid for m in ctrl._state.members] == [a.wid]  # nc is draining: not taken again
    lost = _events(tmp_path, ctrl, EventKind.WORKER_LOST)
    assert [(e["wid"], e["cause"]) for e in lost] == [(b.wid, "node_lost")]
    assert [e["graceful"] for e in _events(tmp_path, ctrl, EventKind.RESIZE)] == [False]
    assert ctrl._counts.node_losses == 1


def test_a_stop_no_rank_can_agree_on_aborts_at_once_instead_of_waiting_out_its_deadline(tmp_path):
    """A rank that refuses every proposed stop index (it stopped at an earlier one, or runs
    ahead of each): the group is aborted at the next tick, not after the stop's 30 s+."""
    ctrl, group = _controller(tmp_path)
    a, b, c = _start(ctrl, group, ["na", "nb", "nc"])
    _tick_until(ctrl, lambda st: st.progress.reached() >= 3)
    group.worker(b).refuses_stops = True
    group.draining["nc"] = 0

    t0 = time.monotonic()
    seen = _tick_until(ctrl, _running(2))
    assert time.monotonic() - t0 < 10  # the stop's own deadline is JOIN_TIMEOUT_S (30 s) on
    assert seen == ["Resizing", "Scheduling", "Running"]
    decisions = [e["decision"] for e in _events(tmp_path, ctrl, EventKind.DECISION)]
    assert "abort" in decisions and "stop_at" not in decisions
    assert [e["graceful"] for e in _events(tmp_path, ctrl, EventKind.RESIZE)] == [True]


def _late_checkpoint_then_errors(tmp_path, late_polls):
    """Two ranks; rank 0 checkpoints every 2 reports. Rank 0's checkpoint of report ``n``
    reaches the controller ``late_polls`` polls late (its upload still running) while
    rank 1 raises right after report ``n`` and rank 0 one report later."""
    ctrl, group = _controller(tmp_path, group_kw={"checkpoint_every": 2}, min_w=2, max_w=2)
    a, b = _start(ctrl, group, ["na", "nb"])
    _tick_until(ctrl, lambda st: st.progress.reached() >= 3)
    n = group.worker(a).index + 4 - group.worker(a).index % 2  # an even report (a checkpoint) ahead
    group.worker(a).late_checkpoints = late_polls
    group.worker(b).raise_at = n + 1
    group.worker(a).raise_at = n + 2
    return ctrl, group, n


def test_a_checkpoint_reported_before_a_rank_raised_commits_before_the_run_fails(tmp_path):
    """Rank 1 raises right after report n; rank 0's checkpoint of n is still uploading: the
    controller collects the others' reports for a moment before failing the run, so the
    checkpoint commits (as in Ray Train, whose report() returns once it is registered),
    and rank 0's error, raised meanwhile, is in the run's error too."""
    ctrl, group, n = _late_checkpoint_then_errors(tmp_path, late_polls=4)
    assert _tick_until(ctrl, lambda st: isinstance(st, Errored)) == ["Running", "Errored"]
    assert ctrl._ckpt.latest().index == n
    err = ctrl._state.error
    assert isinstance(err, TrainingFailedError) and "rank 0" in str(err) and "rank 1" in str(err)
    committed = [e["index"] for e in _events(tmp_path, ctrl, EventKind.CHECKPOINT_COMMITTED)]
    assert committed[-1] == n


def test_the_wait_for_the_last_reports_after_an_error_is_bounded(tmp_path, monkeypatch):
    from raylastic._internal.controller import failure_steps

    monkeypatch.setattr(failure_steps, "LAST_REPORTS_GRACE_S", 0.3)
    ctrl, group, n = _late_checkpoint_then_errors(tmp_path, late_polls=10 ** 9)  # never arrives
    start = time.monotonic()
    assert _tick_until(ctrl, lambda st: isinstance(st, Errored)) == ["Running", "Errored"]
    assert time.monotonic() - start < 5
    assert ctrl._ckpt.latest() is None or ctrl._ckpt.latest().index < n


@pytest.mark.parametrize("message, grace", [
    ("ValueError: bad batch", 1.0),  # a lost peer does not raise this: the error surfaces at once
    ("RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer", 5.0),
    ("DistBackendError: NCCL communicator was aborted", 5.0),
])
def test_a_plain_error_is_not_held_for_the_full_dead_peer_grace(tmp_path, message, grace):
    from raylastic._internal.controller.running_steps import ERROR_CLASSIFY_GRACE_S, PLAIN_ERROR_GRACE_S

    assert (PLAIN_ERROR_GRACE_S, ERROR_CLASSIFY_GRACE_S) == (1.0, 5.0)
    ctrl, group = _controller(tmp_path, min_w=2, max_w=2)
    a, b = _start(ctrl, group, ["na", "nb"])
    group.worker(b).raise_at, group.worker(b).raise_message = group.worker(b).index + 2, message
    assert _tick_until(ctrl, lambda st: isinstance(st, Errored))[-1] == "Errored"
    assert group.dead_peer_graces == [grace]
    # a peer that only does not answer is dead after an error a lost peer causes, not after
    # a plain one: on a busy machine a live peer can take over the 1 s to answer
    assert group.dead_peer_silent == [grace == ERROR_CLASSIFY_GRACE_S]
    assert message.partition(":")[2].strip() in str(ctrl._state.error)



def test_after_a_plain_error_only_a_peer_ray_says_is_dead_counts():
    """``WorkerGroup.wait_for_dead_peer`` itself, its probe stubbed: a silent peer (no answer
    within the probe's timeout) counts only when asked; one Ray says is dead counts always."""
    from types import SimpleNamespace

    from ray.exceptions import ActorDiedError

    from raylastic._internal.worker_group.group import WorkerGroup

    group = WorkerGroup(pool=None, poll_interval_s=0.1)  # type: ignore[arg-type]
    peers = [SimpleNamespace(wid=1), SimpleNamespace(wid=2)]
    died = ActorDiedError()
    probes = []

    def probe(handles, timeout_s):
        probes.append(timeout_s)
        return {1: None}  # wid 1 did not answer in time; wid 2 answered

    group.probe = probe  # type: ignore[method-assign]
    assert group.wait_for_dead_peer(peers, 0.3, silent_is_dead=True) == {1: None}
    assert len(probes) == 1  # found at the first probe
    start = time.monotonic()
    assert group.wait_for_dead_peer(peers, 0.3, silent_is_dead=False) == {}
    assert time.monotonic() - start >= 0.3 and len(probes) > 2  # probed until the grace ran out
    group.probe = lambda handles, timeout_s: {1: None, 2: died}  # type: ignore[method-assign]
    assert group.wait_for_dead_peer(peers, 0.3, silent_is_dead=False) == {2: died}
