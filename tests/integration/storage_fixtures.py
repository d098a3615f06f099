"""Fixtures for real storage servers (SeaweedFS S3, Azurite Blob), imported by tests/conftest.py.

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
    "azure_env", "storage_uri", "create_azure_container", "clear_storage_env",
]

_AWS_VARS = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID",
             "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION",
             "AWS_DEFAULT_REGION", "AWS_WEB_IDENTITY_TOKEN_FILE")
_AZURE_VARS = ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME",
               "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CLIENT_ID",
               "AZURE_STORAGE_CLIENT_SECRET", "AZURE_STORAGE_TENANT_ID")


def clear_storage_env(monkeypatch) -> None:
    """Drop ambient cloud credentials so a developer's own account is never touched."""
    for name in _AWS_VARS + _AZURE_VARS:
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


def create_azure_container(connection_string: str, name: str) -> None:
    """Create a blob container (idempotent). Storage never does this unless asked."""
    from azure.core.exceptions import ResourceExistsError
    from azure.storage.blob import BlobServiceClient

    with BlobServiceClient.from_connection_string(connection_string) as client:
        try:
            client.create_container(name)
        except ResourceExistsError:
            pass


@pytest.fixture(params=["local", "s3", "azure"])
def storage_uri(request, tmp_path, monkeypatch):
    """A fresh, empty storage root on each backend: local dir, SeaweedFS S3, Azurite Blob."""
    prefix = f"t-{uuid.uuid4().hex[:10]}"
    if request.param == "local":
        return str(tmp_path / prefix)
    if request.param == "s3":
        server = request.getfixturevalue("s3_env")
        return server.uri(prefix)
    server = request.getfixturevalue("azure_env")
    create_azure_container(server.connection_string, "checkpoints")
    return f"abfs://checkpoints/{prefix}"
