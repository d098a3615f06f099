"""Free TCP ports on 127.0.0.1 for the test servers and clusters raylastic starts."""

from __future__ import annotations

import socket
from typing import List


def free_ports(n: int, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct ports free right now (all sockets held open while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
