"""Form and tear down torch process groups, one per membership epoch.

Each epoch gets a fresh TCPStore hosted by the new rank 0 on a port the OS picks, and a
``PrefixStore`` named after the epoch, so a rebuilt group can never exchange keys with
a stale one (a late message from a dead epoch lands in a different key space and a
different server).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import logging
import os
import socket
import time
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import torch.distributed as dist

from raylastic._internal.distributed import abortable_wait

logger = logging.getLogger(__name__)

_store: Optional[dist.TCPStore] = None
# (epoch, {fd: inode}): the gloo connections of the current epoch's group, what
# ``abort_group`` shuts down. One tuple, swapped whole, so an abort never pairs one
# epoch's number with another's sockets.
_group_conns: Tuple[Optional[int], Dict[int, int]] = (None, {})
# The epoch's PrefixStore: where the ranks of a group the train function creates later
# publish their gloo listener addresses (see ``_record_new_group``).
_epoch_store: Any = None
_untracked = False  # set while raylastic creates a group of its own (``untracked``)
_torch_new_group: Optional[Callable[..., Any]] = None
# How long ranks wait for each other's gloo listener ports after init (they all just
# finished init, so this is milliseconds unless a rank died in between).
LISTEN_EXCHANGE_TIMEOUT_S = 5.0


def host_store(host: str, world_size: int, timeout_s: float) -> int:
    """Start this epoch's TCPStore server in this process; return its port.

    The server listens on ``host`` (this node's Ray address) only. Given just a port,
    TCPStore binds every interface, public ones included, and whoever connects can write
    the rendezvous keys of the group (its gloo addresses). So the listening socket is made
    here, bound to the one address the other ranks dial, and handed to the store (which
    owns, and closes, the descriptor it is given)."""
    global _store
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(1024)
        _store = dist.TCPStore(
            host,
            sock.getsockname()[1],
            world_size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=os.dup(sock.fileno()),
        )
    return _store.port


class JoinCancelled(RuntimeError):
    """A join given up before it blocked in ``init_process_group`` (a newer one was asked for)."""


# How often a rank waiting at the roll call checks whether its join was given up.
ROLL_CALL_SLICE_S = 0.2


def roll_call(
    store, rank: int, world_size: int, timeout_s: float, cancelled: Optional[Callable[[], bool]] = None
) -> None:
    """Wait until every rank of the group has arrived (each sets ``rollcall/<rank>``),
    checking ``cancelled`` at least every ``ROLL_CALL_SLICE_S / 4``.

    Why: ``init_process_group`` waits in C++ for every rank's address until the group
    timeout and cannot be interrupted. When the controller gives up on a group because a
    chosen member died before it arrived, the others would sit there for the whole
    timeout and hold up the next group. Waiting here first, in slices, lets them leave
    at once (``JoinCancelled``); what remains is the short window between everyone's
    arrival and the end of gloo's connect."""
    store.set(f"rollcall/{rank}", b"1")
    keys = [f"rollcall/{r}" for r in range(world_size)]
    deadline = time.monotonic() + timeout_s
    pause = 0.005
    # check() does not block (store.wait with a short timeout would log a C++ warning per slice)
    while not store.check(keys):
        if cancelled is not None and cancelled():
            raise JoinCancelled(f"rank {rank}: join given up at the roll call")
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if not store.check([f"rollcall/{r}"])]
            raise TimeoutError(f"rank {rank}: ranks {missing} did not arrive within {timeout_s:g} s")
        time.sleep(pause)
        pause = min(ROLL_CALL_SLICE_S / 4, pause * 2)


