"""Snapshot stall per step: what ``ElasticState.commit()`` costs a DDP training step.

Three gloo processes train the same MLP as ``benchmarks/recovery.py`` (about 9.5M
parameters with Adam by default). Each process rotates through blocks of steps in four
conditions, so all see the same machine load:

- ``plain``: no snapshot;
- ``sync``: model + optimizer state copied into recycled host buffers before the step
  ends (``ElasticState(async_snapshot=False)``);
- ``overlap``: the default, ``ElasticState``'s copy engine
  (``raylastic._internal.snapshots.capture.StateCopier``): parameters and optimizer state are
  copied by a background thread while the next step's forward/backward runs, and the
  optimizer's next ``step()`` waits for it; every rank copies the whole state;
- ``striped``: the default of ``ElasticState`` with 3 or more workers: as ``overlap``,
  but each rank copies only its stripe, 2 of the W shards of the replicated state
  (``raylastic._internal.snapshots.placement``), so every shard still has copies on two nodes.

Reports the median step time of each condition; the stall of each snapshot mode as the
step-time increase over plain, in % of the plain step (target: <= 5% when snapshotting
every step; ``stall_pct_of_step`` is the default, striped, mode); and the time the training thread itself was blocked in snapshot code (the
rest of the increase is the copy competing with training for CPU and memory bandwidth).

Writes benchmarks/results/snapshot_overhead.json. Usage:
    python benchmarks/snapshot_overhead.py [--hidden 1536 --layers 5 --blocks 16 --block-steps 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def _worker(rank: int, world: int, port: int, args: dict, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    from raylastic._internal.snapshots.capture import StateCopier, nbytes
    from raylastic._internal.snapshots.placement import WHOLE, plan_stripes

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    mods = [nn.Linear(64, args["hidden"]), nn.ReLU()]
    for _ in range(args["layers"] - 1):
        mods += [nn.Linear(args["hidden"], args["hidden"]), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(args["hidden"], 1))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    copiers = {"sync": StateCopier(model, opt, overlap=False), "overlap": StateCopier(model, opt, overlap=True),
               "striped": StateCopier(model, opt, overlap=True)}
    # one worker per node, as in benchmarks/recovery.py's cluster
    holding = {"striped": (world, plan_stripes([f"node{r}" for r in range(world)])[rank])}
    buffers = {m: [None, None] for m in copiers}  # double buffering, as ElasticState does
    modes = ("plain", "sync", "overlap", "striped")
    times = {m: [] for m in modes}
    blocked = {m: [] for m in modes}  # time the training thread spent in the snapshot code
    step = 0
    for block in range(len(modes) * args["blocks"] + 1):
        mode = modes[block % len(modes)] if block else "overlap"  # block 0 warms up (and allocates)
        for c in copiers.values():  # a copy left from the previous block is not this block's cost
            c.wait()
        for _ in range(args["block_steps"]):
            t0 = time.perf_counter()
            b0 = copiers[mode].blocked_s if mode != "plain" else 0.0
            g = torch.Generator().manual_seed(step * 7919 + rank)
            x = torch.randn(32, 64, generator=g)
            loss = nn.functional.mse_loss(ddp(x), x.sum(dim=1, keepdim=True).sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if mode != "plain":
                buf = buffers[mode]
                buf[step % 2], start = copiers[mode].copy(buf[step % 2], lambda _err: None, holding.get(mode, WHOLE))
                start()
            dist.barrier()  # lockstep like the next all-reduce would impose
            if block > 0:  # block 0 warms up
                times[mode].append(time.perf_counter() - t0)
                blocked[mode].append(copiers[mode].blocked_s - b0 if mode != "plain" else 0.0)
            step += 1
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        with open(out, "w") as fh:
            json.dump({"times": times, "blocked": blocked, "params": n_params,
                       "snapshot_bytes": nbytes(buffers["sync"][0]),
                       "stripe_bytes": nbytes(buffers["striped"][0])}, fh)
    dist.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    from raylastic.testing.ports import free_port

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--world", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--block-steps", type=int, default=15)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "results", "snapshot_overhead.json"))
    a = ap.parse_args()
    port = free_port()
    tmp = tempfile.mktemp(suffix=".json")
    args = {"hidden": a.hidden, "layers": a.layers, "blocks": a.blocks, "block_steps": a.block_steps}
    mp.spawn(_worker, args=(a.world, port, args, tmp), nprocs=a.world, join=True)
    raw = json.load(open(tmp))
    med = {m: statistics.median(v) for m, v in raw["times"].items()}
    plain = med["plain"]
    def pct(mode: str) -> float:
        return round(100 * (med[mode] - plain) / plain, 2)

    def blocked(mode: str) -> float:
        return statistics.mean(raw["blocked"][mode])

    result = {
        "benchmark": "snapshot_overhead",
        "world_size": a.world, "params": raw["params"], "snapshot_mb": round(raw["snapshot_bytes"] / 2**20, 1),
        "stripe_mb": round(raw["stripe_bytes"] / 2**20, 1),
        "plain_step_s": round(plain, 5),
        "sync_step_s": round(med["sync"], 5), "overlap_step_s": round(med["overlap"], 5),
        "striped_step_s": round(med["striped"], 5),
        # slowdown: how much longer a step takes with the snapshot (all effects: the copy
        # itself and its competition with training for CPU and memory bandwidth)
        "sync_stall_pct_of_step": pct("sync"),
        "overlap_stall_pct_of_step": pct("overlap"),
        # the default (ElasticState(async_snapshot=True, striped=True), 3 workers): the
        # number the target is about
        "stall_per_step_s": round(med["striped"] - plain, 5),
        "stall_pct_of_step": pct("striped"),
        # blocked: mean time the training thread itself waited in snapshot code per step
        "sync_blocked_s": round(blocked("sync"), 5),
        "overlap_blocked_s": round(blocked("overlap"), 5),
        "striped_blocked_s": round(blocked("striped"), 5),
        "striped_blocked_pct_of_step": round(100 * blocked("striped") / plain, 2),
        "target_pct": 5.0,
        "steps_per_mode": len(raw["times"]["plain"]),
        "machine": {"cpus": os.cpu_count()},
        "method": "blocks of plain / sync / overlap / striped steps rotating in the same gloo processes; medians",
    }
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
