"""Train functions for ``benchmarks/sharded_recovery.py``: one wide MLP under FSDP2
(``fully_shard``) or DeepSpeed ZeRO, runnable under raylastic's ``ElasticTrainer``
(state in ``ElasticState``, ``config["mode"] == "raylastic"``) and under Ray Train's
``TorchTrainer`` (``config["mode"] == "ray_train"``: its own checkpointing, as Ray Train
documents it: every rank saves its shard with ``torch.distributed.checkpoint`` (FSDP2)
or ``engine.save_checkpoint`` (DeepSpeed) into a directory it reports with
``ray.train.report``; Ray Train uploads every rank's files into one checkpoint).

Both modes train the same math: a fixed global batch (``global_batch``, split evenly
over the ranks; must divide by 2 and 3), drawn from the step number, Adam / AdamW.

What the benchmark reads (all appended as JSON lines, ``config["log_dir"]``):

* ``steps.jsonl`` (rank 0, after every step): ``{"t", "step", "world"}``.
* ``stats-<rank>.jsonl`` (every rank, after every step): step time, the process RSS,
  ``ElasticState.snapshot_bytes()`` and the snapshot stall so far (raylastic) or the
  checkpoint save time (Ray Train).
* ``resumes.jsonl`` (rank 0, once per group start): where the state came from
  (``memory`` / ``storage`` / ``none``), the step it resumed after, and, for Ray Train,
  the exception a checkpoint load raised (the run then starts over from step 0 with a
  fresh model: the best a train function can do with a checkpoint it cannot load).

Training stops when ``config["stop_path"]`` exists (agreed with an all-reduce). Ray Train
mode also checkpoints at once on a preemption notice (``ray.train.get_preemption_info``,
agreed with the same all-reduce: every rank must join the collective save).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch import nn


def build_mlp(config: Dict[str, Any]) -> nn.Sequential:
    """``d_in`` -> ``hidden`` x ``layers`` (ReLU) -> 1."""
    torch.manual_seed(int(config.get("seed", 0)))
    d_in, hidden, layers = int(config.get("d_in", 64)), int(config.get("hidden", 1024)), int(config.get("layers", 3))
    mods: list = [nn.Linear(d_in, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(hidden, hidden), nn.ReLU()]
    mods.append(nn.Linear(hidden, 1))
    return nn.Sequential(*mods)


def n_params(config: Dict[str, Any]) -> int:
    d_in, hidden, layers = int(config.get("d_in", 64)), int(config.get("hidden", 1024)), int(config.get("layers", 3))
    return d_in * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden + 1


def _batch(config: Dict[str, Any], step: int, rank: int, world: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of step ``step``'s global batch (the same at every world size)."""
    gb, d_in = int(config.get("global_batch", 48)), int(config.get("d_in", 64))
    if gb % world:
        raise ValueError(f"global_batch={gb} does not divide by the world size {world}")
    g = torch.Generator().manual_seed(1000003 * int(config.get("seed", 0)) + step)
    x = torch.randn(gb, d_in, generator=g)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    per = gb // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _rss() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _append(path: str, row: Dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def _preempted() -> bool:
    import ray.train

    fn = getattr(ray.train, "get_preemption_info", None)
    try:
        return fn is not None and fn() is not None
    except Exception:  # noqa: BLE001
        return False


