"""Driver-side plumbing the node-loss benchmarks share (``recovery.py``,
``sharded_recovery.py``, ``integrations.py``): one copy, so that every benchmark reads the
step log, removes a node, times the recovery and builds the raylastic / Ray Train trainers
the same way, and a fix to one reaches all of them.

The train functions log to files (rank 0: one JSON line per step with wall time ``t``,
``step`` and ``world``); everything here reads those files and the driver's own clock.
Not shipped to the workers (the train functions are in ``workloads/``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


# -- the step logs -------------------------------------------------------------------------
def read_log(path: str) -> List[Dict[str, Any]]:
    """The complete JSON lines of a log a train function is appending to ([] before it exists)."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as fh:
        for line in fh:
            if line.endswith("\n"):
                out.append(json.loads(line))
    return out


def wait(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``pred`` until it returns something true (returned); TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def redone(rows: List[Dict[str, Any]], first_of_group: Dict[str, Any]) -> int:
    """Steps completed before a new group's first step that it had to train again."""
    before = [r["step"] for r in rows if r["t"] < first_of_group["t"]]
    return max(0, max(before) - (first_of_group["step"] - 1)) if before else 0


def gap(rows: List[Dict[str, Any]], first_of_group: Dict[str, Any]) -> Optional[float]:
    """How long training paused: the last step logged before a new group's first step -> that step."""
    before = [r["t"] for r in rows if r["t"] < first_of_group["t"]]
    return round(first_of_group["t"] - max(before), 3) if before else None


def runs(values: List[int]) -> List[int]:
    """``values`` with consecutive repeats collapsed (the world sizes a run went through)."""
    out: List[int] = []
    for v in values:
        if not out or out[-1] != v:
            out.append(v)
    return out


# -- the run under test --------------------------------------------------------------------
class Terminated(Exception):
    """SIGTERM (e.g. ``timeout``): summarize the run in progress, write the JSON, exit."""


def on_sigterm(_sig, _frame):
    raise Terminated()


def start_fit(fit: Callable[[], Any]) -> Tuple[threading.Thread, Dict[str, Any]]:
    """Run ``fit()`` in a daemon thread while the driver follows the logs; the box gets
    its ``"result"`` or its ``"error"``."""
    box: Dict[str, Any] = {}

    def target():
        try:
            box["result"] = fit()
        except BaseException as e:  # noqa: BLE001
            box["error"] = e

    th = threading.Thread(target=target, daemon=True)
    th.start()
    return th, box


@contextlib.contextmanager
def fresh_cluster(num_nodes: int = 3, cpus_per_node: int = 1) -> Iterator[Tuple[str, str, Any]]:
    """(scratch dir, its ``logs`` dir, a ``LocalCluster``): a new cluster per measured run,
    so no run inherits another's workers or storage."""
    from raylastic.testing.cluster import LocalCluster

    keep = os.environ.get("RAYLASTIC_BENCH_KEEP")  # a folder: each run's scratch dir stays there
    with contextlib.ExitStack() as stack:
        tmp = tempfile.mkdtemp(dir=keep) if keep else stack.enter_context(tempfile.TemporaryDirectory())
        if keep:
            print(f"scratch dir (kept): {tmp}", flush=True)
        cluster = stack.enter_context(LocalCluster(num_nodes=num_nodes, cpus_per_node=cpus_per_node))
        log_dir = os.path.join(tmp, "logs")
        os.makedirs(log_dir)
        yield tmp, log_dir, cluster


def drain(cluster, node, notice_s: float) -> float:
    """Announce ``node``'s loss ``notice_s`` ahead (Ray's DrainNode with a deadline, what
    the autoscaler / KubeRay do on a spot termination notice); returns the notice's time."""
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    t = time.time()
    GcsClient(address=cluster.address).drain_node(
        node.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "benchmark: spot termination notice", int((t + notice_s) * 1000))
    return t


def lose_node(cluster, log: Callable[[], List[Dict[str, Any]]], marks: Dict[str, Any], timeout_s: float, *,
              after_step: Optional[int] = None, notice_s: Optional[float] = None,
              fit_thread: Optional[threading.Thread] = None, suffix: str = "",
              what: str = "a step on the smaller group", delay_s: float = 0.0) -> Dict[str, Any]:
    """Remove the last worker node and wait for the smaller group's first step.

    ``after_step``: first wait until rank 0 logs that step. ``notice_s``: drain the node
    with that deadline first and remove it at the deadline (else no notice). Fills
    ``marks`` as it goes (so a timeout leaves what was reached): ``t_notice``, ``t_kill``,
    ``killed_after_step`` and ``first_small`` (each name + ``suffix``); the first step
    counted is the first at world size 2 after the notice or the removal (a step of the
    old group may still complete between the kill and its detection). ``fit_thread``:
    stop waiting, with a TimeoutError, once ``fit()`` has returned. ``what``: the step
    waited for, as a timeout names it. ``delay_s``: after that step, wait this long
    before the notice or the removal (a loss mid-step rather than at the step's commit)."""
    def ended() -> Any:
        return fit_thread is not None and not fit_thread.is_alive() and [None]

    if after_step is not None:
        hit = wait(lambda: [r for r in log() if r["step"] >= after_step] or ended(), timeout_s, f"step {after_step}")
        if hit[0] is None:
            raise TimeoutError("fit() returned before the kill step")
        time.sleep(delay_s)
    victim = cluster.worker_nodes[-1]
    if notice_s is not None:
        marks["t_notice" + suffix] = drain(cluster, victim, notice_s)
        time.sleep(max(0.0, marks["t_notice" + suffix] + notice_s - time.time()))  # the cloud keeps its word
    marks["t_kill" + suffix] = time.time()
    cluster.remove_node(victim)
    marks["killed_after_step" + suffix] = max((r["step"] for r in log()), default=None)
    t_from = marks.get("t_notice" + suffix, marks["t_kill" + suffix])
    first = wait(lambda: [r for r in log() if r["t"] > t_from and r["world"] == 2] or ended(), timeout_s,
                 what)[0]
    if first is None:
        raise TimeoutError("fit() returned without a step on the smaller group (the run ended before the loss?)")
    marks["first_small" + suffix] = first
    return first


def elastic_or_ray_train_fit(system: str, fn: Callable[..., Any], cfg: Dict[str, Any], storage: str, name: str,
                             checkpoint_every: int, ray_train_cfg: Optional[Dict[str, Any]] = None,
                             cpus_per_worker: int = 1) -> Callable[[], Any]:
    """``fit`` of the same train function under raylastic (``ElasticTrainer``, min 2 / max
    3 workers, ``persist_every=checkpoint_every``) or Ray Train 2 (``TorchTrainer`` with
    ``num_workers=(2, 3)``, restarts without limit); the function sees ``cfg["mode"]``.
    ``ray_train_cfg``: more ``train_loop_config`` for Ray Train only. ``cpus_per_worker``:
    the CPUs each worker reserves (Ray sets its ``OMP_NUM_THREADS`` to that); one worker per
    node either way, so a node loss is one worker's loss."""
    if system == "raylastic":
        from raylastic import CheckpointConfig, ElasticTrainer, RunConfig, ScalingConfig

        return ElasticTrainer(
            fn, train_loop_config=dict(cfg, mode="raylastic"),
            scaling_config=ScalingConfig(min_workers=2, max_workers=3,
                                         resources_per_worker={"CPU": cpus_per_worker}),
            run_config=RunConfig(name=name, storage_path=storage, verbose=False, progress=False,
                                 checkpoint_config=CheckpointConfig(persist_every=checkpoint_every, num_to_keep=2)),
        ).fit
    import ray.train
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        fn, train_loop_config=dict(cfg, mode="ray_train", **(ray_train_cfg or {})),
        scaling_config=ray.train.ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": cpus_per_worker}),
        run_config=ray.train.RunConfig(name=name, storage_path=storage,
                                       failure_config=ray.train.FailureConfig(max_failures=-1),
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2)),
    ).fit


