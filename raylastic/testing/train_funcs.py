"""Small train functions used by tests, examples and benchmarks.

They are in an importable module (not a test file) so Ray workers can unpickle them.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch import nn

import raylastic


def ddp_regression(config: Dict[str, Any]) -> Dict[str, Any]:
    """Linear regression under DDP; one report per step, a checkpoint every
    ``checkpoint_every`` steps. Resumes from the last committed checkpoint.

    config: total_steps, checkpoint_every (1), step_sleep_s (0), fail_at_step (None),
    fail_rank (0), dim (8), batch (16), lr (0.05), seed (0).
    """
    total = int(config.get("total_steps", 20))
    every = int(config.get("checkpoint_every", 1))
    sleep_s = float(config.get("step_sleep_s", 0.0))
    fail_at = config.get("fail_at_step")
    dim = int(config.get("dim", 8))
    ctx = raylastic.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(int(config.get("seed", 0)))
    model = nn.Linear(dim, 1)
    opt = torch.optim.SGD(model.parameters(), lr=float(config.get("lr", 0.05)))
    start = 0
    ckpt = raylastic.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    true_w = torch.arange(dim, dtype=torch.float32).unsqueeze(1) / dim
    for step in range(start + 1, total + 1):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(int(config.get("batch", 16)), dim, generator=g)
        y = x @ true_w
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if fail_at is not None and step == int(fail_at) and rank == int(config.get("fail_rank", 0)) \
                and ctx.get_restart_count() < int(config.get("fail_times", 1)):
            raise ValueError(f"injected failure at step {step}")
        if sleep_s:
            time.sleep(sleep_s)
        metrics = {"step": step, "loss": float(loss.detach()), "world_size": world,
                   "epoch_id": ctx.get_membership_epoch()}
        if step % every == 0 or step == total:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(d, "state.pt"))
                raylastic.report(metrics, checkpoint=raylastic.Checkpoint.from_directory(d) if rank == 0 else None)
        else:
            raylastic.report(metrics)
    return {"rank": rank, "final_step": total}


def mlp_bench(config: Dict[str, Any]) -> None:
    """An MLP regression written against Ray Train's API only (``ray.train.report``,
    ``get_checkpoint``, ``get_context``), so the same function runs under Ray Train's
    ``TorchTrainer`` and under ``ElasticTrainer`` in the recovery benchmark.

    Rank 0 appends ``{"t", "step", "world"}`` to ``config["log_path"]`` after every
    step: the benchmark measures both frameworks from the same file. Training stops
    at ``total_steps`` or when ``config["stop_path"]`` exists (checked on every rank
    and agreed with an all-reduce, so no rank is left in a collective).
    """
    import json

    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    hidden, layers = int(config.get("hidden", 512)), int(config.get("layers", 4))
    dim, batch = int(config.get("dim", 64)), int(config.get("batch", 32))
    torch.manual_seed(0)
    mods = [nn.Linear(dim, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    every = int(config.get("checkpoint_every", 10))
    stop_path = config.get("stop_path")
    for step in range(start + 1, int(config.get("total_steps", 10**9)) + 1):
        g = torch.Generator().manual_seed(step * 7919 + rank)
        x = torch.randn(batch, dim, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        stop = torch.tensor([1.0 if stop_path and os.path.exists(stop_path) else 0.0])
        if world > 1:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if rank == 0 and config.get("log_path"):
            with open(config["log_path"], "a") as fh:
                fh.write(json.dumps({"t": time.time(), "step": step, "world": world}) + "\n")
        metrics = {"step": step, "loss": float(loss.detach()), "world_size": world}
        if step % every == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                               os.path.join(d, "state.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
        else:
            ray.train.report(metrics)
        if stop.item() > 0:
            break