class _Loop:
    """The per-step bookkeeping both frameworks share."""

    def __init__(self, config: Dict[str, Any], framework: str):
        import ray.train

        ctx = ray.train.get_context()
        self.config, self.framework = config, framework
        self.mode = config.get("mode", "raylastic")
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.log_dir = config["log_dir"]
        self.stop_path = config.get("stop_path")
        self.every = int(config.get("checkpoint_every", 10))
        self.notified = False
        self.t0 = time.time()

    def resumed(self, source: str, start: int, error: Optional[str] = None, load_s: float = 0.0) -> None:
        if self.rank == 0:
            _append(os.path.join(self.log_dir, "resumes.jsonl"),
                    {"t": time.time(), "world": self.world, "source": source, "start": start,
                     "error": error, "load_s": round(load_s, 3), "framework": self.framework, "mode": self.mode})

    def flags(self) -> Tuple[bool, bool]:
        """(stop, checkpoint now: a preemption notice, Ray Train mode), agreed by all ranks."""
        stop = 1.0 if self.stop_path and os.path.exists(self.stop_path) else 0.0
        pre = 1.0 if self.mode == "ray_train" and not self.notified and _preempted() else 0.0
        t = torch.tensor([stop, pre])
        if self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if t[1] > 0:
            self.notified = True
        return bool(t[0] > 0), bool(t[1] > 0)

    def step_done(self, step: int) -> None:
        """Rank 0's ``steps.jsonl`` row, at the end of the optimizer step: before the
        report or commit, which may end the attempt (a graceful stop raises in the commit
        of the stop index, whose step is kept; a row written after it was missing, and
        the measured pause then held that whole step)."""
        if self.rank == 0:
            _append(os.path.join(self.log_dir, "steps.jsonl"), {"t": time.time(), "step": step, "world": self.world})

    def log_step(self, step: int, step_s: float, extra: Dict[str, Any]) -> None:
        now = time.time()
        _append(os.path.join(self.log_dir, f"stats-{self.rank}.jsonl"),
                {"t": now, "step": step, "world": self.world, "rank": self.rank, "step_s": round(step_s, 5),
                 "rss": _rss(), **extra})


def fsdp2_bench(config: Dict[str, Any]) -> None:
    """FSDP2 (``fully_shard`` per Linear and at the root) + Adam."""
    import ray.train
    from torch.distributed.fsdp import fully_shard

    loop = _Loop(config, "fsdp2")
    model = build_mlp(config)
    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=float(config.get("lr", 1e-4)))
    start, state = 0, None
    t_load = time.perf_counter()
    if loop.mode == "raylastic":
        import raylastic

        state = raylastic.ElasticState(model=model, optimizer=opt, step=0,
                                       snapshot_every=int(config.get("snapshot_every", 1)),
                                       lean_snapshots=config.get("lean_snapshots") or False)
        start = state.step
        loop.resumed(state.restored_from, start, load_s=time.perf_counter() - t_load)
    else:
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            loop.resumed("none", 0)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            with ckpt.as_directory() as d:
                msd, osd = get_state_dict(model, opt)
                sd: Dict[str, Any] = {"model": msd, "optim": osd}
                dcp.load(sd, checkpoint_id=d)
                set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
                with open(os.path.join(d, "step.json")) as fh:
                    start = int(json.load(fh)["step"])
            loop.resumed("storage", start, load_s=time.perf_counter() - t_load)
    step = start
    while True:
        t0 = time.perf_counter()
        step += 1
        x, y = _batch(config, step, loop.rank, loop.world)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loop.step_done(step)
        stop, now = loop.flags()
        metrics = {"step": step, "loss": float(loss.detach()), "world_size": loop.world}
        extra: Dict[str, Any] = {}
        if state is not None:
            state.step = step
            state.commit(metrics)
            extra = {"snapshot_bytes": state.snapshot_bytes(), "blocked_s": round(state._half.blocked_s, 5)}
        elif step % loop.every == 0 or now:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            ts = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                msd, osd = get_state_dict(model, opt)
                dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)
                if loop.rank == 0:
                    with open(os.path.join(d, "step.json"), "w") as fh:
                        json.dump({"step": step}, fh)
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
            extra = {"ckpt_s": round(time.perf_counter() - ts, 4), "preempt_ckpt": now}
        else:
            ray.train.report(metrics)
        loop.log_step(step, time.perf_counter() - t0, extra)
        if stop:
            break


