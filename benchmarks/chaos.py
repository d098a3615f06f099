"""Chaos benchmark: 20 faults of every kind, raylastic vs Ray Train's TorchTrainer, same
schedule, same cluster shape, same object store, in one run.

The schedule comes from ``raylastic.testing.chaos.ChaosSchedule.from_seed(seed, 20,
interval_s=(20, 30))``: node killed without notice, node drained with a 2-10 s deadline,
worker process killed, rank 0's node killed while it uploads a checkpoint, two nodes killed
at once, the object store (SeaweedFS, a real S3 server) stopped for 10 s, a node added back.
Each system trains the same MLP on the same data with the same fixed global batch
(``raylastic.testing.chaos_train``) on a fresh local cluster (head without CPUs + 3 one-CPU
nodes, min 1 / max 3 workers), with checkpoints on the same S3 server:

- raylastic: ``ElasticState`` (in-memory snapshot every step, persisted every 25 steps)
  + ``ElasticDataLoader``; ``FailureConfig(max_failures=20)`` (a killed worker process is a
  crash, not a node loss); a storage retry budget of ~30 s (a 10 s outage is longer than
  the default 5 attempts).
- Ray Train 2.60: ``TorchTrainer(scaling_config=ScalingConfig(num_workers=(1, 3)))``, a
  storage checkpoint every 25 steps, ``FailureConfig(max_failures=-1)``,
  ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.1`` (raylastic's poll cadence; the default 2 s
  would make every ``report`` wait up to 2 s).

The injector waits (up to 60 s) for a training group before each fault; a fault that finds
none is recorded as skipped. After the last fault both systems are stopped (raylastic at
the end of the current data epoch, so a fault-free reference can repeat the run).

Goodput is ``raylastic report``'s definition (docs/report.md) computed for both systems
from the same per-step log (rank 0 logs every completed step): the step times of the steps
the final model kept over the wall time from ``fit()`` called to ``fit()`` returned. For
raylastic the report's own goodput (from its event log) is recorded too. Correctness for
raylastic: every sample exactly once per epoch, final weights vs a fault-free fixed-size
run (relative), no uncommitted checkpoint ever restored.

Writes benchmarks/results/chaos.json (and chaos.png). Usage:
  python benchmarks/chaos.py                      # both systems, 20 faults (~20 min)
  python benchmarks/chaos.py --quick              # 6 faults every 8-12 s (smoke run)
  python benchmarks/chaos.py --systems ray_train --merge   # one system into an existing JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from typing import Any, Dict

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
DATA = {"n": 1200, "global_batch": 48, "micro_batch": 8, "seed": 0, "hidden": 64, "lr": 0.05}
CKPT_EVERY = 25
# A step that takes more than STALL_FACTOR x the median step was blocked (on a checkpoint
# upload during a storage outage): the report counts it as productive, the strict variant not.
STALL_FACTOR = 10.0
# Which faults apply to Ray Train, and how (the same injector runs for both).
RAY_TRAIN_NOTES = {
    "kill_node": "applies: Ray Train restarts the worker group from its last checkpoint",
    "drain_node": "applies: Ray Train 2.60 sees the drain (get_preemption_info) but this train "
                  "function does not checkpoint on it (the recovery benchmark covers that); the node "
                  "dies at the deadline",
    "kill_worker": "applies: a crashed worker restarts the whole group (max_failures=-1)",
    "kill_during_upload": "applies: Ray Train uploads inside report(); rank 0's node is killed as soon "
                          "as it logs the checkpoint step (no staging directory to watch)",
    "kill_two_nodes": "applies",
    "stop_storage": "applies: a report() whose upload fails raises in the worker and restarts the group",
    "add_node": "applies: Ray Train's elastic policy grows the group when resources appear",
}


def _env_for(server) -> None:
    for k, v in server.env().items():
        os.environ[k] = v


def run_system(system: str, schedule, server, seed_dir: str, step_sleep_s: float,
               group_timeout_s: float, fit_timeout_s: float) -> Dict[str, Any]:
    import torch

    from raylastic.testing.chaos import ChaosInjector, raylastic_upload_probe
    from raylastic.testing.chaos_checks import (exactly_once_problems, goodput_from_steps, group_starts,
                                                partial_checkpoint_loads)
    from raylastic.testing.cluster import LocalCluster

    log_dir = os.path.join(seed_dir, system, "log")
    os.makedirs(log_dir)
    stop = os.path.join(seed_dir, system, "stop")
    cfg = dict(DATA, log_dir=log_dir, stop_path=stop, step_sleep_s=step_sleep_s, ballast_mb=16,
               checkpoint_every=CKPT_EVERY, weights_out=os.path.join(seed_dir, system, "w.pt"))
    uri = server.uri(f"bench-chaos-{int(time.time())}-{system}")
    out: Dict[str, Any] = {"system": system}
    with LocalCluster(num_nodes=schedule.nodes) as cluster:
        box: Dict[str, Any] = {}
        if system == "raylastic":
            from raylastic import CheckpointConfig, ElasticTrainer, FailureConfig, RunConfig, ScalingConfig
            from raylastic.checkpoint.retry import RetryPolicy
            from raylastic.testing.chaos_train import chaos_elastic

            trainer = ElasticTrainer(
                chaos_elastic, train_loop_config=cfg,
                scaling_config=ScalingConfig(min_workers=1, max_workers=3),
                run_config=RunConfig(
                    name="chaos", storage_path=uri, verbose=False, progress=False, tensorboard=False,
                    failure_config=FailureConfig(max_failures=len(schedule.faults)),
                    checkpoint_config=CheckpointConfig(persist_every=CKPT_EVERY, num_to_keep=2),
                    storage_retry=RetryPolicy(max_attempts=60, base_delay_s=0.2, max_delay_s=1.0)))
            probe = raylastic_upload_probe()
        else:
            import ray.train
            from ray.train.torch import TorchTrainer

            from raylastic.testing.chaos_train import chaos_ray_train

            trainer = TorchTrainer(
                chaos_ray_train, train_loop_config=cfg,
                scaling_config=ray.train.ScalingConfig(num_workers=(1, 3), resources_per_worker={"CPU": 1}),
                run_config=ray.train.RunConfig(name="chaos_ray_train", storage_path=uri,
                                               failure_config=ray.train.FailureConfig(max_failures=-1)))
            probe = None

        def target():
            try:
                box["result"] = trainer.fit()
            except BaseException as e:  # noqa: BLE001
                box["error"] = e

        t_start = time.time()
        th = threading.Thread(target=target, daemon=True, name=f"fit-{system}")
        th.start()
        injector = ChaosInjector(cluster, schedule, log_dir=log_dir, storage=server, checkpoint_every=CKPT_EVERY,
                                 group_timeout_s=group_timeout_s, strict=False, alive=th.is_alive,
                                 upload_probe=probe,
                                 on_fault=lambda r: print(f"[{system}] {json.dumps(r.to_json())}", flush=True))
        injector.wait_for_training(300)
        t_train = time.time()
        try:
            injector.run()
        finally:
            open(stop, "w").close()
            if not server.running:
                server.start()
        th.join(fit_timeout_s)
        t_end = time.time()
        if th.is_alive():
            raise TimeoutError(f"{system}: fit() did not return {fit_timeout_s:.0f} s after the stop flag")
        out["error"] = repr(box["error"]) if "error" in box else None
        from raylastic.testing.chaos import read_jsonl

        steps = read_jsonl(os.path.join(log_dir, "steps.jsonl"))
        out["goodput"] = goodput_from_steps(steps, t_start, t_end, group_starts(log_dir))
        out["goodput_stalls_as_badput"] = goodput_from_steps(steps, t_start, t_end, group_starts(log_dir),
                                                             max_step_s=STALL_FACTOR * _median_step(steps))
        out["wall_s"] = round(t_end - t_start, 2)
        out["first_step_after_s"] = round(steps[0]["t"] - t_start, 2) if steps else None
        out["training_started_s"] = round(t_train - t_start, 2)
        out["final_step"] = steps[-1]["step"] if steps else 0
        out["groups"] = len({s["group"] for s in steps})
        out["faults"] = [r.to_json() for r in injector.applied]
        out["faults_skipped"] = sum(1 for r in injector.applied if r.skipped)
        out["world_sizes"] = _runs([s["world"] for s in steps])
        out["steps_trace"] = [[round(s["t"] - t_start, 2), s["step"], s["world"]] for s in steps[::5]]
        if system == "raylastic" and "result" in box:
            from raylastic.reporting import build_report, load_run

            data = load_run(box["result"].path)
            rep = build_report(data.events, data.metrics, None)
            out["report"] = {"goodput": rep.goodput, "wall_s": rep.wall_s, "productive_step_s": rep.productive_step_s,
                             "steps": rep.steps, "recoveries": len(rep.recoveries), "resizes": len(rep.resizes)}
            out["restores"] = [[e["source"], e["index"]] for e in data.events if e["kind"] == "checkpoint_restored"]
            committed = {e["index"] for e in data.events if e["kind"] == "checkpoint_committed"}
            out["upload_kills"] = [{"note": r.note, "checkpoint": (r.at_step // CKPT_EVERY) * CKPT_EVERY,
                                    "committed": (r.at_step // CKPT_EVERY) * CKPT_EVERY in committed}
                                   for r in injector.applied if r.fault.kind.value == "kill_during_upload" and r.at_step]
            out["partial_checkpoint_loads"] = partial_checkpoint_loads(data.events)
            final = torch.load(cfg["weights_out"], weights_only=True)
            out["epochs"] = final["epochs"]
            out["exactly_once_problems"] = exactly_once_problems(
                log_dir, n=DATA["n"], seed=DATA["seed"], global_batch=DATA["global_batch"], epochs=final["epochs"])
            out["weights_rel_diff_vs_fault_free"] = _reference_diff(cluster, seed_dir, final)
    return out


def _reference_diff(cluster, seed_dir: str, final: Dict[str, Any]) -> float:
    """The same training fault-free on a fixed group of 2; max relative weight difference."""
    import torch

    from raylastic import ElasticTrainer, RunConfig, ScalingConfig
    from raylastic.testing.chaos_checks import weight_difference
    from raylastic.testing.chaos_train import chaos_elastic

    while len(cluster.worker_nodes) < 2:
        cluster.add_node()
    ref_dir = os.path.join(seed_dir, "reference")
    os.makedirs(os.path.join(ref_dir, "log"))
    cfg = dict(DATA, log_dir=os.path.join(ref_dir, "log"), epochs=final["epochs"],
               weights_out=os.path.join(ref_dir, "w.pt"))
    ElasticTrainer(chaos_elastic, train_loop_config=cfg, scaling_config=ScalingConfig(min_workers=2, max_workers=2),
                   run_config=RunConfig(name="ref", storage_path=os.path.join(ref_dir, "runs"), verbose=False,
                                        progress=False, tensorboard=False)).fit()
    ref = torch.load(cfg["weights_out"], weights_only=True)
    if ref["steps"] != final["steps"]:
        raise AssertionError(f"reference trained {ref['steps']} steps, the chaos run {final['steps']}")
    return weight_difference(ref["weights"], final["weights"])


def _median_step(steps) -> float:
    import statistics

    gaps = [b["t"] - a["t"] for a, b in zip(steps, steps[1:]) if a["group"] == b["group"]]
    return statistics.median(gaps) if gaps else 1.0


def reanalyse(results: Dict[str, Any]) -> None:
    """Stalls, recomputed from a result file's ``steps_trace`` (every 5th step of rank 0's
    log): an interval of exactly 5 steps (the same group going on: no restore between) that
    took more than STALL_FACTOR x the median such interval was blocked; the time beyond the
    median is ``stalled_s``. The report's goodput counts it as productive; the stricter
    ``goodput_stalls_as_badput`` = (productive_s - stalled_s) / wall_s. (Runs from this
    version on also record the step-exact ``goodput_stalls_as_badput``.)"""
    import statistics

    for system in ("raylastic", "ray_train"):
        r = results.get(system)
        if not r or not r.get("steps_trace") or not r.get("goodput", {}).get("wall_s"):
            continue
        tr = r["steps_trace"]
        runs = [(a[0], b[0] - a[0]) for a, b in zip(tr, tr[1:]) if b[1] - a[1] == 5]
        if not runs:
            continue
        med = statistics.median(d for _, d in runs)
        stalls = [(round(t, 1), round(d, 1)) for t, d in runs if d > STALL_FACTOR * med]
        stalled = sum(d - med for _, d in stalls)
        g = r["goodput"]
        r["stall_analysis"] = {
            "stalls_at_s_and_length_s": stalls, "stalled_s": round(stalled, 1),
            "median_5_step_s": round(med, 3),
            "goodput_stalls_as_badput": round((g["productive_s"] - stalled) / g["wall_s"], 4),
        }


def _runs(values):
    out = []
    for v in values:
        if not out or out[-1] != v:
            out.append(v)
    return out


def plot(results: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for system, color in (("raylastic", "tab:blue"), ("ray_train", "tab:orange")):
        r = results.get(system)
        if not r or not r.get("steps_trace"):
            continue
        t = [p[0] for p in r["steps_trace"]]
        s = [p[1] for p in r["steps_trace"]]
        gp = r["goodput"]["goodput"]
        ax.plot(t, s, ".", ms=2, color=color, label=f"{system} (goodput {gp:.2f})")
        for f in r["faults"]:
            if system == "raylastic":
                ax.axvline(f["started_at_s"] + r["training_started_s"], color="grey", lw=0.5, ls=":")
    ax.set_xlabel("seconds since fit()")
    ax.set_ylabel("step (as restored)")
    ax.set_title(f"chaos: {len(results['schedule']['faults'])} faults (dotted: raylastic's fault times)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--faults", type=int, default=20)
    ap.add_argument("--interval", default="20,30", help="seconds between faults: low,high")
    ap.add_argument("--quick", action="store_true", help="6 faults every 8-12 s")
    ap.add_argument("--systems", default="raylastic,ray_train")
    ap.add_argument("--step-sleep-s", type=float, default=0.05)
    ap.add_argument("--merge", action="store_true", help="update --out, keeping the other systems' results")
    ap.add_argument("--out", default=os.path.join(RESULTS, "chaos.json"))
    ap.add_argument("--reanalyse", action="store_true",
                    help="recompute the derived numbers of --out from its step traces; no run")
    args = ap.parse_args()
    if args.reanalyse:
        results = json.load(open(args.out))
        reanalyse(results)
        with open(args.out, "w") as fh:
            json.dump(results, fh, indent=1, default=str)
        print(json.dumps({s: results[s].get("stall_analysis") for s in ("raylastic", "ray_train") if s in results},
                         indent=1))
        return
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    from raylastic.testing.chaos import ChaosSchedule
    from raylastic.testing.seaweedfs import SeaweedS3

    lo, hi = (8.0, 12.0) if args.quick else tuple(float(x) for x in args.interval.split(","))
    n = 6 if args.quick else args.faults
    schedule = ChaosSchedule.from_seed(args.seed, n, interval_s=(lo, hi))
    print("schedule:\n" + schedule.describe(), flush=True)
    results: Dict[str, Any] = {}
    if args.merge and os.path.exists(args.out):
        results = json.load(open(args.out))
        if results.get("schedule") != schedule.to_json():
            raise SystemExit(f"--merge: {args.out} was made with another schedule")
    import ray
    import torch

    results.update({
        "benchmark": "chaos", "schedule": schedule.to_json(), "data": DATA, "checkpoint_every": CKPT_EVERY,
        "step_sleep_s": args.step_sleep_s,
        "cluster": "ray.cluster_utils.Cluster: head (0 CPU) + 3 x 1-CPU worker nodes on one machine; min 1, max 3 workers",
        "storage": "SeaweedFS (real S3 server) on this machine",
        "goodput_definition": "docs/report.md: step times of kept steps / wall (fit() called -> returned), "
                              "from rank 0's per-step log, for both systems",
        "ray_train_faults": RAY_TRAIN_NOTES,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"ray": ray.__version__, "torch": torch.__version__},
        "ray_train_env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]},
    })
    with SeaweedS3(bucket="raylastic-bench") as server, tempfile.TemporaryDirectory() as tmp:
        _env_for(server)  # before any cluster starts: every worker inherits the credentials
        for system in [s for s in args.systems.split(",") if s]:
            print(f"== {system}", flush=True)
            t0 = time.time()
            results[system] = run_system(system, schedule, server, os.path.join(tmp, system), args.step_sleep_s,
                                         group_timeout_s=60.0, fit_timeout_s=300.0)
            results[system]["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0))
            summary = {k: v for k, v in results[system].items() if k not in ("steps_trace", "faults")}
            print(json.dumps(summary, indent=1, default=str), flush=True)
    a, b = results.get("raylastic"), results.get("ray_train")
    if a and b and a["goodput"]["goodput"] and b["goodput"]["goodput"]:
        results["goodput_ratio_raylastic_over_ray_train"] = round(a["goodput"]["goodput"] / b["goodput"]["goodput"], 3)
    reanalyse(results)
    results["target"] = {"raylastic_goodput_min": 0.85,
                         "met": bool(a and a["goodput"]["goodput"] and a["goodput"]["goodput"] >= 0.85)}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    try:
        plot(results, os.path.splitext(args.out)[0] + ".png")
    except Exception as exc:  # noqa: BLE001 - the JSON is the result; the plot is a view of it
        print(f"plot skipped: {exc}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
