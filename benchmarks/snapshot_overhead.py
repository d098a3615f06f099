"""Snapshot stall per step: what ``ElasticState.commit()`` costs a DDP training step.

Three gloo processes train the same MLP as ``benchmarks/recovery.py`` (about 9.5M
parameters with Adam by default). Each process alternates blocks of steps without and
with a snapshot of model + optimizer state into recycled host buffers (exactly the copy
``ElasticState.commit`` makes, ``raylastic.state._copy_into``), so both conditions see the
same machine load. Reports the median step time of each condition and the stall as a
percentage of the plain step (target: <= 5% when snapshotting every step).

Writes benchmarks/results/snapshot_overhead.json. Usage:
    python benchmarks/snapshot_overhead.py [--hidden 1536 --layers 5 --blocks 6 --block-steps 15]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from raylastic.state import _copy_into

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    mods = [nn.Linear(64, args["hidden"]), nn.ReLU()]
    for _ in range(args["layers"] - 1):
        mods += [nn.Linear(args["hidden"], args["hidden"]), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(args["hidden"], 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    buffers = [None, None]  # double buffering, as ElasticState does
    times = {"plain": [], "snapshot": []}
    step = 0
    for block in range(2 * args["blocks"] + 1):
        mode = "snapshot" if block % 2 else "plain"
        for _ in range(args["block_steps"]):
            t0 = time.perf_counter()
            g = torch.Generator().manual_seed(step * 7919 + rank)
            x = torch.randn(32, 64, generator=g)
            loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mode == "snapshot":
                live = {"model": model.state_dict(), "optimizer": opt.state_dict()}
                buffers[step % 2] = _copy_into(buffers[step % 2], live)
            dist.barrier()  # lockstep like the next all-reduce would impose
            if block > 0:  # block 0 warms up
                times[mode].append(time.perf_counter() - t0)
            step += 1
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        snap_bytes = sum(t.numel() * t.element_size() for t in _flatten(buffers[0]))
        with open(out, "w") as fh:
            json.dump({"times": times, "params": n_params, "snapshot_bytes": snap_bytes}, fh)
    dist.destroy_process_group()


def _flatten(obj):
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _flatten(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _flatten(v)


def main() -> None:
    import torch.multiprocessing as mp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--block-steps", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "snapshot_overhead.json"))
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mktemp(suffix=".json")
    args = {"hidden": a.hidden, "layers": a.layers, "blocks": a.blocks, "block_steps": a.block_steps}
    mp.spawn(_worker, args=(a.world, port, args, tmp), nprocs=a.world, join=True)
    raw = json.load(open(tmp))
    plain = statistics.median(raw["times"]["plain"])
    snap = statistics.median(raw["times"]["snapshot"])
    result = {
        "benchmark": "snapshot_overhead",
        "world_size": a.world, "params": raw["params"], "snapshot_mb": round(raw["snapshot_bytes"] / 2**20, 1),
        "plain_step_s": round(plain, 5), "snapshot_step_s": round(snap, 5),
        "stall_per_step_s": round(snap - plain, 5),
        "stall_pct_of_step": round(100 * (snap - plain) / plain, 2),
        "target_pct": 5.0,
        "machine": {"cpus": os.cpu_count()},
        "method": "alternating blocks of plain and snapshot steps in the same 3 gloo processes; medians",
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
