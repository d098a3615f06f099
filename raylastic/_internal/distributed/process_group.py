"""Form and tear down torch process groups, one per membership epoch.

Each epoch gets a fresh TCPStore hosted by the new rank 0 on a port the OS picks, and a
``PrefixStore`` named after the epoch, so a rebuilt group can never exchange keys with
a stale one (a late message from a dead epoch lands in a different key space and a
different server).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Dict, Optional

import torch.distributed as dist

logger = logging.getLogger(__name__)

_store: Optional[dist.TCPStore] = None
# The sockets this process opened while joining the current epoch's group (fd -> the
# /proc link naming the socket's inode), and that epoch: what ``abort_group`` shuts.
_group_sockets: Dict[int, str] = {}
_group_epoch: Optional[int] = None


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
    global _group_sockets, _group_epoch
    destroy_group()
    before = _socket_fds()
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
    if backend == "gloo":  # gloo connects its full mesh during init (unless lazy init is on)
        _group_sockets = {fd: link for fd, link in _socket_fds().items() if before.get(fd) != link}
        _group_epoch = epoch


def abort_group(epoch: int) -> int:
    """Make every gloo operation of epoch ``epoch``'s group fail now, here and on the peers.

    gloo has no abort for an operation in flight: ``ProcessGroupGloo.abort()`` and
    ``destroy_process_group()`` leave a blocked ``recv``/``all_reduce`` waiting until the
    group timeout (measured), and a survivor blocked on another survivor (not on the
    lost rank) never sees the loss. Shutting down the TCP connections the group opened
    makes gloo fail the pending operations on both ends at once ("Connection closed by
    peer"), so every survivor's train function unwinds and the process can join the
    next group (measured: two ranks blocked receiving from each other raised within
    milliseconds of the shutdown and then formed a new group). Listening sockets are
    left alone (gloo aborts the process when its listener fails). A TCP connection
    another thread of this process opened while the group formed would be shut down too
    (gRPC, which Ray uses, reconnects). Returns how many
    connections were shut down; 0 when the group is of another epoch or not gloo, or on
    a platform without ``/proc/self/fd``; the controller then still replaces a rank
    that does not unwind.
    """
    if epoch != _group_epoch:
        return 0
    shut = 0
    for fd, link in _group_sockets.items():
        try:
            if os.readlink(f"/proc/self/fd/{fd}") != link:
                continue  # closed since (gloo drops a pair whose peer vanished), maybe reused
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (s.family in (socket.AF_INET, socket.AF_INET6) and s.type == socket.SOCK_STREAM
                    and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                s.shutdown(socket.SHUT_RDWR)  # acts on the connection, not on this dup
                shut += 1
        except OSError as e:  # already disconnected
            logger.debug("fd %s: %s", fd, e)
        finally:
            s.close()
    return shut


def _socket_fds() -> Dict[int, str]:
    """This process's open sockets: fd -> "socket:[inode]" (empty without /proc)."""
    out: Dict[int, str] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out[int(fd)] = link
    return out


def destroy_group() -> None:
    """Leave the current group, if any. Safe to call when none exists."""
    global _group_sockets, _group_epoch
    _group_sockets, _group_epoch = {}, None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group with dead peers may not shut down cleanly
            pass


def release_store() -> None:
    global _store
    _store = None
