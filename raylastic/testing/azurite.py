"""Azurite (the Azure Storage emulator) as a test harness: blob, table and queue on 127.0.0.1.

Used by the Azure Table rendezvous tests and the ``abfs://`` checkpoint storage tests::

    from raylastic.testing.azurite import Azurite

    with Azurite() as az:
        client = TableServiceClient.from_connection_string(az.connection_string)
        ...
        az.stop()    # simulate an outage: requests now fail to connect
        az.start()   # back on the same ports (in-memory data is gone)

The emulator is the npm package ``azurite@3.35.0`` (3.36+ needs a newer Node than 20), found at
``<repo>/.cache/azurite/node_modules/.bin/azurite`` (``make install`` puts it there), then on
``PATH``. Each instance runs in its own process group on free ports with in-memory persistence;
``stop()`` kills the whole group, so no process outlives the harness (a finalizer covers a
forgotten ``stop()``).
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Optional, Tuple
from raylastic.testing._server import STARTUP_TIMEOUT_S, ServerProcess
from raylastic.testing.ports import free_ports, listening_ports

__all__ = ["Azurite", "AzuriteNotInstalled", "find_azurite"]

ACCOUNT_NAME = "devstoreaccount1"
# The well-known development-storage key (public, documented by Microsoft; not a secret).
ACCOUNT_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AZURITE_VERSION = "3.35.0"
_REPO_ROOT = Path(__file__).resolve().parents[2]
_REPO_AZURITE = _REPO_ROOT / ".cache" / "azurite" / "node_modules" / ".bin" / "azurite"
_INSTALL_HINT = (
    f"install it with: mkdir -p .cache/azurite && cd .cache/azurite && "
    f"npm install --no-audit --no-fund azurite@{AZURITE_VERSION}   (or run `make install`)"
)


class AzuriteNotInstalled(RuntimeError):
    """The azurite executable was not found; the message says how to install it."""


def find_azurite() -> Optional[str]:
    """Path of the azurite executable (repo ``.cache`` first, then ``PATH``), or None."""
    if _REPO_AZURITE.exists():
        return str(_REPO_AZURITE)
    return shutil.which("azurite")


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class Azurite(ServerProcess):
    """One Azurite emulator (blob + table + queue) on free 127.0.0.1 ports.

    ``start()`` is called by ``__enter__``; ``stop()``/``start()`` may be repeated and reuse the
    same ports, so clients built from ``connection_string`` keep working after a restart (data
    does not survive: persistence is in memory).
    """

    host = "127.0.0.1"
    account_name = ACCOUNT_NAME
    account_key = ACCOUNT_KEY
    stop_grace_s = 3.0
    log_name = "azurite.log"

    def __init__(self, *, executable: Optional[str] = None, startup_timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        exe = executable or find_azurite()
        if exe is None or not Path(exe).exists() and shutil.which(exe) is None:
            raise AzuriteNotInstalled(f"azurite executable not found ({exe or _REPO_AZURITE}); {_INSTALL_HINT}")
        self.executable = exe
        self.startup_timeout_s = startup_timeout_s
        self._new_ports()
        super().__init__(tempfile.mkdtemp(prefix="raylastic-azurite-"), delete_workdir=True)

    # -- endpoints --------------------------------------------------------------------------
    @property
    def blob_endpoint(self) -> str:
        return f"http://{self.host}:{self.blob_port}/{self.account_name}"

    @property
    def table_endpoint(self) -> str:
        return f"http://{self.host}:{self.table_port}/{self.account_name}"

    @property
    def queue_endpoint(self) -> str:
        return f"http://{self.host}:{self.queue_port}/{self.account_name}"

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={self.account_name};"
            f"AccountKey={self.account_key};BlobEndpoint={self.blob_endpoint};"
            f"QueueEndpoint={self.queue_endpoint};TableEndpoint={self.table_endpoint};"
        )

    # -- lifecycle --------------------------------------------------------------------------
    def _start_once(self) -> None:
        cmd = [
            self.executable,
            "--inMemoryPersistence",
            "--disableTelemetry",
            "--skipApiVersionCheck",
            "--loose",
            "--silent",
            "--blobHost",
            self.host,
            "--blobPort",
            str(self.blob_port),
            "--tableHost",
            self.host,
            "--tablePort",
            str(self.table_port),
            "--queueHost",
            self.host,
            "--queuePort",
            str(self.queue_port),
        ]
        self._spawn(cmd)  # own process group: stop() kills node and its children
        self._wait_ready()

    def _new_ports(self) -> None:
        # one call: ports picked one by one can repeat (seen: table and queue on one port)
        self.blob_port, self.table_port, self.queue_port = free_ports(3, self.host)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        ports = (self.blob_port, self.table_port, self.queue_port)
        proc = self._proc
        assert proc is not None  # started by _spawn
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if self._serving(proc.pid, ports):
                time.sleep(0.05)  # a port grabbed by someone else makes azurite exit at once
                if proc.poll() is None:
                    return
                break
            time.sleep(0.05)
        rc = proc.poll()
        self.stop()
        why = f"exited with code {rc}" if rc is not None else f"not ready after {self.startup_timeout_s:.0f}s"
        raise RuntimeError(
            f"Azurite {why} (ports blob={ports[0]} table={ports[1]} queue={ports[2]}); "
            f"log tail:\n{self._log_tail()}\nIf the port is taken, retry; raise startup_timeout_s "
            f"on a loaded machine."
        )

    def _serving(self, pid: int, ports: Tuple[int, int, int]) -> bool:
        """Azurite's own processes listen on all three ports (where ``/proc`` tells; else
        each port answers, which a port held by another process does too)."""
        mine = listening_ports(pid)  # its own process group: its pid is the group's id
        if mine is not None:
            return set(ports) <= mine
        return all(_port_open(self.host, p) for p in ports)

    def stop(self, grace_s: Optional[float] = None) -> None:
        """Kill the emulator's process group and wait for it (in-memory data is lost)."""
        super().stop(grace_s)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"Azurite({state}, blob={self.blob_port}, table={self.table_port}, queue={self.queue_port})"
