"""Ray Data input: raylastic's resumable split vs Ray Train's ``streaming_split``.

Why: raylastic splits a dataset itself (a coordinator executes each epoch once, every rank
cuts its slice of each global batch) so that the position survives resizes. This
measures what that costs in rows/s into the train loop, and what it buys in the epoch of a
node loss, against Ray Train 2.60's ``ray.train.torch.TorchTrainer`` on the same cluster,
dataset and batch size, in one run.

1. Throughput: the framework-neutral loop ``raylastic.testing.ray_data_funcs.count_rows``
   (iterate ``iter_torch_batches``, touch each batch) on 2 workers, a materialized dataset
   of ``--rows`` rows (an ``id`` and a 32-float vector), ``--epochs`` passes; rows/s =
   rows of all ranks / the slowest rank's time from its first batch. Interleaved: raylastic
   and Ray Train alternate, ``--rounds`` times each.
2. Node loss: ``ids_neutral`` (DDP, a checkpoint every step, one log line per step with
   the ids trained) on min 2 / max 3 workers; after step ``--kill-at`` the node of the
   last rank is removed. From the logs, the final model's history (each attempt's steps up
   to the point the next attempt restored from) gives, for the epoch of the loss, the rows
   trained twice or more (repeated) and the rows never trained (skipped). Ray Train's
   numbers are measured the same way.

``.venv/bin/python benchmarks/ray_data_input.py`` -> benchmarks/results/ray_data_input.json
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Dict, List

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

WORKER = {"CPU": 1, "slot": 1}


def _dataset(rows: int):
    import numpy as np
    import ray

    def add_x(batch):
        ids = batch["id"]
        return {"id": ids, "x": np.repeat(ids[:, None].astype(np.float32), 32, axis=1)}

    return ray.data.range(rows, override_num_blocks=16).map_batches(add_x).materialize()


def _trainer(framework: str, func, cfg: Dict[str, Any], storage: str, name: str, ds, num_workers, max_failures=0):
    import ray.train

    if framework == "raylastic":
        from raylastic import TorchTrainer
    else:
        from ray.train.torch import TorchTrainer
    return TorchTrainer(
        func, train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=num_workers, resources_per_worker=WORKER),
        run_config=ray.train.RunConfig(name=name, storage_path=storage,
                                       failure_config=ray.train.FailureConfig(max_failures=max_failures)),
        datasets={"train": ds})


def throughput(framework: str, ds, args, storage: str, tag: str) -> Dict[str, Any]:
    from raylastic.testing.ray_data_funcs import count_rows

    out = tempfile.mkdtemp(prefix="rdbench-")
    cfg = {"epochs": args.epochs, "batch_size": args.batch_size, "out_dir": out, "tag": tag}
    start = time.perf_counter()
    _trainer(framework, count_rows, cfg, storage, tag, ds, 2).fit()
    wall = time.perf_counter() - start
    ranks = [json.load(open(f)) for f in glob.glob(os.path.join(out, f"{tag}-*.json"))]
    rows = sum(r["rows"] for r in ranks)
    slowest = max(r["s"] for r in ranks)
    return {"framework": framework, "rows": rows, "loop_s": slowest, "rows_per_s": rows / slowest,
            "fit_wall_s": wall, "per_rank": ranks}


def _history(log_dir: str) -> List[Dict[str, Any]]:
    """The steps the final model's history kept: each attempt's steps before the first
    step of the next attempt (which resumed from a checkpoint)."""
    lines = [json.loads(l) for f in glob.glob(os.path.join(log_dir, "*.jsonl")) for l in open(f)]
    tokens = sorted({r["token"] for r in lines}, key=lambda t: float(t.split("-")[0]))
    first = {t: min(r["step"] for r in lines if r["token"] == t) for t in tokens}
    attempts: List[List[str]] = [[t] for t in tokens]  # one token per attempt (rank 0's)
    kept = []
    for i, group in enumerate(attempts):
        until = min(first[t] for t in attempts[i + 1]) if i + 1 < len(attempts) else float("inf")
        kept += [r for r in lines if r["token"] in group and r["step"] < until]
    return kept, lines, attempts


def node_loss(framework: str, cluster, ds, args, storage: str) -> Dict[str, Any]:
    from raylastic.testing.ray_data_funcs import ids_neutral

    log_dir = tempfile.mkdtemp(prefix="rdloss-")
    cfg = {"epochs": 2, "batch_size": args.loss_batch_size, "log_dir": log_dir, "step_sleep_s": 0.1}
    trainer = _trainer(framework, ids_neutral, cfg, storage, f"loss_{framework}", ds, (2, 3), max_failures=-1)
    box: Dict[str, Any] = {}
    th = threading.Thread(target=lambda: box.setdefault("result", _fit(trainer, box)), daemon=True)
    th.start()
    deadline = time.monotonic() + 300
    killed_at = None
    while time.monotonic() < deadline and th.is_alive():
        lines = [json.loads(l) for f in glob.glob(os.path.join(log_dir, "*.jsonl")) for l in open(f)]
        if {r["world"] for r in lines} == {3} and max((r["step"] for r in lines), default=0) >= args.kill_at:
            killed_at = max(r["step"] for r in lines)
            cluster.remove_node(cluster.worker_nodes[-1] if framework == "ray_train" else _last_rank_node(cluster, storage, framework))
            break
        time.sleep(0.05)
    th.join(400)
    while len(cluster.worker_nodes) < 3:
        cluster.add_node()
    kept, lines, attempts = _history(log_dir)
    loss_epoch = max(r["epoch"] for r in kept if r["token"] in attempts[0])
    n = ds.count()
    count = collections.Counter(i for r in kept if r["epoch"] == loss_epoch for i in r["ids"])
    return {"framework": framework, "killed_after_step": killed_at, "attempts": len(attempts),
            "world_sizes": [max(r["world"] for r in lines if r["token"] in a) for a in attempts],
            "epoch_of_loss": loss_epoch, "rows_in_epoch": n,
            "rows_repeated": sum(c - 1 for c in count.values() if c > 1),
            "rows_skipped": n - len(count), "error": repr(box.get("error")) if box.get("error") else None}


def _fit(trainer, box):
    try:
        return trainer.fit()
    except BaseException as e:  # noqa: BLE001 - recorded in the JSON
        box["error"] = e
        return None


def _last_rank_node(cluster, storage: str, framework: str):
    """The node of raylastic's last rank (its group event names the nodes by rank)."""
    from raylastic.testing.faults import RunWatcher

    node_id = RunWatcher(os.path.join(storage, f"loss_{framework}")).current_group()["nodes"][-1]
    return cluster.node_by_id(node_id)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--loss-rows", type=int, default=1200)
    ap.add_argument("--loss-batch-size", type=int, default=8)
    ap.add_argument("--kill-at", type=int, default=15)
    ap.add_argument("--skip-loss", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                  "ray_data_input.json"))
    args = ap.parse_args()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    os.environ["OMP_NUM_THREADS"] = "1"
    from raylastic.testing.cluster import LocalCluster

    out: Dict[str, Any] = {"args": vars(args), "host": platform.node(), "cpus": os.cpu_count(),
                           "ts": time.time(), "throughput": [], "node_loss": []}
    with tempfile.TemporaryDirectory() as storage, \
            LocalCluster(num_nodes=3, cpus_per_node=1, node_resources={"slot": 1}, head_cpus=1,
                         object_store_memory=200 * 1024**2) as cluster:
        if not args.skip_throughput:
            ds = _dataset(args.rows)
            for i in range(args.rounds):
                order = ["raylastic", "ray_train"] if i % 2 == 0 else ["ray_train", "raylastic"]
                for fw in order:
                    r = throughput(fw, ds, args, storage, f"tp_{fw}_{i}")
                    print(f"round {i} {fw}: {r['rows_per_s']:.0f} rows/s ({r['loop_s']:.2f} s loop)", flush=True)
                    out["throughput"].append(r)
            by = {fw: [r["rows_per_s"] for r in out["throughput"] if r["framework"] == fw]
                  for fw in ("raylastic", "ray_train")}
            out["throughput_summary"] = {
                fw: {"median": statistics.median(v), "min": min(v), "max": max(v)} for fw, v in by.items()}
            out["throughput_summary"]["ratio_median"] = by and (
                statistics.median(by["raylastic"]) / statistics.median(by["ray_train"]))
            out["throughput_summary"]["ratio_per_round"] = [a / b for a, b in zip(by["raylastic"], by["ray_train"])]
        if not args.skip_loss:
            import ray

            ds = ray.data.range(args.loss_rows, override_num_blocks=6).materialize()
            for fw in ("raylastic", "ray_train"):
                r = node_loss(fw, cluster, ds, args, storage)
                print(f"node loss {fw}: {r}", flush=True)
                out["node_loss"].append(r)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1, default=str)
    print(json.dumps({k: out.get(k) for k in ("throughput_summary",)}, indent=1, default=str))


if __name__ == "__main__":
    main()
