"""Per-step overhead of ElasticDataLoader vs DataLoader + DistributedSampler.

Same synthetic data, same small MLP, same per-rank batch (world_size=2, rank=0 for both, so
the sampler / shard logic is exercised), single process. Repetitions alternate between the
loaders (rotating which goes first) so drift on a shared machine hits all; reported: the
median steps/s of each and the median of the per-repetition paired ratios as the overhead,
from wall time and from process CPU time (less sensitive to other load on the machine).
``elastic_accumulate`` also runs the documented ``accumulate(model)`` + ``loss * weight``
pattern, whose extra cost is mostly the scalar multiply in the user's loss.

    .venv/bin/python benchmarks/data_overhead.py [--reps 45] [--num-workers 0]

Writes benchmarks/results/data_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from raylastic.data import ElasticDataLoader

WORLD, RANK = 2, 0


def _model(dim: int, classes: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(dim, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
        torch.nn.Linear(256, classes),
    )


def _train_step(model, x, y, weight=None):
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if weight is not None:
        loss = loss * weight
    loss.backward()


def run_baseline(dataset, model, opt, cfg, epoch):
    sampler = DistributedSampler(dataset, num_replicas=WORLD, rank=RANK, shuffle=True,
                                 seed=0, drop_last=True)
    sampler.set_epoch(epoch)
    loader = DataLoader(dataset, batch_size=cfg["per_rank_batch"], sampler=sampler,
                        drop_last=True, num_workers=cfg["num_workers"])
    steps, wall, cpu = 0, time.perf_counter(), time.process_time()
    for x, y in loader:
        opt.zero_grad()
        _train_step(model, x, y)
        opt.step()
        steps += 1
    return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu)


def run_elastic(dataset, model, opt, cfg, epoch, accumulate=False):
    loader = ElasticDataLoader(dataset, global_batch_size=cfg["per_rank_batch"] * WORLD,
                               micro_batch_size=cfg["per_rank_batch"], shuffle=True, seed=0,
                               num_workers=cfg["num_workers"], world_size=WORLD, rank=RANK)
    loader.set_epoch(epoch)
    steps, wall, cpu = 0, time.perf_counter(), time.process_time()
    for step_batch in loader:
        opt.zero_grad()
        if accumulate:  # the documented pattern: weights + no_sync context per micro-batch
            for (x, y), weight in step_batch.accumulate(model):
                _train_step(model, x, y, weight)
        else:
            for x, y in step_batch:
                _train_step(model, x, y)
        opt.step()
        steps += 1
    return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=45)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    default_out = pathlib.Path(__file__).parent / "results" / "data_overhead.json"
    parser.add_argument("--out", default=str(default_out))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = {"samples": args.samples, "features": 64, "classes": 10,
           "per_rank_batch": args.per_rank_batch, "world_size": WORLD, "rank": RANK,
           "num_workers": args.num_workers, "reps": args.reps, "threads": args.threads,
           "model": "MLP 64-256-256-10, SGD",
           "steps_per_rep": args.samples // (args.per_rank_batch * WORLD)}
    gen = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(args.samples, cfg["features"], generator=gen),
                            torch.randint(0, cfg["classes"], (args.samples,), generator=gen))
    model = _model(cfg["features"], cfg["classes"])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    names = ("baseline", "elastic", "elastic_accumulate")
    wall = {name: [] for name in names}
    cpu = {name: [] for name in names}
    load_start = os.getloadavg()[0]
    run_baseline(dataset, model, opt, cfg, 0)  # warm-up
    run_elastic(dataset, model, opt, cfg, 0)
    for rep in range(args.reps):  # rotate who goes first
        for name in names[rep % 3:] + names[: rep % 3]:
            if name == "baseline":
                rate = run_baseline(dataset, model, opt, cfg, rep + 1)
            else:
                rate = run_elastic(dataset, model, opt, cfg, rep + 1,
                                   accumulate=name == "elastic_accumulate")
            wall[name].append(rate[0])
            cpu[name].append(rate[1])

    def overhead(rates, name):
        # Paired ratios (the runs of one repetition sit next to each other in time) are robust
        # to the slow load swings of a shared machine; the overhead is their median.
        ratios = [b / e for b, e in zip(rates["baseline"], rates[name])]
        return 100.0 * (statistics.median(ratios) - 1.0)

    med = {name: statistics.median(v) for name, v in wall.items()}
    out = {
        "elastic_steps_per_s": med["elastic"],
        "baseline_steps_per_s": med["baseline"],
        "overhead_pct": overhead(wall, "elastic"),
        "overhead_pct_of_medians": 100.0 * (med["baseline"] / med["elastic"] - 1.0),
        "overhead_pct_cpu_time": overhead(cpu, "elastic"),
        "elastic_accumulate_steps_per_s": med["elastic_accumulate"],
        "accumulate_overhead_pct": overhead(wall, "elastic_accumulate"),
        "accumulate_overhead_pct_cpu_time": overhead(cpu, "elastic_accumulate"),
        "runs_steps_per_s": wall,
        "runs_steps_per_cpu_s": cpu,
        "config": cfg,
        "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }
    path = pathlib.Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")
    keys = ("baseline_steps_per_s", "elastic_steps_per_s", "overhead_pct",
            "overhead_pct_of_medians", "overhead_pct_cpu_time", "elastic_accumulate_steps_per_s",
            "accumulate_overhead_pct", "accumulate_overhead_pct_cpu_time", "load_average_1m")
    print(json.dumps({k: out[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
