"""Elastic DDP under plain torchrun, rendezvous in Azure Table Storage. CPU, gloo, tiny.

Run on every node (AzureML / plain VMs; see docs/torchrun_azure.md), with the job's state key in
the environment: the same secret on every node, generated once with
``python -c 'import secrets; print(secrets.token_hex(32))'`` and kept in a secret store, never on a
command line or in a log (the backend refuses to start without it; the opt-out
``RAYLASTIC_RDZV_INSECURE_NO_HMAC=1`` lets anyone who can write the table run code on every agent,
see docs/security.md):

    export RAYLASTIC_RDZV_HMAC_KEY=<the job's key, from your secret store>
    torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=azure-table \\
        --rdzv-endpoint=https://<account>.table.core.windows.net --rdzv-id=$RUN_ID \\
        --max-restarts=10 examples/torchrun_azure/train.py \\
        --checkpoint abfs://<container>@<account>.dfs.core.windows.net/runs/$RUN_ID

What happens on a membership change (a node joins, or one is preempted): torchrun stops every
worker, re-forms the group through the rendezvous table, and starts this script again with the
new RANK/WORLD_SIZE. So the script is written to be *restarted*: it resumes from the newest
committed checkpoint, and the elastic data loader continues at the same global step whatever the
new world size is (global steps are defined by the global batch, not by the number of ranks).

No Ray here: only raylastic's storage seam (local path, abfs://, s3://, gs://) and its elastic
data loader.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

from raylastic.checkpoint.storage import Storage
from raylastic.data import ElasticDataLoader

LATEST = "LATEST"  # commit marker: names the newest complete checkpoint file


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50, help="global steps to train")
    p.add_argument("--checkpoint", required=True, help="storage URI: a local path, abfs://..., s3://...")
    # Not "--log": torchrun's parser would read it as an abbreviation of its own --log-dir.
    p.add_argument("--train-log", default=None, help="append JSON lines: one per step and per worker start")
    p.add_argument("--global-batch-size", type=int, default=12, help="samples per global step, all ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--step-time", type=float, default=0.0, help="extra seconds per step (simulated work)")
    p.add_argument("--pg-timeout", type=float, default=60.0, help="gloo collective timeout, seconds")
    p.add_argument("--hold-file", default=None,
                   help="test hook: rank 0 waits before step s while s >= the integer in this file")
    return p.parse_args()


def log_event(path, **record) -> None:
    if path:
        # One short O_APPEND write per record: lines from several processes do not interleave.
        with open(path, "a") as f:
            f.write(json.dumps({"time": round(time.time(), 3), **record}) + "\n")


def make_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1200, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.01 * torch.randn(1200, 1, generator=g)
    return TensorDataset(x, y)


def load_latest(storage: Storage):
    """``(name, checkpoint)`` of the newest committed checkpoint, or None. A file no LATEST
    points at is ignored: a crash mid-save leaves the previous checkpoint in charge."""
    if not storage.exists(LATEST):
        return None
    name = storage.read_bytes(LATEST).decode().strip()
    return name, torch.load(io.BytesIO(storage.read_bytes(name)), weights_only=True)


def save(storage: Storage, step: int, model, optimizer, loader, history: list) -> None:
    buf = io.BytesIO()
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "loader": loader.state_dict()}, buf)
    name = f"ckpt-{step:08d}.pt"
    storage.write_bytes(name, buf.getvalue())  # write ...
    storage.write_bytes(LATEST, name.encode())  # ... then commit
    history.append(name)
    if len(history) > 2:  # keep two; never overwrite in place
        storage.delete_file(history.pop(0))


def wait_for_hold(path, step: int) -> None:
    while path:
        try:
            with open(path) as f:
                limit = int(f.read().strip() or 0)
        except (OSError, ValueError):
            limit = 0
        if step < limit:
            return
        time.sleep(0.05)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    # torchrun set MASTER_ADDR/PORT for this round: its rank 0 worker hosts the TCPStore.
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()

    model = DDP(torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    loader = ElasticDataLoader(make_dataset(), global_batch_size=args.global_batch_size, shuffle=True, seed=0)
    storage = Storage(args.checkpoint, create_container=True)

    # Every rank reads the same committed checkpoint, so all replicas start identical.
    latest = load_latest(storage)
    step, history = 0, []
    if latest is not None:
        name, ckpt = latest
        history.append(name)
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
    log_event(args.train_log, event="start", rank=rank, world_size=world, resumed_step=step, pid=os.getpid(),
              agent_pid=os.getppid(), restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)))

    batches = iter(loader)
    while step < args.steps:
        if rank == 0:
            wait_for_hold(args.hold_file, step)  # the others wait in the all-reduce below
        try:
            batch = next(batches)
        except StopIteration:  # epoch done: the loader has moved to the next epoch
            batches = iter(loader)
            batch = next(batches)
        optimizer.zero_grad()
        loss_sum = 0.0
        for (x, y), weight in batch.accumulate(model):  # DDP all-reduces on the last micro-batch
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss * weight).backward()
            loss_sum += loss.item() * weight
        optimizer.step()
        step += 1
        # Mean loss over the global batch (each rank's weighted sum covers its share).
        mean_loss = torch.tensor([loss_sum / world])
        dist.all_reduce(mean_loss)
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0:
            save(storage, step, model.module, optimizer, loader, history)
            log_event(args.train_log, event="step", step=step, world_size=world, loss=round(mean_loss.item(), 6))

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
