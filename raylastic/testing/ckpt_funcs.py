"""Train functions for the object-storage checkpoint tests (importable by Ray workers).

``sharded_checkpoints`` writes a *sharded* checkpoint: every rank passes its own shard to
``report()``, so a checkpoint is committed only when every rank's shard is uploaded. Each
shard is ``header + payload + trailer`` where header and trailer both carry the step and the
rank, so a truncated or mixed-up shard is detected on load without reading the payload.

Every rank appends what it does to ``<log_dir>/r<rank>-e<membership epoch>.jsonl`` (all
nodes of a ``LocalCluster`` share this machine's disk): ``start`` (node id, pid),
``restored`` (the step ``get_checkpoint()`` gave and whether every shard in it was whole),
``reported`` after each ``report()`` returns (so a test knows an upload is now in flight),
and ``finished``. With ``freeze`` (see :func:`sharded_checkpoints`) one rank also writes
``gate`` before a checkpoint's report and ``frozen`` after it. Tests read these lines to
act at a point of the run and to check what a resumed run loaded.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import tempfile
import time
from typing import Any, Dict, List, Optional

import raylastic
from raylastic.testing.pace import pace

META = "meta.json"
_HDR = struct.Struct("<8sqq")  # magic, step, rank
_MAGIC = b"RLXSHARD"


def shard_name(rank: int) -> str:
    return f"shard-r{rank}.bin"


def write_shard(path: str, step: int, rank: int, payload: bytes) -> None:
    head = _HDR.pack(_MAGIC, step, rank)
    with open(path, "wb") as fh:
        fh.write(head)
        fh.write(payload)
        fh.write(head)


def check_shard(fs, path: str, size: int) -> Optional[Dict[str, int]]:
    """Header and trailer of a shard on a pyarrow filesystem; None if they disagree
    (truncated, torn or foreign file)."""
    if size < 2 * _HDR.size:
        return None
    with fs.open_input_file(path) as fh:
        head = fh.read_at(_HDR.size, 0)
        tail = fh.read_at(_HDR.size, size - _HDR.size)
    if head != tail:
        return None
    magic, step, rank = _HDR.unpack(head)
    if magic != _MAGIC:
        return None
    return {"step": step, "rank": rank}


def load_checkpoint(ckpt) -> Dict[str, Any]:
    """Read ``meta.json`` and validate every shard of a (possibly remote) checkpoint."""
    import pyarrow.fs as pafs

    fs, base = ckpt.filesystem, ckpt.path.rstrip("/")
    with fs.open_input_stream(f"{base}/{META}") as fh:
        meta = json.loads(fh.read())
    infos = fs.get_file_info(pafs.FileSelector(base, recursive=False))
    shards = {i.base_name: i.size for i in infos if i.type == pafs.FileType.File and i.base_name.startswith("shard-")}
    problems: List[str] = []
    for r in range(int(meta["world_size"])):
        name = shard_name(r)
        if name not in shards:
            problems.append(f"{name} missing")
            continue
        hdr = check_shard(fs, f"{base}/{name}", shards[name])
        if hdr is None or hdr["step"] != meta["step"] or hdr["rank"] != r:
            problems.append(f"{name} damaged ({hdr})")
    return {"step": int(meta["step"]), "world_size": int(meta["world_size"]), "shards": shards, "problems": problems}


def sharded_checkpoints(config: Dict[str, Any]) -> Dict[str, Any]:
    """Lock-step ranks (one all-reduce per step), one report per step, a sharded
    checkpoint every ``checkpoint_every`` steps and at the last step.

    config: total_steps (20), checkpoint_every (5), step_sleep_s (0), log_dir (required),
    shard_bytes ({rank: bytes}; ranks not named write ``default_shard_bytes``, 64 KiB).
    A restored checkpoint with a damaged shard raises (the test then fails loudly).

    freeze ({"rank": r, "from_step": s, "dir": d}): in the first membership epoch, rank r
    waits before each checkpoint's report from step s on until the test writes
    ``<d>/go-<step>`` (120 s at most; the ranks are in lock-step, so the run waits), then
    reports and stops its own process (SIGSTOP) at once: its background upload is in
    flight, frozen, whatever the machine's load, until the test sends SIGCONT or kills it.
    """
    import torch
    import torch.distributed as dist

    total = int(config.get("total_steps", 20))
    every = int(config.get("checkpoint_every", 5))
    sleep_s = float(config.get("step_sleep_s", 0.0))
    ctx = raylastic.get_context()
    rank, world, epoch = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_membership_epoch()
    log_path = os.path.join(config["log_dir"], f"r{rank}-e{epoch}.jsonl")
    log = open(log_path, "a", buffering=1, encoding="utf-8")

    def emit(kind: str, **fields: Any) -> None:
        log.write(
            json.dumps({"t": time.time(), "kind": kind, "rank": rank, "epoch": epoch, "world_size": world, **fields})
            + "\n"
        )

    import ray

    emit(
        "start", node_id=ray.get_runtime_context().get_node_id(), pid=os.getpid(), restart_count=ctx.get_restart_count()
    )
    sizes = {int(k): int(v) for k, v in (config.get("shard_bytes") or {}).items()}
    size = sizes.get(rank, int(config.get("default_shard_bytes", 64 * 1024)))
    payload = os.urandom(max(0, size - 2 * _HDR.size))

    start = 0
    ckpt = raylastic.get_checkpoint()
    if ckpt is not None:
        loaded = load_checkpoint(ckpt)
        emit("restored", step=loaded["step"], path=ckpt.path, shards=loaded["shards"], problems=loaded["problems"])
        if loaded["problems"]:
            raise RuntimeError(f"restored a damaged checkpoint {ckpt.path}: {loaded['problems']}")
        start = loaded["step"]
    freeze = config.get("freeze") or {}
    frozen_here = bool(freeze) and rank == int(freeze["rank"]) and epoch == 1

    def gate(step: int) -> bool:
        if not (frozen_here and step >= int(freeze["from_step"])):
            return False
        emit("gate", index=step)
        go = os.path.join(freeze["dir"], f"go-{step}")
        deadline = time.monotonic() + 120
        while not os.path.exists(go):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the test never wrote {go}")
            time.sleep(0.01)
        return True

    acc = torch.zeros(1)
    for step in range(start + 1, total + 1):
        t = torch.ones(1)
        if world > 1 and dist.is_initialized():
            dist.all_reduce(t)
        acc += t
        pace(config, world, sleep_s)
        metrics = {"step": step, "world_size": world, "epoch_id": epoch}
        if step % every == 0 or step == total:
            stop_after = gate(step)
            with tempfile.TemporaryDirectory() as d:
                write_shard(os.path.join(d, shard_name(rank)), step, rank, payload)
                if rank == 0:
                    with open(os.path.join(d, META), "w") as fh:
                        json.dump({"step": step, "world_size": world}, fh)
                raylastic.report(metrics, checkpoint=raylastic.Checkpoint.from_directory(d))
            emit("reported", index=step, checkpoint=True)
            if stop_after:
                emit("frozen", index=step)
                os.kill(os.getpid(), signal.SIGSTOP)
        else:
            raylastic.report(metrics)
            emit("reported", index=step, checkpoint=False)
    emit("finished", step=total)
    log.close()
    return {"rank": rank, "final_step": total, "restored_from": start}


def read_log(log_dir: str) -> List[Dict[str, Any]]:
    """Every line the ranks wrote, sorted by time (a torn last line is skipped)."""
    out: List[Dict[str, Any]] = []
    if not os.path.isdir(log_dir):
        return out
    for name in os.listdir(log_dir):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(log_dir, name), encoding="utf-8") as fh:
            for line in fh:
                if line.endswith("\n"):
                    out.append(json.loads(line))
    out.sort(key=lambda r: r["t"])
    return out
