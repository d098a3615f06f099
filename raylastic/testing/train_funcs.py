"""Small train functions used by tests, examples and benchmarks.

They are in an importable module (not a test file) so Ray workers can unpickle them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch import nn

import raylastic
from raylastic.testing.pace import pace


def ddp_regression(config: Dict[str, Any]) -> Dict[str, Any]:
    """Linear regression under DDP; one report per step, a checkpoint every
    ``checkpoint_every`` steps. Resumes from the last committed checkpoint.

    config: total_steps, checkpoint_every (1), step_sleep_s (0), fail_at_step (None),
    fail_rank (0), dim (8), batch (16), lr (0.05), seed (0), cuda (False: train on this
    worker's GPU, for the NCCL path), stuck_rank0_at (None: in the first group only, rank 0
    waits at that step for a message rank 1 never sends, i.e. it is blocked in a gloo
    operation that only the group timeout or an abort ends, while the others block in
    the next all-reduce), hang_rank0_at (None: in the first group only, rank 0 hangs at
    that step in its own code, outside any collective, where no abort reaches it),
    start_log (None: a file each rank appends a line to as the function starts: its
    membership epoch, rank, pid and whether torch._dynamo was imported already).
    """
    total = int(config.get("total_steps", 20))
    every = int(config.get("checkpoint_every", 1))
    sleep_s = float(config.get("step_sleep_s", 0.0))
    fail_at = config.get("fail_at_step")
    dim = int(config.get("dim", 8))
    ctx = raylastic.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if config.get("start_log"):
        line = {
            "epoch": ctx.get_membership_epoch(),
            "rank": rank,
            "pid": os.getpid(),
            "dynamo": "torch._dynamo" in sys.modules,
        }
        with open(config["start_log"], "a") as f:
            f.write(json.dumps(line) + "\n")
    torch.manual_seed(int(config.get("seed", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if config.get("cuda") else torch.device("cpu")
    model = nn.Linear(dim, 1).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=float(config.get("lr", 0.05)))
    start = 0
    ckpt = raylastic.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    true_w = (torch.arange(dim, dtype=torch.float32).unsqueeze(1) / dim).to(device)
    stuck_at = config.get("stuck_rank0_at")
    for step in range(start + 1, total + 1):
        if stuck_at is not None and step == int(stuck_at) and rank == 0 and ctx.get_membership_epoch() == 1:
            dist.recv(torch.zeros(1), src=1)
        _maybe_hang(config, step, rank, ctx)
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(int(config.get("batch", 16)), dim, generator=g).to(device)
        y = x @ true_w
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if (
            fail_at is not None
            and step == int(fail_at)
            and rank == int(config.get("fail_rank", 0))
            and ctx.get_restart_count() < int(config.get("fail_times", 1))
        ):
            raise ValueError(f"injected failure at step {step}")
        pace(config, world, sleep_s)
        metrics = {
            "step": step,
            "loss": float(loss.detach()),
            "world_size": world,
            "epoch_id": ctx.get_membership_epoch(),
        }
        if step % every == 0 or step == total:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save(
                        {"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                        os.path.join(d, "state.pt"),
                    )
                raylastic.report(metrics, checkpoint=raylastic.Checkpoint.from_directory(d) if rank == 0 else None)
        else:
            raylastic.report(metrics)
    return {"rank": rank, "final_step": total}


def mlp_bench(config: Dict[str, Any]) -> None:
    """An MLP regression written against Ray Train's API only (``ray.train.report``,
    ``get_checkpoint``, ``get_context``), so the same function runs under Ray Train's
    ``TorchTrainer`` and under ``ElasticTrainer`` in the recovery benchmark.

    With ``config["elastic_state"]`` (raylastic only) the state lives in an
    ``ElasticState`` committed every step instead of a checkpoint every
    ``checkpoint_every`` steps.

    Rank 0 appends ``{"t", "step", "world"}`` to ``config["log_path"]`` after every
    step: the benchmark measures both frameworks from the same file. Training stops
    at ``total_steps`` or when ``config["stop_path"]`` exists (checked on every rank
    and agreed with an all-reduce, so no rank is left in a collective).
    ``config["stuck_rank0_at"]`` (raylastic only, 3+ ranks): in the first group, at that
    step rank 0 blocks in a receive from rank 1, and ranks 1 and 2 in receives from each
    other: after a loss of rank 2's node, only the controller's abort frees rank 0.
    ``config["hang_rank0_at"]``: in the first group, rank 0 hangs at that step in its
    own code (no abort reaches it; the controller replaces it), the others block in the
    step's all-reduce.
    ``config["cuda"]``: model and batches on the process's current CUDA device (the
    collectives stay gloo: the GPU benchmark runs every rank on one shared GPU).
    """
    import json

    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    hidden, layers = int(config.get("hidden", 512)), int(config.get("layers", 4))
    if config.get("hidden_per_worker"):  # a model whose shape depends on the world size
        hidden = int(config["hidden_per_worker"]) * world
    dim, batch = int(config.get("dim", 64)), int(config.get("batch", 32))
    torch.manual_seed(0)
    mods = [nn.Linear(dim, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    device = torch.device("cuda", torch.cuda.current_device()) if config.get("cuda") else torch.device("cpu")
    model = nn.Sequential(*mods, nn.Linear(hidden, 1)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    start = 0
    state = None
    if config.get("elastic_state"):  # raylastic only: in-memory snapshots every step
        state = raylastic.ElasticState(model=model, optimizer=opt, step=0)
        start = state.step
    else:
        ckpt = ray.train.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                saved = torch.load(os.path.join(d, "state.pt"), weights_only=True, map_location=device)
            model.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            start = int(saved["step"])
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    every = int(config.get("checkpoint_every", 10))
    stop_path = config.get("stop_path")
    notified = False
    stuck_at = config.get("stuck_rank0_at")  # raylastic only, 3 or more ranks
    for step in range(start + 1, int(config.get("total_steps", 10**9)) + 1):
        # stuck_rank0_at is raylastic only, where ray.train.get_context() returns raylastic's
        # TrainContext; Ray's (what mypy sees) has no get_membership_epoch
        if stuck_at is not None and step == int(stuck_at) and ctx.get_membership_epoch() == 1 and rank < 3:  # type: ignore[attr-defined]
            # rank 0 waits for rank 1, which waits for rank 2 (and 2 for 1): losing rank 2's
            # node frees rank 1 (its peer's socket closes); only the abort frees rank 0
            dist.recv(torch.zeros(1), src=(1, 2, 1)[rank])
        _maybe_hang(config, step, rank, ctx)
        g = torch.Generator().manual_seed(step * 7919 + rank)
        x = torch.randn(batch, dim, generator=g).to(device)
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
        # Ray Train's documented reaction to a preemption notice: checkpoint now.
        preempted = state is None and _preemption_notice(ray.train) and not notified
        notified = notified or preempted
        if state is not None:
            state.step = step
            state.commit(metrics)  # persisted every CheckpointConfig.persist_every commits
        elif step % every == 0 or preempted:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save(
                        {"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                        os.path.join(d, "state.pt"),
                    )
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d) if rank == 0 else None)
        else:
            ray.train.report(metrics)
        if stop.item() > 0:
            break


def _preemption_notice(train_module) -> bool:
    """``ray.train.get_preemption_info()`` where it exists (Ray Train >= 2.55); raylastic
    answers None: its controller handles notices itself."""
    fn = getattr(train_module, "get_preemption_info", None)
    try:
        return fn is not None and fn() is not None
    except Exception:  # noqa: BLE001
        return False


def elastic_mlp(config: Dict[str, Any]) -> None:
    """A tiny MLP on a synthetic map-style dataset through ``ElasticDataLoader`` with
    the ``fixed`` batch policy; checkpoints weights, optimizer AND loader position.

    Used by the exactly-once and equivalence tests: every rank appends the sample
    indices it trained per global step to ``index_log_dir/rank-<membership epoch>-<rank>.jsonl``
    and rank 0 saves the final weights to ``weights_out``.

    A checkpoint is reported every step. config: n (600), global_batch (48),
    micro_batch (8), epochs (4), step_sleep_s (0), lr (0.05), seed (0), index_log_dir,
    weights_out.
    """
    import json

    from raylastic.data import ElasticDataLoader

    n, seed = int(config.get("n", 600)), int(config.get("seed", 0))
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    dataset = torch.utils.data.TensorDataset(x, y)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=float(config.get("lr", 0.05)), momentum=0.9)
    loader = ElasticDataLoader(
        dataset,
        global_batch_size=int(config.get("global_batch", 48)),
        micro_batch_size=int(config.get("micro_batch", 8)),
        shuffle=True,
        seed=seed,
    )
    ctx = raylastic.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    ckpt = raylastic.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        loader.load_state_dict(state["loader"])
    ddp = nn.parallel.DistributedDataParallel(model) if world > 1 else model
    log_dir = config.get("index_log_dir")
    log = open(os.path.join(log_dir, f"rank-{ctx.get_membership_epoch()}-{rank}.jsonl"), "a") if log_dir else None
    while loader.epoch < int(config.get("epochs", 4)):
        for batch in loader:
            opt.zero_grad()
            for (xb, yb), weight in batch.accumulate(ddp):
                (nn.functional.binary_cross_entropy_with_logits(ddp(xb), yb) * weight).backward()
            opt.step()
            if log is not None:
                log.write(
                    json.dumps(
                        {
                            "m_epoch": ctx.get_membership_epoch(),
                            "rank": rank,
                            "world": world,
                            "epoch": batch.epoch,
                            "step": batch.step,
                            "indices": list(map(int, batch.indices)),
                        }
                    )
                    + "\n"
                )
                log.flush()
            pace(config, world, float(config.get("step_sleep_s") or 0))
            metrics = {"epoch": batch.epoch, "step": batch.step, "world_size": world}
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:  # weights, optimizer and the loader's position, together
                    torch.save(
                        {"model": model.state_dict(), "opt": opt.state_dict(), "loader": loader.state_dict()},
                        os.path.join(d, "state.pt"),
                    )
                raylastic.report(metrics, checkpoint=raylastic.Checkpoint.from_directory(d) if rank == 0 else None)
    if log is not None:
        log.close()
    if rank == 0 and config.get("weights_out"):
        torch.save(model.state_dict(), config["weights_out"])


def _maybe_hang(config: Dict[str, Any], step: int, rank: int, ctx) -> None:
    """``config["hang_rank0_at"]``: rank 0 of the first group never gets past this step
    (a train function stuck in its own code: a data source that stopped answering).
    It stays until its process is killed."""
    at = config.get("hang_rank0_at")
    if at is not None and step == int(at) and rank == 0 and ctx.get_membership_epoch() == 1:
        while True:
            time.sleep(0.5)
