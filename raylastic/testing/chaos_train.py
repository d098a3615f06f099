"""Train functions for the chaos test and benchmark (importable by Ray workers).

Both train the same MLP on the same synthetic data with the same fixed global batch,
so a run under faults can be compared step for step with a fault-free one:

- :func:`chaos_elastic` (raylastic): ``ElasticState`` (an in-memory snapshot every step,
  persisted to storage every ``CheckpointConfig.persist_every`` steps) and
  ``ElasticDataLoader`` (the samples of global step k do not depend on the world size).
- :func:`chaos_ray_train` (Ray Train's ``TorchTrainer``, the anchor): the same global
  batches computed with ``raylastic.data``'s pure planning functions, a storage checkpoint
  every ``checkpoint_every`` steps through ``ray.train.report``.

What the fault injector and the checks read (every node of a local cluster shares this
machine's disk), all under ``config["log_dir"]``:

- ``members.jsonl``: one line per rank when a group starts training: ``group`` (a token rank
  0 broadcasts, the same on every rank of one group), ``rank``, ``world``, ``node_id``, ``pid``.
- ``steps.jsonl``: rank 0, one line per completed step: ``t``, ``step`` (global step counter
  since the start of the run, as restored), ``group``, ``world``.
- ``idx-<group>-<rank>.jsonl`` (raylastic only): the sample indices each rank trained per
  (epoch, step), with the run's step counter ``index``, for the exactly-once check.

Stopping: when ``config["stop_path"]`` exists (agreed by an all-reduce, so no rank is
left in a collective) :func:`chaos_elastic` finishes the current data epoch and returns,
so the run ends at a whole number of epochs that a fault-free reference can repeat (at
least ``config["min_epochs"]``, default 1: the faults are paced by time, so on a busy
machine all of them can land in the first epoch, and a check across an epoch boundary
needs a second);
:func:`chaos_ray_train` stops at once.

The model and data are float64 by default (``config["dtype"]``): summing the gradients of 1,
2 or 3 ranks in a different order changes float32 results by ~1e-7 per step, which over
hundreds of steps is larger than the 1e-5 the chaos test allows between a run under faults
and a fault-free one; in float64 that noise stays ~1e-13, so the check sees real errors
(a sample skipped or repeated, a stale optimizer state) and not the summation order.

``config["sample_sleep_s"]`` makes each rank sleep that long per sample it trained in a step:
a stand-in for accelerator time, which with a fixed global batch shrinks as the world grows
(``step_sleep_s`` is a fixed time per step, whatever the world size). The spot-economics
benchmark uses it so that more workers train more samples per second, as on real hardware.

``config["ballast_mb"]`` adds a constant buffer of that size to the model so a persisted
checkpoint takes long enough to upload that a node can be killed during the upload.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn

FEATURES = 16


def _dtype(config: Dict[str, Any]) -> torch.dtype:
    return getattr(torch, str(config.get("dtype", "float64")))


def make_data(n: int, config: Dict[str, Any]) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, FEATURES, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return x.to(_dtype(config)), y.to(_dtype(config))


def make_model(config: Dict[str, Any]) -> nn.Module:
    torch.manual_seed(int(config.get("seed", 0)))
    hidden = int(config.get("hidden", 64))
    model = nn.Sequential(
        nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, 1)
    ).to(_dtype(config))
    mb = float(config.get("ballast_mb", 0))
    if mb > 0:  # constant: checkpoint bytes, no compute
        # a frozen parameter, not a buffer: DDP broadcasts it once at construction only
        model.ballast = nn.Parameter(torch.zeros(int(mb * 2**20 / 4)), requires_grad=False)
    return model


def _group_token(world: int) -> str:
    """A random id rank 0 draws and broadcasts: the same on every rank of one group."""
    t = torch.tensor([int.from_bytes(uuid.uuid4().bytes[:6], "little")], dtype=torch.int64)
    if world > 1:
        dist.broadcast(t, src=0)
    return f"{int(t.item()):x}"


def _append(path: str, row: Dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row) + "\n")


def _log_member(log_dir: str, group: str, rank: int, world: int) -> None:
    import ray

    _append(
        os.path.join(log_dir, "members.jsonl"),
        {
            "t": time.time(),
            "group": group,
            "rank": rank,
            "world": world,
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
        },
    )


def _simulated_compute(config: Dict[str, Any], local_samples: int) -> None:
    """``step_sleep_s`` per step plus ``sample_sleep_s`` per sample this rank trained."""
    t = float(config.get("step_sleep_s") or 0) + float(config.get("sample_sleep_s") or 0) * local_samples
    if t > 0:
        time.sleep(t)


def _stop_requested(path: Optional[str], world: int) -> bool:
    flag = torch.tensor([1.0 if path and os.path.exists(path) else 0.0])
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item() > 0)


def chaos_elastic(config: Dict[str, Any]) -> None:
    """raylastic: ElasticState + ElasticDataLoader. config: n (1200), global_batch (48),
    micro_batch (8), epochs (max epochs, 10**6), lr (0.05), seed (0), hidden (64),
    ballast_mb (0), step_sleep_s (0), sample_sleep_s (0), log_dir, stop_path, min_epochs (1),
    weights_out."""
    import raylastic
    from raylastic.data import ElasticDataLoader

    n, seed = int(config.get("n", 1200)), int(config.get("seed", 0))
    x, y = make_data(n, config)
    model = make_model(config)
    opt = torch.optim.SGD(model.parameters(), lr=float(config.get("lr", 0.05)), momentum=0.9)
    loader = ElasticDataLoader(
        torch.utils.data.TensorDataset(x, y),
        global_batch_size=int(config.get("global_batch", 48)),
        micro_batch_size=int(config.get("micro_batch", 8)),
        shuffle=True,
        seed=seed,
    )
    # stop_epoch is state too: a group restored after the stop was seen finishes that epoch.
    state = raylastic.ElasticState(model=model, optimizer=opt, loader=loader, step=0, stop_epoch=-1)
    ctx = raylastic.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    log_dir = config["log_dir"]
    group = _group_token(world)
    _log_member(log_dir, group, rank, world)
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    idx = open(os.path.join(log_dir, f"idx-{group}-{rank}.jsonl"), "a", encoding="utf-8")
    max_epochs = int(config.get("epochs", 10**6))
    while loader.epoch < max_epochs and not (0 <= state.stop_epoch < loader.epoch):
        for batch in loader:
            opt.zero_grad()
            for (xb, yb), weight in batch.accumulate(ddp):
                (nn.functional.binary_cross_entropy_with_logits(ddp(xb), yb) * weight).backward()
            opt.step()
            idx.write(
                json.dumps(
                    {
                        "group": group,
                        "rank": rank,
                        "world": world,
                        "index": state.step + 1,
                        "epoch": batch.epoch,
                        "step": batch.step,
                        "indices": list(map(int, batch.indices)),
                    }
                )
                + "\n"
            )
            idx.flush()
            _simulated_compute(config, len(batch.indices))
            if state.stop_epoch < 0 and _stop_requested(config.get("stop_path"), world):
                state.stop_epoch = max(batch.epoch, int(config.get("min_epochs", 1)) - 1)
            state.step += 1
            if rank == 0:
                _append(
                    os.path.join(log_dir, "steps.jsonl"),
                    {"t": time.time(), "step": state.step, "group": group, "world": world},
                )
            state.commit({"step": state.step, "epoch": batch.epoch, "world_size": world})
    idx.close()
    if rank == 0 and config.get("weights_out"):
        weights = {k: v for k, v in model.state_dict().items() if k != "ballast"}
        torch.save({"weights": weights, "epochs": loader.epoch, "steps": state.step}, config["weights_out"])


def chaos_ray_train(config: Dict[str, Any]) -> None:
    """Ray Train: the same model, data and global batches; a checkpoint every
    ``checkpoint_every`` (20) steps; resumes from ``ray.train.get_checkpoint()``.
    config as :func:`chaos_elastic` plus checkpoint_every."""
    import ray.train

    from raylastic.data.plan import global_batch_indices, micro_batches, shard_for_rank, steps_per_epoch

    n, seed = int(config.get("n", 1200)), int(config.get("seed", 0))
    gbs, micro = int(config.get("global_batch", 48)), int(config.get("micro_batch", 8))
    x, y = make_data(n, config)
    model = make_model(config)
    opt = torch.optim.SGD(model.parameters(), lr=float(config.get("lr", 0.05)), momentum=0.9)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            saved = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        step = int(saved["step"])
    log_dir = config["log_dir"]
    group = _group_token(world)
    _log_member(log_dir, group, rank, world)
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    per_epoch = steps_per_epoch(n, gbs)
    every = int(config.get("checkpoint_every", 20))
    max_steps = int(config.get("epochs", 10**6)) * per_epoch
    while step < max_steps:
        epoch, k = divmod(step, per_epoch)
        shard = shard_for_rank(global_batch_indices(n, seed, epoch, k, gbs, True), rank, world)
        opt.zero_grad()
        for mb in micro_batches(shard, micro):
            # DDP averages over ranks: weight each micro-batch by its share of the global batch
            loss = nn.functional.binary_cross_entropy_with_logits(ddp(x[mb]), y[mb], reduction="sum")
            (loss * world / gbs).backward()
        opt.step()
        step += 1
        _simulated_compute(config, len(shard))
        stop = _stop_requested(config.get("stop_path"), world)
        if rank == 0:
            _append(
                os.path.join(log_dir, "steps.jsonl"), {"t": time.time(), "step": step, "group": group, "world": world}
            )
        metrics = {"step": step, "world_size": world}
        if step % every == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save(
                        {"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                        os.path.join(d, "state.pt"),
                    )
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
        else:
            ray.train.report(metrics)
        if stop:
            break