def run_events(result: Any) -> Optional[List[Dict[str, Any]]]:
    """The event log of a finished raylastic run (None: a Ray Train run, or no log)."""
    path = getattr(result, "path", None)
    if not path or not os.path.exists(os.path.join(path, "events.jsonl")):
        return None
    from raylastic.events import load_events

    return load_events(path)


def restored(events: List[Dict[str, Any]], keys: Tuple[str, ...]) -> List[Dict[str, Any]]:
    """The ``checkpoint_restored`` events, each cut to ``keys``: where every group's state came from."""
    return [{k: e[k] for k in keys if k in e} for e in events if e["kind"] == "checkpoint_restored"]


def timed(run: Callable[..., Dict[str, Any]], *args: Any) -> Dict[str, Any]:
    """``run(*args)``'s numbers with its wall time (``wall_s``) added."""
    t0 = time.time()
    res = run(*args)
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def cut_short(res: Dict[str, Any], out_path: str) -> bool:
    """Whether SIGTERM ended this run (the results written so far are in ``out_path``):
    the caller then exits 1 without starting the next run."""
    if res.get("terminated"):
        print(f"terminated; partial results in {out_path}", flush=True)
        return True
    return False


def run_header(benchmark: str) -> Dict[str, Any]:
    """What every results JSON starts with: the benchmark, its command line, the date."""
    return {"benchmark": benchmark,
            "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
