"""Free TCP ports on 127.0.0.1 for the test servers and clusters raylastic starts.

Why not the kernel's choice (binding port 0): it hands out a port of the *ephemeral* range
(``/proc/sys/net/ipv4/ip_local_port_range``, 32768-60999 here), which is also where every
outgoing connection and every port-0 listener on the machine takes its local port. A port
chosen that way and released is free only until the next connection: SeaweedFS, whose
master, filer and S3 gateway connect to each other while they start, once found its S3
port taken (``bind: address already in use``) with Ray and a second pytest process busy
beside it. Ports below the ephemeral range (and above Ray's worker ports, 10002-19999) are
never handed out automatically: one that binds now stays free until someone asks for it by
number.
"""

from __future__ import annotations

import os
import random
import socket
from typing import Iterable, List, NamedTuple, Optional, Set, Tuple

# Ray's default worker ports (``--min-worker-port`` / ``--max-worker-port``) end here.
_ABOVE_RAY_WORKER_PORTS = 20000
_TRIES_PER_PORT = 200


def ephemeral_range() -> Tuple[int, int]:
    """The kernel's range for automatically assigned local ports (Linux; else its default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bind(host: str, port: int) -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct ports free right now, outside the ephemeral range where there is room
    (all sockets held open while choosing); the kernel's choice otherwise."""
    lo, hi = ephemeral_range()
    spans = [(a, b) for a, b in ((_ABOVE_RAY_WORKER_PORTS, lo - 1), (hi + 1, 65535)) if b - a >= 1000]
    rng = random.Random()
    socks: List[socket.socket] = []
    try:
        for _ in range(n):
            for _try in range(_TRIES_PER_PORT if spans else 0):
                a, b = rng.choice(spans)
                try:
                    socks.append(_bind(host, rng.randint(a, b)))
                    break
                except OSError:  # in use (or bound by us already): another
                    continue
            else:
                socks.append(_bind(host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


class TcpSocket(NamedTuple):
    state: str  # the kernel's hex code: "01" established, "0A" listening
    port: int  # the local port
    queued: int  # bytes in its send queue


def tcp_sockets(pids: Iterable[int]) -> Optional[List[TcpSocket]]:
    """The TCP sockets these processes hold open (Linux ``/proc``; None elsewhere)."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    inodes: Set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    out: List[TcpSocket] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[9] in inodes:
                out.append(TcpSocket(f[3], int(f[1].rsplit(":", 1)[1], 16), int(f[4].split(":")[0], 16)))
    return out


def listening_ports(pgid: int) -> Optional[Set[int]]:
    """The TCP ports on which a process of process group ``pgid`` listens (Linux ``/proc``;
    None elsewhere).

    Why not "a connection to the port succeeds": a port someone else already listens on
    answers too, and a server that failed to bind it may not have exited yet (Azurite on a
    loaded machine was taken for ready on a port held by another process)."""
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return None
    group = []
    for pid in pids:
        try:
            if os.getpgid(pid) == pgid:
                group.append(pid)
        except OSError:  # gone meanwhile
            continue
    sockets = tcp_sockets(group)
    return None if sockets is None else {s.port for s in sockets if s.state == "0A"}
