"""What a short ``fit()`` costs with new workers and with kept ones (``keep_workers_s``).

Why: each worker process pays its start (Ray's actor start, torch, and under DDP
``torch._dynamo``) before its train function runs, so a short run is mostly start-up. The
anchor is the default, new workers per run; ``ScalingConfig(keep_workers_s=...)`` lets the
next ``fit()`` from the same driver take the workers the last one ended with.

One cluster (head + 3 one-CPU nodes) for the whole benchmark. Each round runs a fresh fit
(``keep_workers_s=0``), then a fit that keeps its workers, then one that takes them (the
measured ``kept`` run; its workers are ended after it), so both conditions see the same
background; the ratio is per round. CPU is the whole machine's (``/proc/stat``: every Ray process, the driver too).

    .venv/bin/python benchmarks/fit_start.py [--rounds 4 --steps 5 --workers 3]

Writes benchmarks/results/fit_start.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _driver import RESULTS, fresh_cluster, run_header  # noqa: E402

from raylastic._internal.worker_group.keeper import end_kept_workers  # noqa: E402
from raylastic.testing.machine import cpu_seconds  # noqa: E402


def _fit(storage: str, name: str, keep_s: float, steps: int, workers: int) -> Dict[str, Any]:
    from raylastic import ElasticTrainer, RunConfig, ScalingConfig
    from raylastic.events import load_events
    from raylastic.testing.train_funcs import ddp_regression

    t0, c0 = time.perf_counter(), cpu_seconds()[0]
    result = ElasticTrainer(
        ddp_regression, train_loop_config={"total_steps": steps},
        scaling_config=ScalingConfig(min_workers=workers, max_workers=workers, keep_workers_s=keep_s),
        run_config=RunConfig(name=name, storage_path=storage, verbose=False, progress=False),
    ).fit()
    wall, cpu = time.perf_counter() - t0, cpu_seconds()[0] - c0
    events = load_events(result.path)
    started = next(e["ts"] for e in events if e["kind"] == "run_started")
    first = next(e["ts"] for e in events if e["kind"] == "first_step")
    pids = next(e["pids"] for e in events if e["kind"] == "group_formed")
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "to_first_step_s": round(first - started, 2),
            "pids": sorted(pids), "steps": result.metrics["step"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(RESULTS, "fit_start.json"))
    args = ap.parse_args()
    rounds: List[Dict[str, Any]] = []
    with fresh_cluster(num_nodes=args.workers) as (tmp, _logs, _cluster):
        _fit(tmp, "warm-up", 0, args.steps, args.workers)  # the cluster's first worker starts
        for i in range(args.rounds):
            fresh = _fit(tmp, f"fresh-{i}", 0, args.steps, args.workers)
            keeps = _fit(tmp, f"keeps-{i}", 30, args.steps, args.workers)  # ends with its workers kept
            kept = _fit(tmp, f"kept-{i}", 30, args.steps, args.workers)  # takes them
            end_kept_workers()  # the next round's fresh run needs the nodes
            rounds.append({"fresh": fresh, "kept": kept, "same_processes": keeps["pids"] == kept["pids"],
                           "wall_ratio": round(kept["wall_s"] / fresh["wall_s"], 3),
                           "cpu_ratio": round(kept["cpu_s"] / fresh["cpu_s"], 3)})
            print(f"round {i}: fresh {fresh['wall_s']} s / {fresh['cpu_s']} CPU-s, "
                  f"kept {kept['wall_s']} s / {kept['cpu_s']} CPU-s", flush=True)

    def summary(key: str, cond: str) -> Dict[str, float]:
        vals = [r[cond][key] if cond else r[key] for r in rounds]
        return {"median": round(statistics.median(vals), 3), "min": min(vals), "max": max(vals)}

    out = run_header("fit_start")
    out.update({
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "setup": {"workers": args.workers, "steps": args.steps, "train_func": "ddp_regression (DDP, gloo)"},
        "fresh_wall_s": summary("wall_s", "fresh"), "kept_wall_s": summary("wall_s", "kept"),
        "fresh_cpu_s": summary("cpu_s", "fresh"), "kept_cpu_s": summary("cpu_s", "kept"),
        "fresh_to_first_step_s": summary("to_first_step_s", "fresh"),
        "kept_to_first_step_s": summary("to_first_step_s", "kept"),
        "wall_ratio_kept_to_fresh": summary("wall_ratio", ""),
        "cpu_ratio_kept_to_fresh": summary("cpu_ratio", ""),
        "rounds": rounds,
    })
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(json.dumps({k: out[k] for k in ("fresh_wall_s", "kept_wall_s", "fresh_cpu_s", "kept_cpu_s",
                                           "wall_ratio_kept_to_fresh", "cpu_ratio_kept_to_fresh")}))


if __name__ == "__main__":
    main()
