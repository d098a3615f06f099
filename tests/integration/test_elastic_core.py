"""ElasticTrainer end to end on a real local multi-node Ray cluster (gloo on CPU).

One cluster (head without CPUs + 3 one-CPU worker nodes) serves the module; tests that
remove nodes put them back. Faults land at report indices read from the run's own
files; every wait is bounded.
"""

import json
import os
import signal
import time

import pytest
import ray

from raylastic import (
    CheckpointConfig, ConfigError, ElasticTrainer, FailureConfig, InsufficientCapacityError,
    RunConfig, RunInUseError, ScalingConfig, TrainingFailedError,
)
from raylastic._internal.worker_group.keeper import end_kept_workers
from raylastic._internal.worker_group.pool import count_placed
from raylastic.events import EventKind, load_events
from raylastic.testing.cluster import wait_until
from raylastic.testing.faults import FitThread, RunWatcher, hung_replacements, kill_node_at, kill_worker_process
from raylastic.testing.train_funcs import ddp_regression

pytestmark = pytest.mark.timeout(300)


def _trainer(run_dir, name, cfg, min_w=2, max_w=3, **run_kw):
    return ElasticTrainer(
        ddp_regression, train_loop_config=cfg,
        scaling_config=ScalingConfig(min_workers=min_w, max_workers=max_w),
        run_config=RunConfig(name=name, storage_path=run_dir, verbose=False, **run_kw),
    )


def _actor_count():
    from ray._private.state import actors  # GCS view; needs no dashboard

    return len([a for a in actors().values() if a["State"] != "DEAD"])


def test_node_loss_shrinks_then_grows_back_and_resumes(local_cluster, restore_nodes, run_dir):
    regrown = os.path.join(run_dir, "loss-regrown")  # the group of 3 after it does not sleep (pace.py)
    starts = os.path.join(run_dir, "loss-starts.jsonl")
    cfg = {"total_steps": 150, "checkpoint_every": 5, "step_sleep_s": 0.05, "regrown_flag": regrown,
           "start_log": starts}
    trainer = _trainer(run_dir, "loss", cfg, checkpoint_config=CheckpointConfig(num_to_keep=3))
    th = FitThread(trainer)
    th.start()
    w = RunWatcher(os.path.join(run_dir, "loss"))
    killed = kill_node_at(local_cluster, w, 12)
    w.wait_for_event(EventKind.FIRST_STEP, 90, count=2)
    local_cluster.add_node()
    open(regrown, "w").close()
    result = th.wait(240)

    assert result.error is None
    assert result.world_sizes == [3, 2, 3]
    assert result.metrics["step"] == 150
    assert result.return_value == {"rank": 0, "final_step": 150}
    events = load_events(result.path)
    lost = [e for e in events if e["kind"] == "worker_lost" and e["cause"] != "hung"]
    assert [(e["node_id"], e["cause"]) for e in lost] == [(killed, "node_lost")]
    # The abort frees survivors blocked in a collective (test below); one stuck where no
    # abort reaches it is replaced on its node, the bounded fallback (warned with its stack).
    assert all(e["node_id"] != killed for e in hung_replacements(events))
    # The shrunk group resumed from the last checkpoint committed before the loss.
    resize = next(e for e in events if e["kind"] == "resize" and not e["graceful"])
    committed_before = [e["index"] for e in events
                        if e["kind"] == "checkpoint_committed" and e["ts"] <= resize["ts"]]
    assert resize["restore_index"] == max(committed_before)
    assert resize["restore_index"] % 5 == 0 and resize["lost_steps"] < 5 + 3
    # Metrics cover every step once per group; steps after the restore point re-run.
    steps = [m["index"] for m in w.metrics()]
    assert set(steps) == set(range(1, 151))
    # Survivors were reused (warm), not recreated: only the lost worker got replaced.
    formed = [e for e in events if e["kind"] == "group_formed"]
    assert set(formed[1]["nodes"]) < set(formed[0]["nodes"])
    assert killed not in formed[2]["nodes"]
    # The worker added at the scale-up imported torch._dynamo (which every optimizer's
    # constructor imports: 1.3 s) before it was ready, as the survivors had, not with the
    # group waiting for its first step (warm_imports.py).
    with open(starts) as f:
        lines = [json.loads(x) for x in f]
    last = max(x["epoch"] for x in lines)
    earlier = {x["pid"] for x in lines if x["epoch"] < last}
    added = [x for x in lines if x["epoch"] == last and x["pid"] not in earlier]
    assert added and all(x["dynamo"] for x in added), lines