def init_group(
    *,
    epoch: int,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
    timeout_s: float,
    local_rank: int,
    local_world_size: int,
    cancelled: Optional[Callable[[], bool]] = None,
) -> None:
    """Join the epoch's process group (blocks until every rank joined or timeout, or
    until ``cancelled()`` while ranks are still missing: ``JoinCancelled``)."""
    global _group_conns, _epoch_store
    destroy_group()
    before = set(_socket_fds().values())
    timeout = datetime.timedelta(seconds=timeout_s)
    if rank == 0 and _store is not None:
        store = _store
    else:
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore(f"raylastic/epoch-{epoch}", store)
    roll_call(prefixed, rank, world_size, timeout_s, cancelled)
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(local_world_size),
    )
    if backend == "nccl":
        import torch

        torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size, timeout=timeout)
    abortable_wait.group_formed(epoch, backend, timeout_s)  # before an abort of this epoch can be recorded
    if backend == "gloo":  # gloo connects its full mesh during init (unless lazy init is on)
        _group_conns = (epoch, _gloo_connections(prefixed, rank, range(world_size), before))
        _epoch_store = prefixed
        _track_new_groups()


def _track_new_groups() -> None:
    """Make ``dist.new_group`` record the connections of the gloo groups a train function
    creates, so that ``abort_group`` shuts those too.

    Why: DeepSpeed reduces gradients over a clone of the world group
    (``dist.new_group(ranks=range(world))``), not over the default group. A survivor
    blocked in that clone, waiting for a survivor that already unwound, never saw the
    default group's abort and was replaced as hung (a ZeRO-2 run: 5 s lost and a
    snapshot's shards with it). Installed once per process; a group created outside an
    epoch, inside ``untracked()``, or not of plain gloo is left as torch made it."""
    global _torch_new_group
    if _torch_new_group is not None:
        return
    _torch_new_group = original = dist.new_group

    @functools.wraps(original)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        epoch, store = _group_conns[0], _epoch_store
        if epoch is None or store is None or _untracked:
            return original(*args, **kwargs)
        before = set(_socket_fds().values())
        group = original(*args, **kwargs)
        try:
            _record_new_group(group, epoch, store, before)
        except Exception as e:  # noqa: BLE001 - the group works; only an abort cannot reach it
            logger.warning(
                "connections of a new gloo group not recorded (%s); an abort will not reach an operation blocked in it",
                e,
            )
        return group

    dist.new_group = new_group


def _record_new_group(group: Any, epoch: int, store: Any, before: set) -> None:
    global _group_conns
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    backend = dist.get_backend(group)
    abortable_wait.group_added(backend)
    if backend != "gloo":
        return
    conns = _gloo_connections(
        store, dist.get_rank(), dist.get_process_group_ranks(group), before, tag=f"{group.group_name}/"
    )
    if _group_conns[0] == epoch:  # swapped whole: an abort never sees half of it
        _group_conns = (epoch, {**_group_conns[1], **conns})


@contextlib.contextmanager
def untracked() -> Iterator[None]:
    """Groups created inside are not shut by ``abort_group`` (raylastic's own side groups,
    whose transfers outlive the training thread's abort on purpose)."""
    global _untracked
    _untracked = True
    try:
        yield
    finally:
        _untracked = False


class _Sock(NamedTuple):
    fd: int
    inode: int
    listening: bool
    local: Tuple[str, int]
    peer: Optional[Tuple[str, int]]