def _reset_zero3_ids() -> None:
    """ZeRO-3's process-global module/parameter counters (see
    ``raylastic._internal.snapshots.sharded.deepspeed._reset_zero3_ids``; raylastic resets them at
    every group teardown, this covers the Ray Train anchor's restarts too)."""
    from raylastic._internal.snapshots.sharded.deepspeed import _reset_zero3_ids as reset
    reset()


def _ds_engine(config: Dict[str, Any], world: int):
    import logging

    import deepspeed

    if config.get("reset_zero3_ids", True):
        _reset_zero3_ids()

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)
    gb = int(config.get("global_batch", 48))
    ds_config = {"train_micro_batch_size_per_gpu": gb // world, "gradient_accumulation_steps": 1,
                 "optimizer": {"type": "AdamW", "params": {"lr": float(config.get("lr", 1e-4)),
                                                           "weight_decay": 0.0, "torch_adam": True}},
                 "zero_optimization": {"stage": int(config.get("zero_stage", 3)),
                                       "stage3_param_persistence_threshold": 0},
                 "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=build_mlp(config), config=ds_config)
    return engine


def deepspeed_bench(config: Dict[str, Any]) -> None:
    """DeepSpeed ZeRO (``zero_stage``, default 3), fp32, torch's AdamW."""
    import ray.train

    loop = _Loop(config, f"zero{int(config.get('zero_stage', 3))}")
    engine = _ds_engine(config, loop.world)
    start, state = 0, None
    t_load = time.perf_counter()
    if loop.mode == "raylastic":
        import raylastic

        state = raylastic.ElasticState(engine=engine, step=0, snapshot_every=int(config.get("snapshot_every", 1)),
                                       lean_snapshots=config.get("lean_snapshots") or False)
        start = state.step
        loop.resumed(state.restored_from, start, load_s=time.perf_counter() - t_load)
    else:
        ckpt = ray.train.get_checkpoint()
        if ckpt is None:
            loop.resumed("none", 0)
        else:
            error = None
            with ckpt.as_directory() as d:
                try:
                    path, client = engine.load_checkpoint(d)
                    if path is None:
                        raise RuntimeError(f"engine.load_checkpoint({d!r}) found nothing to load")
                    start = int(client["step"])
                except Exception as e:  # noqa: BLE001 - measured and reported, not assumed
                    error = f"{type(e).__name__}: {e}"[:2000]
            failed = torch.tensor([1.0 if error else 0.0])
            if loop.world > 1:
                dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed.item() > 0:
                # The checkpoint does not load here: a fresh engine (a partial load must
                # not be trained on) and a restart from step 0.
                loop.resumed("failed_then_scratch", 0, error=error or "another rank's load failed",
                             load_s=time.perf_counter() - t_load)
                engine = _ds_engine(config, loop.world)
                start = 0
            else:
                loop.resumed("storage", start, load_s=time.perf_counter() - t_load)
    step = start
    while True:
        t0 = time.perf_counter()
        step += 1
        x, y = _batch(config, step, loop.rank, loop.world)
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        loop.step_done(step)
        stop, now = loop.flags()
        metrics = {"step": step, "loss": float(loss.detach()), "world_size": loop.world}
        extra: Dict[str, Any] = {}
        if state is not None:
            state.step = step
            state.commit(metrics)
            extra = {"snapshot_bytes": state.snapshot_bytes(), "blocked_s": round(state._half.blocked_s, 5)}
        elif step % loop.every == 0 or now:
            ts = time.perf_counter()
            with tempfile.TemporaryDirectory() as d:
                engine.save_checkpoint(d, tag=f"step{step}", client_state={"step": step})
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
            extra = {"ckpt_s": round(time.perf_counter() - ts, 4), "preempt_ckpt": now}
        else:
            ray.train.report(metrics)
        loop.log_step(step, time.perf_counter() - t0, extra)
        if stop:
            break


__all__ = ["build_mlp", "n_params", "fsdp2_bench", "deepspeed_bench"]