def test_survivors_stuck_in_a_collective_are_freed_by_the_abort_and_reused(
        local_cluster, restore_nodes, run_dir):
    """gloo cannot abort an operation in flight, and a survivor blocked on another
    survivor never sees the loss: rank 0 waits in a receive from rank 1, ranks 1 and 2
    in the next all-reduce, when rank 2's node is lost. The controller's abort shuts the
    group's connections down, so both survivors unwind at once and train on, warm, in
    the next group (without it they would wait for the 60 s group timeout or be
    replaced)."""
    cfg = {"total_steps": 40, "checkpoint_every": 5, "step_sleep_s": 0.05, "stuck_rank0_at": 15}
    trainer = _trainer(run_dir, "stuck", cfg)
    th = FitThread(trainer)
    th.start()
    w = RunWatcher(os.path.join(run_dir, "stuck"))
    killed = kill_node_at(local_cluster, w, 14)  # rank 0 is (about to be) stuck at step 15
    t_kill = time.time()
    result = th.wait(180)

    assert result.error is None and result.metrics["step"] == 40
    events = load_events(result.path)
    lost = [e for e in events if e["kind"] == "worker_lost"]
    assert [(e["node_id"], e["cause"]) for e in lost] == [(killed, "node_lost")], [e["message"] for e in lost]
    formed = [e for e in events if e["kind"] == "group_formed"]
    assert formed[1]["world_size"] == 2 and set(formed[1]["nodes"]) < set(formed[0]["nodes"])
    assert set(formed[1]["pids"]) < set(formed[0]["pids"])  # the same processes: reused
    assert formed[1]["ts"] - t_kill < 30, formed[1]["ts"] - t_kill  # the group timeout is 60 s


def test_survivor_hung_in_its_own_code_is_replaced_without_waiting_for_the_timeout(
        local_cluster, restore_nodes, run_dir):
    """No abort reaches a train function stuck outside any collective (here rank 0 hangs
    in its own code while the others wait for it in the all-reduce). When the last
    rank's node is lost, the controller replaces rank 0 after max(5 s, 3 steps) and
    training goes on from the last checkpoint."""
    cfg = {"total_steps": 40, "checkpoint_every": 5, "step_sleep_s": 0.05, "hang_rank0_at": 15}
    trainer = _trainer(run_dir, "hang", cfg)
    th = FitThread(trainer)
    th.start()
    w = RunWatcher(os.path.join(run_dir, "hang"))
    killed = kill_node_at(local_cluster, w, 14)
    t_kill = time.time()
    result = th.wait(180)

    events = load_events(result.path)
    hung = [e for e in events if e["kind"] == "worker_lost" and e.get("cause") == "hung"]
    assert [e["rank"] for e in hung] == [0], [e["message"] for e in events if e["kind"] == "worker_lost"]
    # The event says where it was stuck: its abort's result and its train thread's stack.
    assert "abort shut" in hung[0]["stuck_at"] and "_maybe_hang" in hung[0]["stuck_at"], hung[0]
    formed = [e for e in events if e["kind"] == "group_formed"]
    assert formed[1]["world_size"] == 2 and killed not in formed[1]["nodes"]
    assert formed[1]["ts"] - t_kill < 30, formed[1]["ts"] - t_kill  # the group timeout is 60 s
    assert result.metrics["step"] == 40


def test_starts_with_min_workers_when_max_is_not_available(local_cluster, run_dir):
    # 3 nodes, max 5: start at 3 at once instead of waiting for 5.
    result = _trainer(run_dir, "partial", {"total_steps": 5}, min_w=2, max_w=5).fit()
    assert result.world_sizes == [3]
    assert result.metrics["world_size"] == 3