def _gloo_connections(store, rank: int, ranks: Sequence[int], before: set, tag: str = "") -> Dict[int, int]:
    """The TCP connections of the group just formed (global ``ranks``; ``tag`` names a
    group created after the epoch's own): fd -> inode.

    Other threads (uploads, Ray's gRPC, a metadata poller) may open sockets while
    ``init_process_group`` runs, so "new since before" is not enough: a connection is
    gloo's when it was accepted on this rank's new gloo listener, or connects to a
    peer's. Ranks publish their listener addresses in the epoch's store; if a peer's
    do not come (it died right after init), only accepted connections are kept, which
    still frees every survivor once all of them abort (each connection between two
    survivors was accepted by one of them)."""
    new = _describe(before)
    mine = sorted({s.local for s in new if s.listening})
    store.set(f"raylastic/gloo-listen/{tag}{rank}", json.dumps(mine))
    peers: set = set()
    keys = [f"raylastic/gloo-listen/{tag}{r}" for r in ranks if r != rank]
    try:
        store.wait(keys, datetime.timedelta(seconds=LISTEN_EXCHANGE_TIMEOUT_S))
        for k in keys:
            peers |= {tuple(a) for a in json.loads(store.get(k))}
    except Exception as e:  # noqa: BLE001 - a peer gone already: keep accepted ones
        logger.warning(
            "gloo listener ports of the other ranks not found (%s); the abort "
            "will shut only connections this rank accepted",
            e,
        )
    mine_ports = {p for _h, p in mine}

    def _is_peer(addr: Optional[Tuple[str, int]]) -> bool:
        return addr is not None and any(addr[1] == p and (h in ("0.0.0.0", "::") or h == addr[0]) for h, p in peers)

    return {s.fd: s.inode for s in new if not s.listening and (s.local[1] in mine_ports or _is_peer(s.peer))}


def _describe(before: set) -> List[_Sock]:
    """The TCP sockets opened since ``before`` (a set of /proc socket links)."""
    out: List[_Sock] = []
    for fd, link in _socket_fds().items():
        if link in before:
            continue
        with _borrowed(fd) as s:
            if s is None or s.family not in (socket.AF_INET, socket.AF_INET6) or s.type != socket.SOCK_STREAM:
                continue
            listening = bool(s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            try:
                peer = None if listening else s.getpeername()[:2]
            except OSError:
                peer = None  # not connected (yet, or any more)
            out.append(_Sock(fd, os.fstat(s.fileno()).st_ino, listening, s.getsockname()[:2], peer))
    return out


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[Optional[socket.socket]]:
    """A socket object on a dup of ``fd`` (None when ``fd`` is closed), closed after: the
    original fd stays gloo's. OSErrors inside (a socket gone meanwhile) end the block."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        yield None
        return
    try:
        yield s
    except OSError as e:
        logger.debug("fd %s: %s", fd, e)
    finally:
        s.close()


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
    left alone (gloo aborts the process when its listener fails), and so are sockets
    other threads opened meanwhile (see ``_gloo_connections``). Returns how many
    connections were shut down; 0 when the group is of another epoch, its backend is
    not plain ``"gloo"`` (NCCL, or a ``"cpu:gloo,cuda:nccl"`` string), or on a platform
    without ``/proc/self/fd``. Gloo groups the train function (or DeepSpeed) creates
    with ``torch.distributed.new_group`` during the epoch are shut too (see
    ``_track_new_groups``); groups gloo connects lazily (``TORCH_GLOO_LAZY_INIT``) are
    not. In those cases the controller still replaces a rank that does not unwind.
    """
    group_epoch, conns = _group_conns
    if epoch != group_epoch:
        return 0
    abortable_wait.aborted(epoch)  # and what no shutdown wakes, the train thread gives up
    shut = 0
    for fd, inode in conns.items():
        with _borrowed(fd) as s:  # None: closed since (gloo drops a pair whose peer vanished)
            # the dup is checked, not the fd number: a closed fd may have been reused
            if s is not None and os.fstat(s.fileno()).st_ino == inode:
                s.shutdown(socket.SHUT_RDWR)  # acts on the connection, not on this dup
                shut += 1
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
    global _group_conns, _epoch_store
    _group_conns, _epoch_store = (None, {}), None
    abortable_wait.group_left()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group with dead peers may not shut down cleanly
            pass
        # DeepSpeed caches groups derived from the default one; the next
        # deepspeed.initialize (at the new world size) must build them anew.
        from raylastic._internal.snapshots.sharded.deepspeed import release_deepspeed_groups

        release_deepspeed_groups()


def release_store() -> None:
    global _store
    _store = None
