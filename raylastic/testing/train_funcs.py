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