def test_placed_workers_still_starting_are_told_from_ones_waiting_for_a_node(local_cluster, tmp_path):
    """What the first group waits for besides ready workers (``pool.count_placed``): of 4
    one-CPU actors on 3 one-CPU nodes, the 3 placed ones still in their constructor count,
    the one no node can take does not, and none counts once the others are alive."""
    end_kept_workers()  # they hold the nodes' CPUs
    gate = tmp_path / "go"

    @ray.remote(num_cpus=1)
    class Starting:
        def __init__(self, gate):  # a worker importing torch, held until the test says go
            deadline = time.monotonic() + 60
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.05)

        def ready(self):
            return True

    actors = [Starting.remote(str(gate)) for _ in range(4)]
    ids = {a._actor_id.hex() for a in actors}
    try:
        wait_until(lambda: count_placed(ids) == 3, 60, what="3 actors placed and starting")
        assert count_placed(ids) == 3  # the fourth has no node to start on
        gate.touch()
        ready, _ = ray.wait([a.ready.remote() for a in actors], num_returns=3, timeout=60)
        assert len(ready) == 3
        assert count_placed(ids) == 0  # 3 alive, 1 with no node
    finally:
        for a in actors:
            ray.kill(a, no_restart=True)


def test_real_failures_use_the_failure_budget(local_cluster, run_dir):
    cfg = {"total_steps": 12, "fail_at_step": 6, "fail_rank": 1}
    with pytest.raises(TrainingFailedError) as e:
        _trainer(run_dir, "fail0", cfg, failure_config=FailureConfig(max_failures=0)).fit()
    text = str(e.value)
    assert "max_failures=0" in text and "[rank 1]: error: ValueError: injected failure at step 6" in text
    assert e.value.failures[0].traceback  # the user's traceback travels with it

    result = _trainer(run_dir, "fail1", cfg, failure_config=FailureConfig(max_failures=1)).fit()
    assert result.metrics["step"] == 12 and result.restarts == 1
    assert result.world_sizes == [3, 3]


def test_crashed_worker_process_counts_as_a_failure(local_cluster, run_dir):
    cfg = {"total_steps": 400, "step_sleep_s": 0.05, "checkpoint_every": 5}
    th = FitThread(_trainer(run_dir, "crash", cfg, failure_config=FailureConfig(max_failures=0)))
    th.start()
    w = RunWatcher(os.path.join(run_dir, "crash"))
    w.wait_for_index(5, 120)
    kill_worker_process(w.current_group()["pids"][1])
    with pytest.raises(TrainingFailedError, match="max_failures=0"):
        th.wait(120)


def test_bad_input_rejected_before_any_actor(local_cluster, run_dir):
    before = _actor_count()
    with pytest.raises(ConfigError, match="no node in the cluster offers"):
        ElasticTrainer(ddp_regression, scaling_config=ScalingConfig(resources_per_worker={"CPU": 1, "tpu_v9": 1}),
                       run_config=RunConfig(storage_path=run_dir)).fit()
    import threading

    lock = threading.Lock()
    with pytest.raises(ConfigError, match="train_loop_config cannot be pickled"):
        ElasticTrainer(ddp_regression, train_loop_config={"lock": lock})
    with pytest.raises(ConfigError, match="train_func must be a callable"):
        ElasticTrainer(42)  # type: ignore[arg-type]
    assert _actor_count() == before


def test_a_local_storage_path_other_hosts_do_not_share_is_refused(local_cluster, run_dir, monkeypatch):
    """Each node would write its own disk. The cluster's nodes all share this machine's
    disk, so two of them are presented as two hosts and one sees a stale copy of the run
    (another token), as a node with its own disk at the same path would."""
    from raylastic._internal.cluster import shared_storage

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]][:2]
    monkeypatch.setattr(shared_storage, "hosts_by_ip", lambda: {"10.0.0.1": nodes[0], "10.0.0.2": nodes[1]})
    lease = os.path.join(run_dir, "probe.json")
    with open(lease, "w") as fh:
        fh.write('{"token": "from-another-disk"}')
    shared_storage.check_shared(lease, "from-another-disk", run_dir)  # every host sees the same file
    with pytest.raises(ConfigError, match=r"RunConfig.storage_path=.*10\.0\.0\.1, 10\.0\.0\.2 do not share"):
        shared_storage.check_shared(lease, "the-driver's-token", run_dir)
    before = _actor_count()
    with pytest.raises(ConfigError, match="do not share"):  # fit() refuses before any actor
        monkeypatch.setattr(shared_storage, "_read_token", lambda path: "stale")
        _trainer(run_dir, "unshared", {"total_steps": 3}).fit()
    assert _actor_count() == before


