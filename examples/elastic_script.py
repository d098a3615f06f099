"""raylastic as a plain script: ``ElasticTrainer(...).fit()`` on 1-2 workers.

Where it runs:
- ``python examples/elastic_script.py``: with ``RAY_ADDRESS`` set (e.g. ``127.0.0.1:6379``)
  it joins that cluster; without it, it starts a local Ray on this machine.
- ``ray job submit --working-dir examples/job_submit -- python elastic_script.py``: the
  same script as a Ray job (``examples/job_submit/elastic_script.py`` is a link to this
  file; the upload copies its contents). See examples/job_submit/README.md.

It fits a tiny linear regression on synthetic data with DDP over gloo, checkpoints every
few steps, then prints the result, the world sizes and the ``raylastic report`` summary.
Options: ``--steps``, ``--storage-path``, ``--name`` (``--help``).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import ray
import torch
from torch import nn

import raylastic
from raylastic import CheckpointConfig, ElasticTrainer, RunConfig, ScalingConfig

FEATURES = 8


def make_data(n: int = 512):
    """y = x @ w_true + 0.5 + noise, the same on every rank (fixed seed)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=g)
    w_true = torch.arange(1, FEATURES + 1, dtype=torch.float32) / FEATURES
    y = x @ w_true + 0.5 + 0.01 * torch.randn(n, generator=g)
    return x, y.unsqueeze(1)


def train_func(config):
    ctx = raylastic.get_context()
    x, y = make_data()
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, 1)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"])
    start = 0
    ckpt = raylastic.get_checkpoint()
    if ckpt is not None:  # resuming after a resize or a restart
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    world, rank = ctx.get_world_size(), ctx.get_world_rank()
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    batch = config["batch_size"]
    for step in range(start + 1, config["steps"] + 1):
        # Each rank takes its slice of this step's global batch.
        lo = (step * batch) % len(x)
        idx = torch.arange(lo, lo + batch) % len(x)
        mine = idx[rank::world]
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x[mine]), y[mine])
        loss.backward()
        opt.step()
        metrics = {"step": step, "loss": loss.item(), "world_size": world}
        if step % config["checkpoint_every"] == 0 or step == config["steps"]:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(d, "state.pt"))
                raylastic.report(metrics, checkpoint=raylastic.Checkpoint.from_directory(d)
                                 if rank == 0 else None)
        else:
            raylastic.report(metrics)
        time.sleep(config["step_sleep_s"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(), "raylastic_examples"),
                   help="where the run directory goes (local path or s3://, abfs://, gs:// URI)")
    p.add_argument("--name", default=None, help="run name (default: elastic_script-<time>)")
    args = p.parse_args(argv)

    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)  # a running cluster (also what `ray job submit` sets)
    else:
        ray.init()  # a local Ray on this machine
    print(f"Python: {sys.executable}", flush=True)
    print(f"Ray GCS: {ray.get_runtime_context().gcs_address}", flush=True)
    print(f"Ray cluster resources: {ray.cluster_resources()}", flush=True)

    name = args.name or f"elastic_script-{int(time.time())}"
    trainer = ElasticTrainer(
        train_func,
        train_loop_config={"steps": args.steps, "lr": 0.1, "batch_size": 64,
                           "checkpoint_every": 10, "step_sleep_s": 0.05},
        scaling_config=ScalingConfig(min_workers=1, max_workers=2),
        run_config=RunConfig(name=name, storage_path=args.storage_path,
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
    result = trainer.fit()

    print(f"Final metrics: {result.metrics}")
    print(f"World sizes: {' -> '.join(map(str, result.world_sizes))}")
    print(f"Checkpoint: {result.checkpoint.path if result.checkpoint else None}")
    print(f"Run directory: {result.path}")
    print("\n--- raylastic report ---", flush=True)
    from raylastic.reporting.cli import main as report_main  # same as `raylastic report PATH`

    rc = report_main([result.path])
    print(f"ELASTIC_SCRIPT_OK steps={result.metrics.get('step')} "
          f"loss={result.metrics.get('loss', float('nan')):.4f}", flush=True)
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
