"""Train functions over Ray Data input for the tests and the benchmark (shipped so the
workers import them by reference).

``ids_ddp``: a tiny DDP model over a dataset with an ``id`` column; every rank appends,
per step and before the step's all-reduce, the ids it trains to ``<log_dir>/<m_epoch>-<rank>.jsonl``, with the step
counter that is restored with the state, so a test can rebuild which rows the final
model's history trained. ``checkpoint="state"`` keeps state in ``ElasticState``
(snapshot every step); ``"report"`` has rank 0 write a checkpoint through
``ray.train.report`` every step (no ElasticState).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Dict

import ray.train
import ray.train.torch
import torch

import raylastic
from raylastic.testing.pace import pace


def ids_ddp(config: Dict[str, Any]) -> None:
    ctx = raylastic.get_context()
    shard = ray.train.get_dataset_shard("train")
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    use_state = config["checkpoint"] == "state"
    step = 0
    if use_state:
        state = raylastic.ElasticState(model=model, optimizer=opt, step=0)
    else:
        state = None
        ckpt = ray.train.get_checkpoint()
        if ckpt is not None:
            with ckpt.as_directory() as d:
                saved = torch.load(os.path.join(d, "state.pt"), weights_only=True)
            model.load_state_dict(saved["model"])
            step = saved["step"]
    log = open(os.path.join(config["log_dir"], f"{ctx.get_membership_epoch()}-{ctx.get_world_rank()}.jsonl"), "a")
    while shard.position().epoch < config["epochs"]:
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"], dtypes=torch.float32):
            ids = batch["id"]
            pos = shard.position()  # moved on when the batch was yielded
            step = (state.step if state else step) + 1
            # Logged before the all-reduce: a rank whose node dies after it (the step
            # counts) has its row; one that dies before it leaves a row past the step the
            # next group restores, which a test drops. Which ids a rank gets depends on the
            # dataset's block order, so a test cannot fill in a missing row.
            log.write(
                json.dumps(
                    {
                        "m_epoch": ctx.get_membership_epoch(),
                        "rank": ctx.get_world_rank(),
                        "world": ctx.get_world_size(),
                        "step": step,
                        "epoch": pos.epoch - 1 if pos.rows == 0 else pos.epoch,
                        "ids": [int(i) for i in ids.tolist()],
                    }
                )
                + "\n"
            )
            log.flush()
            opt.zero_grad()
            ddp(ids.view(-1, 1) / 1000.0).sum().backward()
            opt.step()
            pace(config, ctx.get_world_size(), float(config.get("step_sleep_s", 0.0)))
            if state is not None:
                state.step = step
                state.commit({"step": step})
            else:
                with tempfile.TemporaryDirectory() as d:
                    if ctx.get_world_rank() == 0:
                        torch.save({"model": model.state_dict(), "step": step}, os.path.join(d, "state.pt"))
                    ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(d))
    log.close()


def count_rows(config: Dict[str, Any]) -> None:
    """The benchmark's train loop (framework-neutral: Ray Train or raylastic): iterate the
    shard for ``epochs`` passes, touch each batch; each rank writes its rows and the time
    from its first batch (startup excluded) to ``<out_dir>/<tag>-<rank>.json``."""
    ctx = ray.train.get_context()
    shard = ray.train.get_dataset_shard("train")
    rows, start = 0, None
    for _ in range(config["epochs"]):
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"]):
            if start is None:
                start = time.perf_counter()
            rows += len(batch["id"])
    elapsed = time.perf_counter() - (start or time.perf_counter())
    with open(os.path.join(config["out_dir"], f"{config['tag']}-{ctx.get_world_rank()}.json"), "w") as fh:
        json.dump({"rows": rows, "s": elapsed}, fh)
    ray.train.report({"rows": rows})


def ids_neutral(config: Dict[str, Any]) -> None:
    """For counting rows repeated / skipped around a node loss under Ray Train and
    raylastic alike: DDP over an ``id`` column, a checkpoint (epoch, step) from rank 0 every
    step, one log line per step with an attempt token (ordered by start time)."""
    import uuid

    ctx = ray.train.get_context()
    model = ray.train.torch.prepare_model(torch.nn.Linear(1, 1))
    # One token per attempt: rank 0's, sent to every rank (attempts sort by its start time).
    box = [f"{time.time():.6f}-{uuid.uuid4().hex[:6]}"]
    torch.distributed.broadcast_object_list(box, src=0)
    token = box[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    epoch, step = 0, 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            saved = json.load(open(os.path.join(d, "pos.json")))
        epoch, step = saved["epoch"], saved["step"]
    shard = ray.train.get_dataset_shard("train")
    log = open(os.path.join(config["log_dir"], f"{token}-{ctx.get_world_rank()}.jsonl"), "a")
    while epoch < config["epochs"]:
        for batch in shard.iter_torch_batches(batch_size=config["batch_size"], dtypes=torch.float32):
            ids = batch["id"]
            opt.zero_grad()
            model(ids.view(-1, 1) / 1000.0).sum().backward()
            opt.step()
            step += 1
            log.write(
                json.dumps(
                    {
                        "token": token,
                        "rank": ctx.get_world_rank(),
                        "world": ctx.get_world_size(),
                        "epoch": epoch,
                        "step": step,
                        "ids": [int(i) for i in ids.tolist()],
                    }
                )
                + "\n"
            )
            log.flush()
            pace(config, ctx.get_world_size(), float(config.get("step_sleep_s", 0.0)))
            with tempfile.TemporaryDirectory() as d:
                if ctx.get_world_rank() == 0:
                    with open(os.path.join(d, "pos.json"), "w") as fh:
                        json.dump({"epoch": epoch, "step": step}, fh)
                ray.train.report({"step": step, "epoch": epoch}, checkpoint=ray.train.Checkpoint.from_directory(d))
        epoch += 1
    log.close()