def test_ray_trains_shipped_linear_example_runs_unchanged(local_cluster, run_dir):
    from ray.train.examples.pytorch.torch_linear_example import train_func

    result = ElasticTrainer(
        train_func, train_loop_config={"lr": 1e-2, "hidden_size": 1, "batch_size": 4, "epochs": 3},
        scaling_config=ScalingConfig(min_workers=2, max_workers=3),
        run_config=RunConfig(name="linear", storage_path=run_dir, verbose=False),
    ).fit()
    assert result.error is None
    assert len(result.return_value) == 3 and result.return_value[-1]["loss"] < result.return_value[0]["loss"]
    assert result.checkpoint is not None
    with result.checkpoint.as_directory() as d:
        assert os.path.exists(os.path.join(d, "model.pt"))


def test_fit_again_resumes_from_the_last_committed_checkpoint(local_cluster, run_dir):
    """A second fit() of a run that is still training is refused at once (the run lease)
    and touches nothing; once the first is done, fit() resumes it, numbering its groups
    after the first's."""
    fit = FitThread(_trainer(run_dir, "again", {"total_steps": 12, "step_sleep_s": 0.1}))
    fit.start()
    RunWatcher(os.path.join(run_dir, "again")).wait_for_index(3, 120)
    ckpts = os.path.join(run_dir, "again", "checkpoints")
    before = sorted(os.listdir(ckpts))
    t0 = time.monotonic()
    with pytest.raises(RunInUseError, match="is in use") as refused:
        _trainer(run_dir, "again", {"total_steps": 9}).fit()
    assert time.monotonic() - t0 < 5.0
    assert "pid=" in refused.value.holder
    assert set(before) <= set(os.listdir(ckpts))  # nothing of the first run's was touched
    first = fit.wait(120)
    assert first.metrics["step"] == 12
    first_epochs = [e["epoch"] for e in load_events(first.path) if e["kind"] == "group_formed"]
    second = _trainer(run_dir, "again", {"total_steps": 15}).fit()
    events = load_events(second.path)
    restored = [e for e in events if e["kind"] == "checkpoint_restored"]
    assert restored and restored[-1]["index"] == 12
    assert second.metrics["step"] == 15
    epochs = [e["epoch"] for e in events if e["kind"] == "group_formed"]
    assert epochs[len(first_epochs):][0] == max(first_epochs) + 1, epochs  # never restarts at 1
    assert ray.is_initialized()


def test_a_node_added_leaves_the_callers_sigterm_handler_in_place(local_cluster, restore_nodes):
    """Every Ray node made in the driver installs Ray's SIGTERM handler (drain up to 30 s,
    then exit), which took over the benchmarks' own: under `timeout -k 10` a run was
    SIGKILLed before it wrote its results. ``LocalCluster`` puts the caller's back."""
    def mine(signum, frame):  # never called: only its registration is checked
        raise AssertionError("SIGTERM")

    before = signal.signal(signal.SIGTERM, mine)
    try:
        node = local_cluster.add_node()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
    local_cluster.remove_node(node)


def test_capacity_wait_is_bounded(local_cluster, run_dir):
    end_kept_workers()  # the suite keeps workers between runs (tests/conftest.py)
    before = _actor_count()
    trainer = ElasticTrainer(
        ddp_regression, train_loop_config={"total_steps": 2},
        scaling_config=ScalingConfig(min_workers=5, max_workers=5, max_wait_s=3, keep_workers_s=0),
        run_config=RunConfig(name="short", storage_path=run_dir, verbose=False),
    )
    with pytest.raises(InsufficientCapacityError, match="min_workers=5"):
        trainer.fit()
    assert _actor_count() == before


def _train_workers() -> int:
    from ray._private.state import actors

    return len([a for a in actors().values() if a["ActorClassName"] == "TrainWorker" and a["State"] != "DEAD"])


