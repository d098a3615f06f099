"""Steady-state overhead: raylastic vs plain torch DDP, same machine, interleaved.

A step of training under raylastic pays for what plain DDP does not: the worker runs in a
Ray actor, ``report()`` hands metrics to the controller, and with ``ElasticState`` every
step is snapshotted. This benchmark measures that cost against plain DDP (3 gloo
processes from ``torch.multiprocessing``, no Ray involved) training the same model with
the same per-step extras (the stop-flag all-reduce and rank 0's step log of
``raylastic.testing.train_funcs.mlp_bench``).

Why interleaved rounds: on a shared 2-core machine, separate runs minutes apart moved by
+-20%. Here one Ray cluster (head + 3 one-CPU nodes) stays up for the whole benchmark
(idle while plain DDP runs, so both see the same background), and each round runs every
condition back to back in a rotating order. Each run's step time is the median of the
intervals between rank 0's consecutive step-log entries after a warm-up; each round gives a
ratio to the plain DDP run of the same round; reported: the median ratio over rounds and
its range.

Conditions: ``plain_ddp`` (3 processes from ``torch.multiprocessing.spawn``);
``plain_ddp_ray`` (the same loop in 3 bare Ray actors, one per node: processes set up as
Ray sets up raylastic's workers, niceness and thread settings included, so this is the
baseline that isolates raylastic's own cost); ``raylastic`` (``ElasticTrainer``,
``report()`` every step, no snapshot); ``raylastic_state`` (``ElasticState.commit()``
every step: an in-memory snapshot of model + Adam state every step, the default
overlapped copy).

    .venv/bin/python benchmarks/steady_state.py [--rounds 4 --steps 120 --hidden 1536 --layers 5]

Writes benchmarks/results/steady_state.json.
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
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recovery import RESULTS, _ddp_worker, _read_log  # noqa: E402

from raylastic.testing.ports import free_port  # noqa: E402

CONDITIONS = ("plain_ddp", "plain_ddp_ray", "raylastic", "raylastic_state")


def _median_step(rows: List[Dict[str, Any]], warmup: int) -> float:
    rows = rows[warmup:]
    dts = [b["t"] - a["t"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]
    if len(dts) < 10:
        raise RuntimeError(f"only {len(dts)} step intervals logged")
    return statistics.median(dts)


def _run_ddp(launch: Callable[[int, str], None], warmup: int) -> float:
    """``launch(port, out)`` runs 3 ranks of ``recovery._ddp_worker``; rank 0 logs to
    ``out + ".steps-0"``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        launch(free_port(), out)
        return _median_step(_read_log(out + ".steps-0"), warmup)


def run_plain_ddp(model: Dict[str, Any], steps: int, warmup: int) -> float:
    import torch.multiprocessing as mp

    return _run_ddp(lambda port, out: mp.spawn(_ddp_worker, args=(3, port, model, steps, out),
                                               nprocs=3, join=True), warmup)


def run_plain_ddp_in_ray_actors(model: Dict[str, Any], steps: int, warmup: int) -> float:
    """The same plain DDP loop in 3 bare Ray actors (one per node, no raylastic): the
    processes then run exactly as raylastic's workers do (Ray runs worker processes at
    nice 15 with OMP_NUM_THREADS=1 set before torch is imported), so the difference to
    ``raylastic`` is raylastic's own cost."""
    import ray
    import ray.cloudpickle

    import recovery

    ray.cloudpickle.register_pickle_by_value(recovery)  # benchmarks/ is not importable in workers

    @ray.remote(num_cpus=1)
    def rank_main(rank: int, port: int, out: str) -> None:
        recovery._ddp_worker(rank, 3, port, model, steps, out)

    return _run_ddp(lambda port, out: ray.get([rank_main.remote(r, port, out) for r in range(3)],
                                              timeout=600), warmup)


def run_raylastic(model: Dict[str, Any], steps: int, warmup: int, elastic_state: bool) -> float:
    from raylastic import CheckpointConfig, ElasticTrainer, RunConfig, ScalingConfig
    from raylastic.testing.train_funcs import mlp_bench

    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "steps.jsonl")
        cfg = dict(model, total_steps=steps, log_path=log, elastic_state=elastic_state,
                   checkpoint_every=10**9)  # no storage checkpoint inside the window
        ElasticTrainer(
            mlp_bench, train_loop_config=cfg,
            scaling_config=ScalingConfig(min_workers=3, max_workers=3),
            run_config=RunConfig(name="steady", storage_path=os.path.join(tmp, "storage"), verbose=False,
                                 progress=False, checkpoint_config=CheckpointConfig(num_to_keep=1)),
        ).fit()
        return _median_step(_read_log(log), warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(RESULTS, "steady_state.json"))
    a = ap.parse_args()
    if a.steps - a.warmup < 20:
        ap.error(f"--steps ({a.steps}) must exceed --warmup ({a.warmup}) by at least 20")

    import ray
    import torch

    from raylastic.testing.cluster import LocalCluster

    model = {"hidden": a.hidden, "layers": a.layers, "dim": 64, "batch": 32}
    rounds: List[Dict[str, float]] = []
    with LocalCluster(num_nodes=3):
        for r in range(a.rounds):
            k = r % len(CONDITIONS)
            order = CONDITIONS[k:] + CONDITIONS[:k]  # who goes first rotates
            got: Dict[str, float] = {}
            for cond in order:
                t0 = time.time()
                if cond == "plain_ddp":
                    got[cond] = run_plain_ddp(model, a.steps, a.warmup)
                elif cond == "plain_ddp_ray":
                    got[cond] = run_plain_ddp_in_ray_actors(model, a.steps, a.warmup)
                else:
                    got[cond] = run_raylastic(model, a.steps, a.warmup, elastic_state=cond == "raylastic_state")
                print(f"round {r}: {cond} median step {got[cond]:.4f} s ({time.time() - t0:.0f} s)", flush=True)
            rounds.append(got)

    summary = {}
    for cond in CONDITIONS[1:]:
        summary[cond] = {"median_step_s": round(statistics.median(x[cond] for x in rounds), 5)}
        for base in ("plain_ddp", "plain_ddp_ray"):
            if base == cond:
                continue
            rs = [x[cond] / x[base] for x in rounds]
            summary[cond][f"ratio_to_{base}"] = round(statistics.median(rs), 4)
            summary[cond][f"overhead_pct_vs_{base}"] = round(100 * (statistics.median(rs) - 1), 2)
            summary[cond][f"ratio_range_vs_{base}"] = [round(min(rs), 4), round(max(rs), 4)]
    result = {
        "benchmark": "steady_state",
        "model": model, "params": _params(model), "world_size": 3,
        "steps_per_run": a.steps, "warmup_steps": a.warmup, "rounds": a.rounds,
        "plain_ddp_median_step_s": round(statistics.median(x["plain_ddp"] for x in rounds), 5),
        **summary,
        "target_overhead_pct": 3.0,
        "per_round_step_s": [{k: round(v, 5) for k, v in x.items()} for x in rounds],
        "cluster": "ray.cluster_utils.Cluster: head (0 CPU) + 3 x 1-CPU worker nodes, up for all conditions",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": {"ray": ray.__version__, "torch": torch.__version__},
        "method": "rounds of back-to-back runs in rotating order; per-run median step interval "
                  "after warm-up; per-round ratio to plain DDP; median over rounds",
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


def _params(model: Dict[str, Any]) -> int:
    h, n, d = model["hidden"], model["layers"], model["dim"]
    return (d * h + h) + (n - 1) * (h * h + h) + (h + 1)


if __name__ == "__main__":
    main()
