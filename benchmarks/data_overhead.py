"""Per-step overhead of ElasticDataLoader vs DataLoader + DistributedSampler.

Same synthetic data, same small MLP, same per-rank batch (world_size=2, rank=0 for both, so
the sampler / shard logic is exercised), single process. Repetitions alternate between the
loaders (rotating which goes first) so drift on a shared machine hits all; reported: the
median steps/s of each and the median of the per-repetition paired ratios as the overhead.
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


def _train_step(model, opt, x, y, weight=None):
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
    steps = 0
    start = time.perf_counter()
    for x, y in loader:
        opt.zero_grad()
        _train_step(model, opt, x, y)
        opt.step()
        steps += 1
    return steps / (time.perf_counter() - start)


def run_elastic(dataset, model, opt, cfg, epoch, accumulate=False):
    loader = ElasticDataLoader(dataset, global_batch_size=cfg["per_rank_batch"] * WORLD,
                               micro_batch_size=cfg["per_rank_batch"], shuffle=True, seed=0,
                               num_workers=cfg["num_workers"], world_size=WORLD, rank=RANK)
    loader.set_epoch(epoch)
    steps = 0
    start = time.perf_counter()
    for step_batch in loader:
        opt.zero_grad()
        if accumulate:  # the documented pattern: weights + no_sync context per micro-batch
            for (x, y), weight in step_batch.accumulate(model):
                _train_step(model, opt, x, y, weight)
        else:
            for x, y in step_batch:
                _train_step(model, opt, x, y)
        opt.step()
        steps += 1
    return steps / (time.perf_counter() - start)


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

    results = {"baseline": [], "elastic": [], "elastic_accumulate": []}
    load_start = os.getloadavg()[0]
    run_baseline(dataset, model, opt, cfg, 0)  # warm-up
    run_elastic(dataset, model, opt, cfg, 0)
    for rep in range(args.reps):  # alternate, rotating who goes first
        order = [("baseline", {}), ("elastic", {}), ("elastic_accumulate", {"accumulate": True})]
        order = order[rep % 3:] + order[: rep % 3]
        for name, kw in order:
            fn = run_baseline if name == "baseline" else run_elastic
            results[name].append(fn(dataset, model, opt, cfg, rep + 1, **kw))

    med = {k: statistics.median(v) for k, v in results.items()}
    # Paired ratios (runs of one repetition sit next to each other in time) are robust to the
    # slow load swings of a shared machine; the headline overhead is their median.
    def paired_overhead(name):
        ratios = [b / e for b, e in zip(results["baseline"], results[name])]
        return 100.0 * (statistics.median(ratios) - 1.0)

    out = {
        "elastic_steps_per_s": med["elastic"],
        "baseline_steps_per_s": med["baseline"],
        "overhead_pct": paired_overhead("elastic"),
        "overhead_pct_of_medians": 100.0 * (med["baseline"] / med["elastic"] - 1.0),
        "elastic_accumulate_steps_per_s": med["elastic_accumulate"],
        "accumulate_overhead_pct": paired_overhead("elastic_accumulate"),
        "runs_steps_per_s": results,
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
            "overhead_pct_of_medians", "elastic_accumulate_steps_per_s",
            "accumulate_overhead_pct", "load_average_1m")
    print(json.dumps({k: out[k] for k in keys}, indent=2))


if __name__ == "__main__":
    main()