def test_kept_workers_serve_the_next_fit_then_end(local_cluster, run_dir):
    """keep_workers_s: the next fit() takes the workers the last one ended with (the same
    processes, released from their run: the second run trains from scratch, as the first
    did), and they end once kept that long. With 0 they end with the run. (Near the end of
    the module: the tests after it find no kept workers.)"""
    def fit(name, keep_s):
        result = ElasticTrainer(
            ddp_regression, train_loop_config={"total_steps": 6},
            scaling_config=ScalingConfig(min_workers=3, max_workers=3, keep_workers_s=keep_s),
            run_config=RunConfig(name=name, storage_path=run_dir, verbose=False),
        ).fit()
        assert result.error is None and result.metrics["step"] == 6 and result.world_sizes == [3]
        group = [e for e in load_events(result.path) if e["kind"] == "group_formed"]
        assert [e["restore_index"] for e in group] == [0]  # nothing of the earlier run came along
        return sorted(group[0]["pids"]), result.metrics["loss"]

    end_kept_workers()
    first, loss = fit("keep-a", 4.0)
    assert _train_workers() == 3  # kept, idle
    again, loss_again = fit("keep-b", 4.0)
    assert again == first and loss_again == loss
    wait_until(lambda: _train_workers() == 0, 30, what="kept workers to end after keep_workers_s=4")
    fresh, _ = fit("keep-c", 0)
    assert not set(fresh) & set(first)
    assert _train_workers() == 0


_CTRL_C_SCRIPT = '''
import sys
import ray
from raylastic import ElasticTrainer, RunConfig, ScalingConfig
from raylastic.testing.train_funcs import ddp_regression

ray.init(address=sys.argv[1])
trainer = ElasticTrainer(
    ddp_regression,
    # rank 0 hangs at step 30 (in its own code): a stop at any later report never completes
    train_loop_config={"total_steps": 100000, "checkpoint_every": 1000, "step_sleep_s": 0.05,
                       "hang_rank0_at": 30},
    scaling_config=ScalingConfig(min_workers=2, max_workers=3),
    run_config=RunConfig(name="ctrlc", storage_path=sys.argv[2], verbose=False))
try:
    trainer.fit()
except KeyboardInterrupt:
    print("FIT_INTERRUPTED", flush=True)
    sys.exit(130)
'''


def test_ctrl_c_is_seen_within_a_second_during_a_graceful_stop(local_cluster, restore_nodes, run_dir, tmp_path):
    """A real SIGINT to the driver while a graceful stop (a preemption notice) waits for
    ranks that cannot reach the stop index: the run ends at once with TrainingAborted
    instead of after the stop's 35 s bound, and the driver exits."""
    import signal
    import subprocess
    import sys

    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    script = tmp_path / "ctrlc.py"
    script.write_text(_CTRL_C_SCRIPT)
    end_kept_workers()  # another driver's run: the workers this one keeps would hold the nodes
    # SIGINT's default disposition in the driver, as in a terminal: a suite started in the
    # background by a non-interactive shell (`make test &`) inherits SIGINT ignored, and a
    # Python started with SIGINT ignored never raises KeyboardInterrupt.
    proc = subprocess.Popen([sys.executable, str(script), local_cluster.address, run_dir],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    victim = None
    try:
        w = RunWatcher(os.path.join(run_dir, "ctrlc"))
        w.wait_for_index(25, 120)  # rank 0 never reports 30
        victim = w.current_group()["nodes"][-1]
        GcsClient(address=local_cluster.address).drain_node(
            victim, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
            "spot reclaim (test)", int((time.time() + 60) * 1000))
        w.wait_for_event(EventKind.DECISION, 60, where=lambda e: e.get("decision") == "stop_at")
        sigint_at = time.time()
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        if victim is not None:
            local_cluster.remove_node(local_cluster.node_by_id(victim))  # the cloud takes it
    assert proc.returncode == 130 and "FIT_INTERRUPTED" in out, out[-4000:]
    events = load_events(os.path.join(run_dir, "ctrlc"))
    failed = [e for e in events if e["kind"] == EventKind.RUN_FAILED.value]
    assert [e["error"] for e in failed] == ["TrainingAborted"], failed
    # No group formed after the notice: the stop was cut short, not finished.
    assert [e["kind"] for e in events].count(EventKind.GROUP_FORMED.value) == 1
    # Seen within a second of the signal (plus the driver's own hand-over; the stop it
    # interrupted had 35 s left).
    assert failed[0]["ts"] - sigint_at < 5.0, failed[0]["ts"] - sigint_at
