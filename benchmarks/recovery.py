"""Recovery benchmark: raylastic vs Ray Train's elastic TorchTrainer vs plain torch DDP.

Same local multi-node cluster (head without CPUs + 3 one-CPU worker nodes, the same
fast GCS failure detection for both), same train function (written against Ray Train's
API, see ``raylastic.testing.train_funcs.mlp_bench``), same schedule:

  start (min 2, max 3 workers) -> at step K remove a worker node (unannounced)
  -> after M steps on the smaller group add a node back -> run until a group of 3 has
  trained M steps -> stop.

Rank 0 of either framework appends (wall time, step, world size) per step to one file,
and every number below is computed from that file and the driver's own timestamps:

- fit_to_first_step_s: fit() called -> first step completed
- node_loss_to_next_step_s: node removed -> next step completed (on the smaller group)
- steps_lost_on_loss: steps trained before the loss that had to be trained again
- node_added_to_first_step_s: node added -> first step completed by a group using it
- steps_lost_on_grow: steps re-trained because of the scale-up
- steady_step_s: median step time at world size 3 before the loss
- plain torch DDP: median step time of the same model/batch in 3 gloo processes

``--cuda``: the model and batches live on the machine's GPU (every rank on the same one,
so the collectives stay gloo for both frameworks: NCCL refuses two ranks on one GPU). The
snapshot is then a device-to-host copy and the restore a host-to-device one.

Writes benchmarks/results/recovery.json. Usage: python benchmarks/recovery.py [--quick] [--cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, Optional

# The driver plumbing is shared with the other node-loss benchmarks; other scripts here
# import RESULTS, _read_log and _runs from this module, so the old names stay.
from _driver import RESULTS, fresh_cluster, lose_node, redone, restored, run_events, start_fit
from _driver import read_log as _read_log, runs as _runs, wait as _wait


def run_schedule(cluster, fit: Callable[[], Any], log_path: str, stop_path: str,
                 kill_at: int, steps_between: int, timeout_s: float = 300,
                 notice_s: Optional[float] = None) -> Dict[str, Any]:
    """Drive one framework through the schedule; return the measured numbers.

    ``notice_s``: announce the loss first (a Ray node drain with that deadline, what the
    autoscaler/KubeRay do on a spot termination notice), and kill the node at the
    deadline; otherwise kill it without warning."""
    t_fit = time.time()
    th, box = start_fit(fit)
    log = lambda: _read_log(log_path)  # noqa: E731
    marks: Dict[str, Any] = {}
    first_small = lose_node(cluster, log, marks, timeout_s, after_step=kill_at, notice_s=notice_s)
    t_kill = marks["t_kill"]
    _wait(lambda: len([r for r in log() if r["t"] > first_small["t"]]) >= steps_between, timeout_s,
          "steps on the smaller group")
    t_add = time.time()
    cluster.add_node()
    grown = _wait(lambda: [r for r in log() if r["t"] > t_add and r["world"] == 3], timeout_s, "a step at world size 3")
    first_grown = grown[0]
    _wait(lambda: len([r for r in log() if r["t"] > first_grown["t"]]) >= steps_between, timeout_s, "steps on the regrown group")
    open(stop_path, "w").close()
    th.join(timeout_s)
    if th.is_alive():
        raise TimeoutError("fit() did not return after the stop flag")
    if "error" in box:
        raise box["error"]
    rows = log()
    before_kill = [r for r in rows if r["t"] <= t_kill]
    steady = [r for r in before_kill if r["world"] == 3]
    dts = [b["t"] - a["t"] for a, b in zip(steady, steady[1:]) if b["step"] == a["step"] + 1]
    first = rows[0]
    before_small = [r for r in rows if r["t"] < first_small["t"]]
    out = {"announced": notice_s is not None, "notice_s": notice_s}
    return {
        **out,
        "fit_to_first_step_s": round(first["t"] - t_fit, 3),
        # announced: negative when the group shrank before the node died
        "node_loss_to_next_step_s": round(first_small["t"] - t_kill, 3),
        "training_gap_s": round(first_small["t"] - before_small[-1]["t"], 3),
        "steps_lost_on_loss": redone(rows, first_small),
        "node_added_to_first_step_s": round(first_grown["t"] - t_add, 3),
        "steps_lost_on_grow": redone(rows, first_grown),
        "steady_step_s": round(statistics.median(dts), 5) if dts else None,
        "world_sizes_seen": _runs([r["world"] for r in rows]),
        "total_steps_logged": len(rows),
        **_restores(box.get("result")),
    }


def _restores(result: Any) -> Dict[str, Any]:
    """raylastic only: where each re-formed group got its state (its event log)."""
    events = run_events(result)
    return {} if events is None else {"restores": restored(events, ("index", "source", "broadcast", "striped"))}


def run_raylastic(cluster, cfg: Dict[str, Any], storage: str) -> Callable[[], Any]:
    """raylastic with the same train function and checkpoint cadence as Ray Train."""
    from raylastic import ElasticTrainer, RunConfig, ScalingConfig
    from raylastic.testing.train_funcs import mlp_bench

    trainer = ElasticTrainer(
        mlp_bench, train_loop_config=cfg,
        scaling_config=ScalingConfig(min_workers=2, max_workers=3),
        run_config=RunConfig(name="bench_raylastic", storage_path=storage, verbose=False, progress=False),
    )
    return trainer.fit


def run_raylastic_state(cluster, cfg: Dict[str, Any], storage: str) -> Callable[[], Any]:
    """raylastic with ElasticState: an in-memory snapshot every step, persisted to
    storage every 50 steps in the background."""
    from raylastic import CheckpointConfig, ElasticTrainer, RunConfig, ScalingConfig
    from raylastic.testing.train_funcs import mlp_bench

    trainer = ElasticTrainer(
        mlp_bench, train_loop_config=dict(cfg, elastic_state=True),
        scaling_config=ScalingConfig(min_workers=2, max_workers=3),
        run_config=RunConfig(name="bench_raylastic_state", storage_path=storage, verbose=False,
                             progress=False,
                             checkpoint_config=CheckpointConfig(persist_every=50, num_to_keep=2)),
    )
    return trainer.fit


def run_ray_train(cluster, cfg: Dict[str, Any], storage: str) -> Callable[[], Any]:
    import ray.train
    from ray.train.torch import TorchTrainer

    from raylastic.testing.train_funcs import mlp_bench

    trainer = TorchTrainer(
        mlp_bench, train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="bench_ray_train", storage_path=storage,
                                       failure_config=ray.train.FailureConfig(max_failures=-1)),
    )
    return trainer.fit


def _ddp_worker(rank: int, world: int, port: int, cfg: Dict[str, Any], steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    hidden, layers, dim, batch = cfg["hidden"], cfg["layers"], cfg["dim"], cfg["batch"]
    device = torch.device("cuda", 0) if cfg.get("cuda") else torch.device("cpu")
    torch.manual_seed(0)
    mods = [nn.Linear(dim, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(*mods, nn.Linear(hidden, 1)).to(device))
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    times = []
    log = open(out + f".steps-{rank}", "a")
    for step in range(steps):
        t0 = time.perf_counter()
        g = torch.Generator().manual_seed(step * 7919 + rank)
        x = torch.randn(batch, dim, generator=g).to(device)
        loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
        opt.zero_grad()
        loss.backward()
        opt.step()
        # the same per-step extras as mlp_bench (stop-flag all-reduce, rank-0 step log),
        # so the comparison isolates the framework
        stop = torch.tensor([0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if rank == 0:
            log.write(json.dumps({"t": time.time(), "step": step, "world": world}) + "\n")
            log.flush()
        times.append(time.perf_counter() - t0)
    log.close()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(times, fh)
    dist.destroy_process_group()


def run_plain_ddp(cfg: Dict[str, Any], world: int = 3, steps: int = 200) -> Dict[str, Any]:
    import torch.multiprocessing as mp

    from raylastic.testing.ports import free_port

    port = free_port()
    out = tempfile.mktemp(suffix=".json")
    mp.spawn(_ddp_worker, args=(world, port, cfg, steps, out), nprocs=world, join=True)
    times = json.load(open(out))[20:]
    for r in range(world):
        try:
            os.remove(out + f".steps-{r}")
        except OSError:
            pass
    return {"steady_step_s": round(statistics.median(times), 5), "world_size": world, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--skip-ray-train", action="store_true")
    ap.add_argument("--frameworks", default="raylastic,raylastic_state,ray_train",
                    help="comma list of raylastic, raylastic_state, ray_train")
    ap.add_argument("--scenarios", default="unannounced,announced",
                    help="comma list: unannounced (kill), announced (drain with --notice-s, then kill)")
    ap.add_argument("--notice-s", type=float, default=10.0)
    ap.add_argument("--cuda", action="store_true", help="model and batches on the GPU (all ranks share GPU 0)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "recovery.json"))
    args = ap.parse_args()
    # Ray Train's report() blocks until its controller polls; give it the same 0.1 s
    # cadence raylastic's controller polls at (its default is 2 s: 2 s per step).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")

    from raylastic.testing.cluster import FAST_FAILURE_DETECTION

    kill_at, between = (15, 10) if args.quick else (30, 20)
    model = {"hidden": args.hidden, "layers": args.layers, "dim": 64, "batch": 32, **({"cuda": True} if args.cuda else {})}
    results: Dict[str, Any] = {
        "benchmark": "recovery",
        "schedule": {"min_workers": 2, "max_workers": 3, "kill_at_step": kill_at,
                     "steps_between_events": between, "checkpoint_every": 10},
        "model": model,
        "cluster": "ray.cluster_utils.Cluster: head (0 CPU) + 3 x 1-CPU worker nodes on one machine",
        "failure_detection": FAST_FAILURE_DETECTION,
        "ray_train_env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    import ray
    import torch

    results["versions"] = {"ray": ray.__version__, "torch": torch.__version__}
    if args.cuda:
        results["machine"]["gpu"] = torch.cuda.get_device_name(0)
    makers = {"raylastic": run_raylastic, "raylastic_state": run_raylastic_state, "ray_train": run_ray_train}
    frameworks = [f for f in args.frameworks.split(",") if f and not (args.skip_ray_train and f == "ray_train")]
    scenarios = [s for s in args.scenarios.split(",") if s]
    for scenario in scenarios:
        for name in frameworks:
            with fresh_cluster() as (tmp, _logs, cluster):
                cfg = dict(model, checkpoint_every=10, log_path=os.path.join(tmp, "steps.jsonl"),
                           stop_path=os.path.join(tmp, "stop"))
                fit = makers[name](cluster, cfg, os.path.join(tmp, "storage"))
                key = name if scenario == "unannounced" else f"{name}_announced"
                print(f"== {key}", flush=True)
                results[key] = run_schedule(cluster, fit, cfg["log_path"], cfg["stop_path"], kill_at, between,
                                            notice_s=args.notice_s if scenario == "announced" else None)
                print(json.dumps(results[key], indent=1), flush=True)
    results["plain_ddp"] = run_plain_ddp(model)
    print("== plain_ddp", json.dumps(results["plain_ddp"]), flush=True)
    ratios = {}
    for mine in ("raylastic", "raylastic_state"):
        for suffix in ("", "_announced"):
            a, b = results.get(mine + suffix), results.get("ray_train" + suffix)
            if a and b:
                ratios[f"{mine}{suffix}_over_ray_train"] = {
                    k: round(a[k] / b[k], 4) for k in
                    ("node_loss_to_next_step_s", "training_gap_s", "node_added_to_first_step_s",
                     "fit_to_first_step_s", "steady_step_s")
                    if a.get(k) and b.get(k) and b[k] > 0 and a[k] > 0
                }
        if results.get(mine, {}).get("steady_step_s"):
            ratios[f"{mine}_steady_over_plain_ddp"] = round(
                results[mine]["steady_step_s"] / results["plain_ddp"]["steady_step_s"], 4)
    if results.get("raylastic_state", {}).get("steady_step_s") and results.get("raylastic", {}).get("steady_step_s"):
        ratios["snapshot_every_step_overhead_pct"] = round(
            100 * (results["raylastic_state"]["steady_step_s"] / results["raylastic"]["steady_step_s"] - 1), 2)
    results["ratios"] = ratios
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
