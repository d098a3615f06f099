"""In-place recovery from in-memory ElasticState snapshots, and zero lost steps on a
preemption notice (a Ray node drain with a deadline), on a real local cluster."""

import os
import time

import pytest

from raylastic import CheckpointConfig, ElasticTrainer, RunConfig, ScalingConfig
from raylastic.events import EventKind, load_events
from raylastic.testing.faults import FitThread, RunWatcher, hung_replacements, kill_node_at
from raylastic.testing.train_funcs import mlp_bench

pytestmark = pytest.mark.timeout(300)


def _start(run_dir, name, tmp_path, min_workers=2, persist_every=50, max_failures=0, **cfg_extra):
    """mlp_bench with ElasticState on 2-3 workers; touch the returned path to stop it."""
    from raylastic import FailureConfig

    stop = tmp_path / f"stop-{name}"
    cfg = {"elastic_state": True, "hidden": 256, "layers": 3, "stop_path": str(stop), **cfg_extra}
    trainer = ElasticTrainer(
        mlp_bench, train_loop_config=cfg,
        scaling_config=ScalingConfig(min_workers=min_workers, max_workers=3),
        run_config=RunConfig(name=name, storage_path=run_dir, verbose=False, progress=False,
                             failure_config=FailureConfig(max_failures=max_failures),
                             checkpoint_config=CheckpointConfig(persist_every=persist_every, num_to_keep=2)),
    )
    th = FitThread(trainer)
    th.start()
    return th, RunWatcher(os.path.join(run_dir, name)), stop


def test_node_loss_restores_from_peer_memory_and_new_worker_gets_state(local_cluster, restore_nodes,
                                                                       run_dir, tmp_path):
    th, w, stop = _start(run_dir, "mem", tmp_path)
    kill_node_at(local_cluster, w, 60)
    w.wait_for_event(EventKind.FIRST_STEP, 60, count=2)
    local_cluster.add_node()
    w.wait_for_event(EventKind.GROUP_FORMED, 90, count=3)
    w.wait_for_event(EventKind.FIRST_STEP, 60, count=3)
    stop.touch()
    result = th.wait(120)
    assert result.world_sizes == [3, 2, 3]
    events = load_events(result.path)
    restored = [e for e in events if e["kind"] == "checkpoint_restored"]
    assert [e["source"] for e in restored] == ["memory", "memory"]
    # 3 workers: each held 2 of the 3 shards; the 2 survivors' shards made the whole state.
    # (The abort frees a survivor blocked in a collective; one stuck where no abort reaches
    # it is replaced, its shards first moved to the other survivor, which then holds all
    # of it: an `evacuate` decision. hung_replacements warns with where it was stuck.)
    # (Or the restore point is a persisted snapshot, which rank 0 copies whole, and rank 0
    # survived: seen once, the node lost at report 97 and the restore at 100, persist_every=50.)
    formed = [e for e in events if e["kind"] == "group_formed"]
    assert [len(s) for s in formed[0]["stripes"]] == [2, 2, 2]
    whole_on_rank0 = restored[0]["index"] % 50 == 0 and formed[0]["nodes"][0] in formed[1]["nodes"]
    hung = hung_replacements(events)
    rescued = [e for e in events if e["kind"] == "decision" and e.get("decision") == "evacuate"]
    assert rescued or not hung or whole_on_rank0, (rescued, hung)
    assert restored[0]["broadcast"] is True and (restored[0]["striped"] or rescued or whole_on_rank0), \
        (restored, rescued)
    assert restored[1]["broadcast"] is True  # the new worker received the state from the others
    loss_resize = next(e for e in events if e["kind"] == "resize" and not e["graceful"])
    assert loss_resize["lost_steps"] <= 1, loss_resize
    grow = next(e for e in events if e["kind"] == "resize" and e["graceful"])
    assert grow["lost_steps"] == 0
    steps = [m["metrics"]["step"] for m in w.metrics()]
    assert steps == sorted(steps) or len(set(steps)) >= max(steps) - 1


