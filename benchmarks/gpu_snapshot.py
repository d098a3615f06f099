"""What an in-memory snapshot costs a training step on a GPU, and what restoring one costs.

One process, one GPU, no Ray: this isolates the copy engine every ``ElasticState`` uses
(``raylastic._internal.snapshots.capture.StateCopier``). On CUDA it queues device-to-host
copies into pinned host buffers on a side stream and makes the next ``optimizer.step()``
wait for them (an event, not a host sync), so the copy overlaps the next forward and
backward. The model is the 51.6M-parameter MLP of ``benchmarks/sharded_recovery.py``
(64 -> 3584 x 5 -> 1) with Adam: the snapshot is parameters + two moments, about 620 MB.

For each batch size the process rotates through blocks of steps in three conditions, so
all see the same clocks and memory state:

- ``plain``: no snapshot;
- ``sync``: the state copied to host before ``commit`` returns (``async_snapshot=False``);
- ``overlap``: the default (snapshot every step, copy overlapped with the next step).

A step is timed from its start until the default stream has finished it
(``current_stream().synchronize()``; not ``torch.cuda.synchronize()``, which would also
wait for the side stream and hide the overlap). Reported: median step time per condition,
the stall (step-time increase over plain, in % of plain), the time the training thread
was blocked in snapshot code, the copy's own throughput (the whole state, device to
pinned host, in isolation), and the restore: pinned host snapshot back into the live
model and optimizer (``load_state_dict``), as a peer-memory restore ends.

Writes benchmarks/results/gpu_snapshot.json. Usage:
    python benchmarks/gpu_snapshot.py [--batches 48,8192 --blocks 8 --block-steps 10]
    python benchmarks/gpu_snapshot.py --device cpu --hidden 256 --blocks 2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Dict, List

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _model(args, device):
    import torch
    from torch import nn

    torch.manual_seed(0)
    mods: List[nn.Module] = [nn.Linear(args.d_in, args.hidden), nn.ReLU()]
    for _ in range(args.layers - 1):
        mods += [nn.Linear(args.hidden, args.hidden), nn.ReLU()]
    model = nn.Sequential(*mods, nn.Linear(args.hidden, 1)).to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def measure_batch(args, device, batch: int) -> Dict[str, Any]:
    import torch
    from torch import nn

    from raylastic._internal.snapshots.capture import StateCopier, nbytes

    model, opt = _model(args, device)
    copiers = {"sync": StateCopier(model, opt, overlap=False), "overlap": StateCopier(model, opt, overlap=True)}
    buffers: Dict[str, List[Any]] = {m: [None, None] for m in copiers}  # double buffering, as ElasticState
    modes = ("plain", "sync", "overlap")
    times: Dict[str, List[float]] = {m: [] for m in modes}
    blocked: Dict[str, List[float]] = {m: [] for m in modes}
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(batch, args.d_in, device=device, generator=gen)
    y = x.sum(dim=1, keepdim=True).sin()
    step = 0
    for block in range(len(modes) * args.blocks + 1):
        mode = modes[block % len(modes)] if block else "overlap"  # block 0 warms up and allocates
        for c in copiers.values():  # a copy left from the previous block is not this block's cost
            c.wait()
        _sync(device)
        for _ in range(args.block_steps):
            t0 = time.perf_counter()
            b0 = copiers[mode].blocked_s if mode != "plain" else 0.0
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=False)
            loss.backward()
            opt.step()
            if mode != "plain":
                buf = buffers[mode]
                buf[step % 2], start = copiers[mode].copy(buf[step % 2], lambda _err: None)
                start()
            _sync(device)
            if block:
                times[mode].append(time.perf_counter() - t0)
                blocked[mode].append(copiers[mode].blocked_s - b0 if mode != "plain" else 0.0)
            step += 1
    for c in copiers.values():
        c.wait()
    if device.type == "cuda":
        torch.cuda.synchronize()
    med = {m: statistics.median(times[m]) for m in modes}
    state = buffers["sync"][(step - 1) % 2] or buffers["sync"][step % 2]
    snap_bytes = nbytes(state)
    # the copy alone: the whole state, device to (already pinned) host buffers, synchronously
    copy_s = []
    for _ in range(5):
        _sync(device)
        t0 = time.perf_counter()
        state, start = copiers["sync"].copy(state, lambda _err: None)
        start()
        if device.type == "cuda":
            torch.cuda.synchronize()
        copy_s.append(time.perf_counter() - t0)
    # the restore: host snapshot back into the live model and optimizer
    restore_s = []
    for _ in range(5):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        restore_s.append(time.perf_counter() - t0)
    plain = med["plain"]
    return {
        "batch": batch,
        "median_step_s": {m: round(v, 6) for m, v in med.items()},
        "step_range_s": {m: [round(min(times[m]), 6), round(max(times[m]), 6)] for m in modes},
        "stall_pct_of_step": {m: round(100 * (med[m] - plain) / plain, 2) for m in ("sync", "overlap")},
        "blocked_median_s": {m: round(statistics.median(blocked[m]), 6) for m in ("sync", "overlap")},
        "steps_per_condition": len(times["plain"]),
        "snapshot_bytes": snap_bytes,
        "copy_to_host_s": round(statistics.median(copy_s), 5),
        "copy_to_host_gb_s": round(snap_bytes / statistics.median(copy_s) / 1e9, 2),
        "restore_from_host_s": round(statistics.median(restore_s), 5),
        "restore_gb_s": round(snap_bytes / statistics.median(restore_s) / 1e9, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--d-in", type=int, default=64)
    ap.add_argument("--batches", default="48,8192", help="comma list of batch sizes")
    ap.add_argument("--blocks", type=int, default=8, help="blocks per condition")
    ap.add_argument("--block-steps", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(RESULTS, "gpu_snapshot.json"))
    args = ap.parse_args()
    import torch

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device(args.device)
    model, _ = _model(args, torch.device("meta"))
    params = sum(p.numel() for p in model.parameters())
    results: Dict[str, Any] = {
        "benchmark": "gpu_snapshot",
        "model": {"hidden": args.hidden, "layers": args.layers, "d_in": args.d_in, "parameters": params,
                  "optimizer": "Adam"},
        "schedule": {"blocks_per_condition": args.blocks, "block_steps": args.block_steps,
                     "snapshot": "every step"},
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "versions": {"torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version()},
        "runs": [],
    }
    for b in [int(v) for v in args.batches.split(",") if v]:
        r = measure_batch(args, device, b)
        print(json.dumps(r), flush=True)
        results["runs"].append(r)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
