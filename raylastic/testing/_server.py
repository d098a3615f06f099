"""What the local storage servers the tests start have in common (SeaweedFS, Azurite,
fake-gcs-server): one child process in its own process group, logging to a file, that
``stop()`` kills (group and all) and ``start()`` may start again; ``close()`` and a
finalizer make sure no server outlives its harness, even one a test forgot to close.

A subclass builds its command line and readiness check; the lifecycle is here.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
import weakref
from typing import List, Optional, Self

logger = logging.getLogger(__name__)


def _port_taken(log: str) -> bool:
    """Whether a server's log says it could not bind a port someone else holds."""
    return "EADDRINUSE" in log or "address already in use" in log.lower()


def kill_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group, then SIGKILL whatever is left after ``grace_s``."""
    if proc.returncode is not None:
        return  # reaped earlier: its pid may already belong to someone else
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    # The leader may be gone while children linger: sweep the group before anything reuses it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
        pass


def _cleanup(procs: List[Optional[subprocess.Popen]], workdir: Optional[str]) -> None:
    for proc in procs:
        if proc is not None:
            kill_group(proc, 1.0)
    if workdir:
        shutil.rmtree(workdir, ignore_errors=True)


# How long a harness waits for its server to answer, by default. Generous: it only runs out
# when something is wrong, and on a loaded machine a sound start is slow (Azurite, a Node.js
# server started at nice 15 with both cores busy, was not ready after 30 s in a clean
# clone's `make test`, 2026-11-28).
STARTUP_TIMEOUT_S = 120.0


class ServerProcess:
    """Base of the server harnesses. ``workdir``: deleted by ``close()`` (None: kept)."""

    stop_grace_s = 1.0
    log_name = "server.log"
    server_name = "server"
    probe_interval_s = 0.2
    startup_timeout_s = STARTUP_TIMEOUT_S

    def __init__(self, workdir: str, delete_workdir: bool) -> None:
        self._workdir = workdir
        self._proc: Optional[subprocess.Popen] = None
        self._started = False  # a start succeeded: clients may hold the ports from then on
        self._procs: List[Optional[subprocess.Popen]] = [None]  # the finalizer must not hold self
        self._finalizer = weakref.finalize(self, _cleanup, self._procs, workdir if delete_workdir else None)

    @property
    def log_path(self) -> str:
        return os.path.join(self._workdir, self.log_name)

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _spawn(self, cmd: List[str]) -> None:
        """Start ``cmd`` in its own process group, output appended to ``log_path``."""
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd,
                cwd=self._workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._procs[0] = self._proc

    def _log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def _probe(self) -> None:  # pragma: no cover - every probing harness has its own
        raise NotImplementedError

    def _where(self) -> str:
        return ""

    def _wait_ready(self) -> None:
        """Until ``_probe()`` passes (a real write and read back: an open port is not
        readiness), the process exits, or ``startup_timeout_s`` runs out (then stopped,
        with the log's tail in the error)."""
        deadline = time.monotonic() + self.startup_timeout_s
        last: Optional[Exception] = None
        proc = self._proc
        assert proc is not None  # started by _spawn
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                self._probe()
                return
            except Exception as exc:  # noqa: BLE001 - not up yet; retry until the deadline
                last = exc
                time.sleep(self.probe_interval_s)
        rc = proc.poll()
        self.stop()
        why = (
            f"exited with code {rc}"
            if rc is not None
            else (f"not writable after {self.startup_timeout_s:.0f}s (last error: {last})")
        )
        raise RuntimeError(
            f"{self.server_name} {why}; {self._where()}; log tail:\n{self._log_tail()}\n"
            "raise startup_timeout_s on a loaded machine"
        )

    def _log_tail(self, n: int = 3000, since: int = 0) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(since)
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "<no log>"

    def stop(self, grace_s: Optional[float] = None) -> None:
        """Kill the server's process group and wait for it."""
        if self._proc is not None:
            kill_group(self._proc, self.stop_grace_s if grace_s is None else grace_s)
            self._proc = None
            self._procs[0] = None

    def close(self) -> None:
        """Stop, and delete the working directory if the harness owns it; no restart after."""
        self.stop()
        self._finalizer()

    def start(self) -> Self:
        """Start (or restart on the same ports and data) and wait until ready. Until a
        start has succeeded, one that failed because another process took one of the
        ports picks new ones and tries again, 3 tries in all. Why: the ports are picked
        free and released, and bound a moment later by the server; Azurite once found one
        taken meanwhile (``EADDRINUSE``, a clean-clone ``make test``, 2026-11-27) and failed
        a whole module's fixture. After the first start clients hold the ports, so a
        restart keeps them and fails as before."""
        if self.running:
            return self
        tries = 0
        while True:
            tries += 1
            log_at = self._log_size()
            try:
                self._start_once()
                self._started = True
                return self
            except RuntimeError:
                if self._started or tries == 3 or not _port_taken(self._log_tail(since=log_at)):
                    raise
                logger.warning("%s: a port was taken before it could bind; new ports", self.server_name)
                self._new_ports()

    def _start_once(self) -> None:  # pragma: no cover - every harness has its own
        """Spawn the server on the current ports and wait until it is ready."""
        raise NotImplementedError

    def _new_ports(self) -> None:  # pragma: no cover - every harness has its own
        """Pick free ports for the next start."""
        raise NotImplementedError

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()