def test_preemption_notice_shrinks_with_zero_lost_steps(local_cluster, restore_nodes, run_dir, tmp_path):
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    th, w, stop = _start(run_dir, "drain", tmp_path)
    w.wait_for_index(40, 120)
    victim = w.current_group()["nodes"][-1]
    deadline_ms = int((time.time() + 20) * 1000)
    GcsClient(address=local_cluster.address).drain_node(
        victim, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot reclaim (test)", deadline_ms)
    notice = w.wait_for_event(EventKind.PREEMPTION_NOTICE, 30)
    formed = w.wait_for_event(EventKind.GROUP_FORMED, 60, where=lambda e: e["ts"] > notice["ts"])
    assert victim not in formed["nodes"] and formed["world_size"] == 2
    assert time.time() * 1000 < deadline_ms  # moved off before the deadline
    local_cluster.remove_node(local_cluster.node_by_id(victim))  # the cloud takes it
    w.wait_for_event(EventKind.FIRST_STEP, 60, where=lambda e: e["ts"] > formed["ts"])
    stop.touch()
    result = th.wait(120)
    events = load_events(result.path)
    resize = next(e for e in events if e["kind"] == "resize" and e["ts"] > notice["ts"])
    assert resize["graceful"] and resize["lost_steps"] == 0, resize
    assert notice["nodes"] == [victim]
    assert not [e for e in events if e["kind"] == "failure"]  # no failure: a planned move


def test_a_snapshot_that_does_not_fit_falls_back_to_storage_with_a_clear_error(
        local_cluster, restore_nodes, run_dir, tmp_path):
    """The train function builds a model whose width depends on the world size, so after
    a node loss the survivors' in-memory snapshot does not fit: the controller says so
    (checkpoint_invalid, source memory) without counting a failure and restarts the group
    from the last committed checkpoint. That one was written at the old world size too,
    so loading it fails: the run ends with an error naming the object that did not fit."""
    from raylastic import TrainingFailedError

    th, w, _stop = _start(run_dir, "mismatch", tmp_path, persist_every=10, hidden_per_worker=32, layers=2)
    w.wait_for_event(EventKind.CHECKPOINT_COMMITTED, 120)
    kill_node_at(local_cluster, w, w.last_index() + 5)
    with pytest.raises(TrainingFailedError) as info:
        th.wait(180)
    events = load_events(os.path.join(run_dir, "mismatch"))
    invalid = [e for e in events if e["kind"] == "checkpoint_invalid" and e.get("source") == "memory"]
    assert len(invalid) == 1, [e["kind"] for e in events]
    assert "does not fit" in invalid[0]["reason"] and "model" in invalid[0]["reason"]
    assert invalid[0]["fallback_index"] is not None
    after = [e for e in events if e["ts"] > invalid[0]["ts"]]
    restored = next(e for e in after if e["kind"] == "checkpoint_restored")
    assert restored["source"] == "storage" and restored["index"] == invalid[0]["fallback_index"]
    text = str(info.value)
    assert "cannot restore model" in text and "does not fit" in text, text
    # the snapshot mismatch itself was not a failure: only the node loss and the storage load
    kinds = [e["failure_kind"] for e in events if e["kind"] == "failure"]
    assert kinds == ["node_lost", "error"], kinds


def test_losing_a_worker_and_its_snapshot_peer_falls_back_to_storage_and_says_so(
        local_cluster, restore_nodes, run_dir, tmp_path):
    """With 3 workers each holds 2 of the 3 shards of every snapshot (striped
    replication). Killing two at once leaves one stripe: not the whole state. The group
    restores from the last persisted checkpoint and the event log says why. Ranks 0 and 1
    are killed: rank 0 copies the whole state for the snapshots it persists, so with it
    alive some restore points would be whole."""
    from raylastic.testing.faults import kill_worker_process

    th, w, stop = _start(run_dir, "peers", tmp_path, min_workers=1, persist_every=20, max_failures=2)
    w.wait_for_event(EventKind.CHECKPOINT_COMMITTED, 120)
    w.wait_for_index(w.last_index() + 5, 60)
    group = w.current_group()
    assert group["world_size"] == 3
    for pid in group["pids"][:2]:
        kill_worker_process(pid)
    decision = w.wait_for_event(EventKind.DECISION, 90,
                                where=lambda e: e.get("decision") == "memory_restore_impossible")
    w.wait_for_event(EventKind.FIRST_STEP, 60, where=lambda e: e["ts"] > decision["ts"])
    stop.touch()
    result = th.wait(120)
    events = load_events(result.path)
    assert "do not cover the state" in decision["message"], decision
    restored = next(e for e in events if e["kind"] == "checkpoint_restored" and e["ts"] > decision["ts"])
    assert restored["source"] == "storage" and restored["index"] == decision["fallback_index"]
    assert [len(s) for s in group["stripes"]] == [2, 2, 2], group  # each held 2 of 3 shards


def test_a_hung_survivors_shards_are_moved_before_it_is_replaced(local_cluster, restore_nodes,
                                                                 run_dir, tmp_path):
    """Rank 0 hangs in its own code (where no abort reaches it) when the last rank's node
    is lost, so it is replaced. Its shards of the newest snapshot are the ones rank 1
    lacks (3 workers: 2 of 3 shards each); the controller moves them to rank 1 over Ray
    first, so the new group restores from memory instead of from the start (nothing is
    persisted in this run)."""
    th, w, stop = _start(run_dir, "hung", tmp_path, persist_every=10**6, hang_rank0_at=25)
    killed = kill_node_at(local_cluster, w, 24)
    moved = w.wait_for_event(EventKind.DECISION, 90, where=lambda e: e.get("decision") == "evacuate")
    w.wait_for_event(EventKind.FIRST_STEP, 90, count=2)
    stop.touch()
    result = th.wait(120)
    events = load_events(result.path)
    hung = [e for e in events if e["kind"] == "worker_lost" and e.get("cause") == "hung"]
    assert [e["rank"] for e in hung] == [0], [e["message"] for e in events if e["kind"] == "worker_lost"]
    assert moved["to_rank"] == 1 and "hung rank 0" in moved["message"]
    formed = [e for e in events if e["kind"] == "group_formed"]
    assert killed not in formed[1]["nodes"] and formed[1]["world_size"] == 2
    restored = [e for e in events if e["kind"] == "checkpoint_restored"]
    assert restored[0]["source"] == "memory" and restored[0]["index"] >= 23, restored
    resize = next(e for e in events if e["kind"] == "resize")
    assert resize["lost_steps"] <= 1, resize
