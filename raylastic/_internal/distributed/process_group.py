"""Form and tear down torch process groups, one per membership epoch.

Each epoch gets a fresh TCPStore hosted by the new rank 0 on a port the OS picks, and a
``PrefixStore`` named after the epoch, so a rebuilt group can never exchange keys with
a stale one (a late message from a dead epoch lands in a different key space and a
different server).
"""

from __future__ import annotations

import datetime
import os
from typing import Optional

import torch.distributed as dist

_store: Optional[dist.TCPStore] = None


def host_store(host: str, world_size: int, timeout_s: float) -> int:
    """Start this epoch's TCPStore server in this process; return its port."""
    global _store
    _store = dist.TCPStore(
        host, 0, world_size, is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
    )
    return _store.port


def init_group(*, epoch: int, rank: int, world_size: int, master_addr: str, master_port: int,
               backend: str, timeout_s: float, local_rank: int, local_world_size: int) -> None:
    """Join the epoch's process group (blocks until every rank joined or timeout)."""
    destroy_group()
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0 and _store is not None:
        store = _store
    else:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"raylastic/epoch-{epoch}", store)
    os.environ.update(
        MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world_size),
    )
    if backend == "nccl":
        import torch

        torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)


def destroy_group() -> None:
    """Leave the current group, if any. Safe to call when none exists."""
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group with dead peers may not shut down cleanly
            pass


def release_store() -> None:
    global _store
    _store = None
