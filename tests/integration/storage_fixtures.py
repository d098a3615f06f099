"""Fixtures for real storage servers (SeaweedFS S3, Azurite Blob, fake-gcs-server GCS), imported
by tests/conftest.py.

Shared servers are session-scoped (one start per test session); tests that stop the server
take a private, function-scoped one so an outage never leaks into another test. Credentials
reach the code under test only through the environment, as in production; ``monkeypatch``
restores it after each test. Each test gets its own prefix, so tests never see each other's
objects on a shared server.
"""

from __future__ import annotations

import uuid

import pytest

__all__ = [
    "seaweed_server", "seaweed_private", "s3_env", "azurite_server", "azurite_private",
    "azure_env", "gcs_server", "gcs_private", "gcs_env", "storage_uri", "private_store",
    "create_azure_container", "clear_storage_env",
]

_AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION",
             "AWS_DEFAULT_REGION", "AWS_WEB_IDENTITY_TOKEN_FILE")
_AZURE_VARS = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
               "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CLIENT_ID",
               "AZURE_STORAGE_CLIENT_SECRET", "AZURE_STORAGE_TENANT_ID")
_GCS_VARS = ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT",
             "CLOUD_STORAGE_EMULATOR_ENDPOINT", "STORAGE_EMULATOR_HOST")


def clear_storage_env(monkeypatch) -> None:
    """Drop ambient cloud credentials so a developer's own account is never touched."""
    for name in _AWS_VARS + _AZURE_VARS + _GCS_VARS:
        monkeypatch.delenv(name, raising=False)


def _seaweed():
    from raylastic.testing.seaweedfs import SeaweedNotInstalled, SeaweedS3

    try:
        return SeaweedS3()
    except SeaweedNotInstalled as exc:
        pytest.skip(str(exc))


def _azurite():
    from raylastic.testing.azurite import Azurite, AzuriteNotInstalled

    try:
        return Azurite()
    except AzuriteNotInstalled as exc:
        pytest.skip(str(exc))


def _fake_gcs():
    from raylastic.testing.gcs_emulator import FakeGcs, FakeGcsNotInstalled

    try:
        return FakeGcs()
    except FakeGcsNotInstalled as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def seaweed_server():
    """One SeaweedFS S3 server for the session; its bucket is ``seaweed_server.bucket``."""
    with _seaweed() as server:
        yield server


@pytest.fixture
def seaweed_private():
    """A SeaweedFS server of this test's own, free to stop() and start()."""
    with _seaweed() as server:
        yield server


@pytest.fixture
def s3_env(monkeypatch, seaweed_server):
    """Point pyarrow's S3 client at the shared server via the environment."""
    clear_storage_env(monkeypatch)
    for key, value in seaweed_server.env().items():
        monkeypatch.setenv(key, value)
    return seaweed_server


@pytest.fixture(scope="session")
def azurite_server():
    """One Azurite emulator for the session (in-memory: a restart loses containers)."""
    with _azurite() as server:
        yield server


@pytest.fixture
def azurite_private():
    """An Azurite of this test's own, free to stop() and start()."""
    with _azurite() as server:
        yield server


@pytest.fixture
def azure_env(monkeypatch, azurite_server):
    """AZURE_STORAGE_CONNECTION_STRING for the shared emulator, and a fresh container."""
    clear_storage_env(monkeypatch)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_server.connection_string)
    return azurite_server


@pytest.fixture(scope="session")
def gcs_server():
    """One fake-gcs-server for the session; its bucket is ``gcs_server.bucket``."""
    with _fake_gcs() as server:
        yield server


@pytest.fixture
def gcs_private():
    """A fake-gcs-server of this test's own, free to stop() and start() (objects survive)."""
    with _fake_gcs() as server:
        yield server


@pytest.fixture
def gcs_env(monkeypatch, gcs_server):
    """STORAGE_EMULATOR_HOST for the shared server: raylastic's gs:// goes there."""
    clear_storage_env(monkeypatch)
    for key, value in gcs_server.env().items():
        monkeypatch.setenv(key, value)
    return gcs_server


def create_azure_container(connection_string: str, name: str) -> None:
    """Create a blob container (idempotent). Storage never does this unless asked."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(connection_string) as client:
        try:
            client.create_container(name)
        except ResourceExistsError:
            pass


@pytest.fixture(params=["local", "s3", "azure", "gcs"])
def storage_uri(request, tmp_path, monkeypatch):
    """A fresh, empty storage root on each backend: local dir, SeaweedFS S3, Azurite Blob,
    fake-gcs-server GCS."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    if request.param == "local":
        return str(tmp_path / prefix)
    if request.param == "s3":
        server = request.getfixturevalue("s3_env")
        return server.uri(prefix)
    if request.param == "gcs":
        server = request.getfixturevalue("gcs_env")
        return server.uri(prefix)
    server = request.getfixturevalue("azure_env")
    create_azure_container(server.connection_string, "checkpoints")
    return f"abfs://checkpoints/{prefix}"


class PrivateStore:
    """A server of the test's own behind one interface: ``uri(prefix)``, ``stop()``,
    ``start()`` (Azurite loses its containers on restart: ``start()`` recreates ours, empty)."""

    def __init__(self, kind: str, server, monkeypatch) -> None:
        self.kind, self.server = kind, server
        clear_storage_env(monkeypatch)
        env = ({"AZURE_STORAGE_CONNECTION_STRING": server.connection_string}
               if kind == "azure" else server.env())
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        self._ensure_container()

    @property
    def keeps_data(self) -> bool:
        return self.kind != "azure"

    def _ensure_container(self) -> None:
        if self.kind == "azure":
            create_azure_container(self.server.connection_string, "checkpoints")

    def uri(self, prefix: str) -> str:
        if self.kind == "azure":
            return f"abfs://checkpoints/{prefix}"
        return self.server.uri(prefix)

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()
        self._ensure_container()


@pytest.fixture(params=["s3", "azure", "gcs"])
def private_store(request, monkeypatch):
    """A private server (SeaweedFS, Azurite or fake-gcs-server), env pointing at it."""
    fixture = {"s3": "seaweed_private", "azure": "azurite_private", "gcs": "gcs_private"}
    return PrivateStore(request.param, request.getfixturevalue(fixture[request.param]), monkeypatch)
