"""Train functions for sharded models (FSDP2, DeepSpeed ZeRO) under ``ElasticState``,
used by the sharded-resize tests, ``examples/sharded_fsdp2.py`` and
``benchmarks/sharded_recovery.py``.

Both keep the math of a fixed-size run across resizes: ``ElasticDataLoader`` with the
``fixed`` global batch, each micro-batch's mean loss scaled by ``m * W / G`` (FSDP2 and
ZeRO average gradients over ranks, as DDP does), and one ``state.commit()`` per step.
Every rank appends the sample indices it trained per step to
``index_log_dir/rank-<membership epoch>-<rank>.jsonl`` (the exactly-once check), and the
final full weights go to ``weights_out``.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import torch
from torch import nn

import raylastic
from raylastic.testing.pace import pace


def _dataset(config: Dict[str, Any]) -> torch.utils.data.TensorDataset:
    n, d_in = int(config.get("n", 600)), int(config.get("d_in", 16))
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, d_in, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) > 0).float()
    return torch.utils.data.TensorDataset(x, y)


def mlp(config: Dict[str, Any]) -> nn.Sequential:
    """Linear layers of ``hidden`` units (``layers`` of them): 16 -> hidden ... -> 1.
    ``hidden`` 33 by default: shards of uneven sizes at 2 and 3 ranks."""
    torch.manual_seed(int(config.get("seed", 0)))
    d_in, hidden, layers = int(config.get("d_in", 16)), int(config.get("hidden", 33)), int(config.get("layers", 2))
    mods: list = []
    width = d_in
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.Tanh()]
        width = hidden
    mods.append(nn.Linear(width, 1))
    return nn.Sequential(*mods)


def _log(config: Dict[str, Any], ctx) -> Optional[Any]:
    log_dir = config.get("index_log_dir")
    if not log_dir:
        return None
    return open(os.path.join(log_dir, f"rank-{ctx.get_membership_epoch()}-{ctx.get_world_rank()}.jsonl"), "a")


def _write_row(log, ctx, batch) -> None:
    if log is not None:
        log.write(
            json.dumps(
                {
                    "m_epoch": ctx.get_membership_epoch(),
                    "rank": ctx.get_world_rank(),
                    "world": ctx.get_world_size(),
                    "epoch": batch.epoch,
                    "step": batch.step,
                    "indices": list(map(int, batch.indices)),
                }
            )
            + "\n"
        )
        log.flush()


def _pace(config: Dict[str, Any], ctx) -> None:
    """``step_sleep_s`` per step; ``slow_below_world``: sleep ``slow_sleep_s`` instead while
    the group is smaller than that (a test's scale-up then lands before the run ends); a
    regrown group does not sleep (``pace.py``)."""
    sleep = float(config.get("step_sleep_s") or 0)
    if config.get("slow_below_world") and ctx.get_world_size() < int(config["slow_below_world"]):
        sleep = float(config.get("slow_sleep_s", 0.5))
    pace(config, ctx.get_world_size(), sleep)


def fsdp2_mlp(config: Dict[str, Any]) -> Dict[str, Any]:
    """FSDP2 (``fully_shard`` per Linear and at the root) + Adam, state in ``ElasticState``.

    config: n, global_batch (48), micro_batch (16), epochs, lr (0.01), hidden, layers,
    seed, step_sleep_s, persist_every, index_log_dir, weights_out, cuda (False: model and
    batches on the process's current CUDA device, for NCCL under ``use_gpu=True``)."""
    from torch.distributed.fsdp import fully_shard

    from raylastic.data import ElasticDataLoader

    ctx = raylastic.get_context()
    device = torch.device("cuda", torch.cuda.current_device()) if config.get("cuda") else torch.device("cpu")
    model = mlp(config).to(device)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=float(config.get("lr", 0.01)))
    seed = int(config.get("seed", 0))
    loader = ElasticDataLoader(
        _dataset(config),
        global_batch_size=int(config.get("global_batch", 48)),
        micro_batch_size=int(config.get("micro_batch", 16)),
        shuffle=True,
        seed=seed,
    )
    state = raylastic.ElasticState(
        model=model,
        optimizer=opt,
        loader=loader,
        step=0,
        persist_every=config.get("persist_every"),
        lean_snapshots=config.get("lean_snapshots") or False,
    )
    log = _log(config, ctx)
    epochs = int(config.get("epochs", 4))
    while loader.epoch < epochs:
        for batch in loader:
            for (xb, yb), weight in batch.accumulate(model):
                logits = model(xb.to(device))
                (nn.functional.binary_cross_entropy_with_logits(logits, yb.to(device)) * weight).backward()
            opt.step()
            opt.zero_grad()
            _write_row(log, ctx, batch)
            _pace(config, ctx)
            state.step += 1
            metrics = {
                "epoch": batch.epoch,
                "step": batch.step,
                "world_size": ctx.get_world_size(),
                "restored_from": state.restored_from,
            }
            if config.get("trace_weights"):  # a checksum of the full weights after each step
                metrics["wsum"] = float(sum(v.full_tensor().double().abs().sum() for v in model.state_dict().values()))
            state.commit(metrics)
    if log is not None:
        log.close()
    full = {k: v.full_tensor().detach().cpu().clone() for k, v in model.state_dict().items()}
    if ctx.get_world_rank() == 0 and config.get("weights_out"):
        torch.save(full, config["weights_out"])
    return _memory(state)


def deepspeed_mlp(config: Dict[str, Any]) -> Dict[str, Any]:
    """The same MLP and data under DeepSpeed ZeRO (``config["zero_stage"]`` 1, 2 or 3,
    fp32, torch's AdamW), state in ``ElasticState(engine=...)``. DeepSpeed reuses the
    process group raylastic formed. One micro-batch per rank per step
    (``train_micro_batch_size_per_gpu`` = global batch / world size, so the global batch
    must divide by every world size the run takes).

    config: as :func:`fsdp2_mlp` plus zero_stage."""
    import logging

    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param

    from raylastic.data import ElasticDataLoader

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    ctx = raylastic.get_context()
    world, gb = ctx.get_world_size(), int(config.get("global_batch", 48))
    if gb % world:
        raise ValueError(f"global_batch={gb} does not divide by the world size {world}")
    ds_config = {
        "train_micro_batch_size_per_gpu": gb // world,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": float(config.get("lr", 0.01)), "weight_decay": 0.0, "torch_adam": True},
        },
        "zero_optimization": {"stage": int(config.get("zero_stage", 2)), "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=mlp(config), config=ds_config)
    seed = int(config.get("seed", 0))
    loader = ElasticDataLoader(_dataset(config), global_batch_size=gb, micro_batch_size=gb, shuffle=True, seed=seed)
    state = raylastic.ElasticState(
        engine=engine,
        loader=loader,
        step=0,
        persist_every=config.get("persist_every"),
        lean_snapshots=config.get("lean_snapshots") or False,
    )
    log = _log(config, ctx)
    epochs = int(config.get("epochs", 4))
    while loader.epoch < epochs:
        for batch in loader:
            for (xb, yb), weight in batch.accumulate():
                engine.backward(nn.functional.binary_cross_entropy_with_logits(engine(xb), yb) * weight)
            engine.step()
            _write_row(log, ctx, batch)
            _pace(config, ctx)
            state.step += 1
            state.commit(
                {"epoch": batch.epoch, "step": batch.step, "world_size": world, "restored_from": state.restored_from}
            )
    if log is not None:
        log.close()
    full = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}
    if ctx.get_world_rank() == 0 and config.get("weights_out"):
        torch.save({f"{n}": t for n, t in full.items()}, config["weights_out"])
    return _memory(state)


def _memory(state: Any) -> Dict[str, Any]:
    """This rank's snapshot host bytes, its own shard now, and the shards each snapshot it
    keeps holds (bytes by rank at that snapshot's world size; see ``held_shard_bytes``)."""
    from raylastic._internal.snapshots.sharded.state import held_shard_bytes
    from raylastic._internal.snapshots.store import STORE

    state._half.wait()  # the last commit's copy (lean: and its peer copy) is over
    return {
        "snapshot_bytes": state.snapshot_bytes(),
        "shard_bytes": state.shard_bytes(),
        "held_shards": [held_shard_bytes(s) for s in STORE.held()],
    }


__all__ = ["fsdp2_mlp", "deepspeed_mlp", "mlp"]
