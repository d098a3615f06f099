"""Storage URIs, where their credentials come from, and one ``pyarrow.fs`` filesystem
per scheme (local, ``s3://``, ``gs://``, ``abfs://``/``az://``): the backend half of the
storage seam. ``storage.py``'s docstring says which environment variables each scheme
reads; ``Storage`` (storage.py) is what the rest of raylastic uses.
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping
from urllib.parse import parse_qsl, urlencode, urlsplit

import pyarrow.fs as pafs

from raylastic.checkpoint.names import LiteralFSSpecHandler
from raylastic.checkpoint.retry import _redact

logger = logging.getLogger("raylastic.checkpoint.storage")


# ----------------------------------------------------------------------------- URIs

_SECRET_QUERY_KEYS = {
    "access_key",
    "secret_key",
    "session_token",
    "sas_token",
    "account_key",
    "connection_string",
    "credential",
    "client_secret",
    "access_token",
    "sig",
}
_ALLOWED_QUERY = {
    "s3": {"endpoint_override", "region", "scheme", "force_virtual_addressing", "anonymous"},
    "gs": {"endpoint_override", "scheme", "anonymous", "project_id"},
    "az": set(),
    "file": set(),
    "pyfs": set(),
}
_SCHEMES = {
    "": "file",
    "file": "file",
    "s3": "s3",
    "gs": "gs",
    "gcs": "gs",
    "abfs": "az",
    "abfss": "az",
    "az": "az",
    "pyfs": "pyfs",
}


@dataclass(frozen=True)
class ParsedUri:
    """A storage URI split into parts, with nothing secret in it."""

    kind: str  # "file" | "s3" | "gs" | "az"
    bucket: str  # bucket / container ("" for local)
    prefix: str  # path inside the bucket, or the absolute local path
    account: str | None  # Azure account named in the URI host, if any
    options: Mapping[str, str] = field(default_factory=dict)
    uri: str = ""  # normalised URI


def parse_uri(uri: str) -> ParsedUri:
    """Parse and normalise a storage URI; reject credentials embedded in it."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError(f"storage uri must be a non-empty string, got {uri!r}")
    uri = uri.strip()
    if "://" not in uri:  # a plain local path
        path = os.path.abspath(os.path.expanduser(uri))
        return ParsedUri("file", "", path, None, {}, path)
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(
            f"unsupported storage scheme {scheme!r} in {_redact(uri, ())!r}; "
            "use a local path, file://, s3://, gs://, abfs:// or az://"
        )
    kind = _SCHEMES[scheme]
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    leaked = sorted(k for k in query if k.lower() in _SECRET_QUERY_KEYS)
    if leaked or (parts.password is not None) or (kind in ("s3", "gs") and "@" in parts.netloc):
        raise ValueError(
            f"storage uri {scheme}://{parts.hostname or ''}/... carries credentials "
            f"({', '.join(leaked) or 'user:secret@'}); pass them through the environment "
            "instead (they would be pickled to every worker and logged)"
        )
    endpoint = urlsplit(query.get("endpoint_override", ""))
    if endpoint.username is not None or endpoint.password is not None or "@" in endpoint.netloc:
        raise ValueError(
            f"storage uri {scheme}://{parts.hostname or ''}/...: endpoint_override carries "
            "credentials (user:secret@); pass them through the environment instead (the URI is "
            "logged and pickled to every worker)"
        )
    unknown = sorted(set(query) - _ALLOWED_QUERY[kind])
    if unknown:
        raise ValueError(
            f"unknown query option(s) {unknown} for {scheme}:// (allowed: {sorted(_ALLOWED_QUERY[kind]) or 'none'})"
        )
    if kind == "file":
        path = os.path.abspath(os.path.expanduser((parts.netloc or "") + parts.path))
        return ParsedUri("file", "", path, None, {}, path)
    if kind == "pyfs":  # pyfs://<key>/<path on that filesystem>: see filesystem_uri
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        if not parts.netloc or not path.strip("/") or any(p in ("..", ".") for p in path.strip("/").split("/")):
            raise ValueError(
                f"storage uri {uri!r}: expected pyfs://<filesystem key>/<path>, with no '.' or '..' segments"
            )
        return ParsedUri("pyfs", parts.netloc, path.rstrip("/"), None, {}, f"pyfs://{parts.netloc}/{path.rstrip('/')}")
    account = None
    bucket = parts.netloc
    if kind == "az" and "@" in bucket:
        bucket, host = bucket.split("@", 1)
        account = host.split(".", 1)[0] or None
    if not bucket:
        raise ValueError(f"storage uri {uri!r} names no bucket/container")
    prefix = parts.path.strip("/")
    if any(p in ("..", ".") for p in prefix.split("/")):
        raise ValueError(f"storage uri {uri!r} must not contain '.' or '..' segments")
    netloc = f"{bucket}@{account}.dfs.core.windows.net" if account else bucket
    out_scheme = {"s3": "s3", "gs": "gs", "az": scheme}[kind]
    norm = f"{out_scheme}://{netloc}" + (f"/{prefix}" if prefix else "")
    if query:
        norm += "?" + urlencode(sorted(query.items()), safe=":/")
    return ParsedUri(kind, bucket, prefix, account, dict(sorted(query.items())), norm)


# ----------------------------------------------------------------------------- credentials


@dataclass(frozen=True)
class AzureCredentials:
    """Which Azure credential was chosen; the secret itself never appears in repr."""

    source: str  # e.g. "AZURE_STORAGE_CONNECTION_STRING"
    account_name: str | None
    endpoint: str | None = None  # blob endpoint, when the connection string names one
    kwargs: Mapping[str, object] = field(default_factory=dict, repr=False, compare=False)

    def secrets(self) -> tuple[str, ...]:
        return tuple(v for v in self.kwargs.values() if isinstance(v, str))


def _parse_connection_string(conn: str) -> dict[str, str]:
    fields = {}
    for item in conn.split(";"):
        if "=" in item:
            key, value = item.split("=", 1)
            fields[key.strip()] = value.strip()
    return fields


def select_azure_credentials(env: Mapping[str, str], account_in_uri: str | None) -> AzureCredentials:
    """Pick Azure credentials in the documented order (see module docstring)."""
    account = account_in_uri or env.get("AZURE_STORAGE_ACCOUNT_NAME") or None
    conn = env.get("AZURE_STORAGE_CONNECTION_STRING")
    if conn:
        fields = _parse_connection_string(conn)
        conn_account = fields.get("AccountName")
        if account_in_uri and conn_account and conn_account != account_in_uri:
            raise ValueError(
                f"URI names Azure account {account_in_uri!r} but AZURE_STORAGE_CONNECTION_STRING "
                f"is for {conn_account!r}"
            )
        return AzureCredentials(
            "AZURE_STORAGE_CONNECTION_STRING",
            conn_account or account,
            fields.get("BlobEndpoint"),
            {"connection_string": conn},
        )
    if account and env.get("AZURE_STORAGE_ACCOUNT_KEY"):
        return AzureCredentials(
            "AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_ACCOUNT_KEY",
            account,
            None,
            {"account_name": account, "account_key": env["AZURE_STORAGE_ACCOUNT_KEY"]},
        )
    if account and env.get("AZURE_STORAGE_SAS_TOKEN"):
        return AzureCredentials(
            "AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_SAS_TOKEN",
            account,
            None,
            {"account_name": account, "sas_token": env["AZURE_STORAGE_SAS_TOKEN"]},
        )
    if not account:
        raise ValueError(
            "no Azure credentials: set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY / AZURE_STORAGE_SAS_TOKEN "
            "/ a DefaultAzureCredential identity (or name the account in the URI: "
            "abfs://container@ACCOUNT.dfs.core.windows.net/path)"
        )
    return AzureCredentials("DefaultAzureCredential (azure-identity)", account, None, {"account_name": account})


def describe_aws_credentials(env: Mapping[str, str], anonymous: bool = False) -> str:
    """Name the AWS credential source the SDK chain will use first (no values)."""
    if anonymous:
        return "anonymous"
    if env.get("AWS_ACCESS_KEY_ID"):
        return "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY environment variables"
    if env.get("AWS_PROFILE"):
        return f"AWS profile {env['AWS_PROFILE']!r}"
    if env.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
        return "AWS web identity token (AWS_WEB_IDENTITY_TOKEN_FILE)"
    return "AWS default chain (shared credentials file, instance/container metadata)"


def describe_gcs_credentials(env: Mapping[str, str], anonymous: bool = False) -> str:
    """Name the Google credential source (the key file path is not secret, its content is)."""
    if anonymous:
        return "anonymous"
    if env.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return f"GOOGLE_APPLICATION_CREDENTIALS={env['GOOGLE_APPLICATION_CREDENTIALS']}"
    return "Google application default credentials (gcloud / metadata server)"


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "yes", "on")


# ----------------------------------------------------------------------------- backends


@dataclass
class _Backend:
    fs: pafs.FileSystem
    root: str
    target: str  # "s3 bucket 'b' at http://... (credentials: ...)"
    secrets: tuple[str, ...] = ()
    bucket_path: str | None = None  # fs path whose existence means the bucket exists
    create_bucket: Callable[[], None] | None = None
    # Directories are only prefixes the filesystem cannot list one level at a time (GCS
    # through pyarrow: a non-recursive listing shows marker objects only, not prefixes).
    implicit_dirs: bool = False


def _s3_backend(p: ParsedUri, env: Mapping[str, str]) -> _Backend:
    opts = p.options
    anonymous = _truthy(opts.get("anonymous"))
    endpoint = opts.get("endpoint_override") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    kwargs: dict = {
        "anonymous": anonymous,
        "connect_timeout": 5.0,
        "request_timeout": 60.0,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=2),
    }
    if endpoint:
        kwargs["endpoint_override"] = endpoint
    if opts.get("region") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"):
        kwargs["region"] = opts.get("region") or env.get("AWS_REGION") or env["AWS_DEFAULT_REGION"]
    if opts.get("scheme"):
        kwargs["scheme"] = opts["scheme"]
    if "force_virtual_addressing" in opts:
        kwargs["force_virtual_addressing"] = _truthy(opts["force_virtual_addressing"])
    fs = pafs.S3FileSystem(**kwargs)
    where = f" at {endpoint}" if endpoint else ""
    target = f"s3 bucket {p.bucket!r}{where} (credentials: {describe_aws_credentials(env, anonymous)})"
    secrets = tuple(env.get(k, "") for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"))
    # A second client may create buckets; the run's own cannot, so a typo never makes one.
    creator = lambda: pafs.S3FileSystem(**kwargs, allow_bucket_creation=True).create_dir(p.bucket)
    return _Backend(fs, _join(p.bucket, p.prefix), target, secrets, p.bucket, creator)


GCS_EMULATOR_VARS = ("CLOUD_STORAGE_EMULATOR_ENDPOINT", "STORAGE_EMULATOR_HOST")


def gcs_endpoint(options: Mapping[str, str], env: Mapping[str, str]) -> tuple[str | None, str | None, str | None]:
    """``(host:port, scheme, source)`` of a custom GCS endpoint, or Nones for Google's.

    The URI's ``endpoint_override`` wins; else the first emulator variable that is set
    (``http://127.0.0.1:4443`` or a bare ``127.0.0.1:4443``, which means http)."""
    if options.get("endpoint_override"):
        return options["endpoint_override"], options.get("scheme"), "endpoint_override"
    for var in GCS_EMULATOR_VARS:
        value = (env.get(var) or "").strip().rstrip("/")
        if value:
            parts = urlsplit(value if "://" in value else f"http://{value}")
            if parts.scheme not in ("http", "https") or not parts.netloc or parts.path:
                raise ValueError(f"{var}={value!r} is not an endpoint like http://host:port")
            return parts.netloc, parts.scheme, var
    return None, options.get("scheme"), None


def _gcs_backend(p: ParsedUri, env: Mapping[str, str]) -> _Backend:
    import datetime

    opts = p.options
    endpoint, scheme, source = gcs_endpoint(opts, env)
    # An emulator named by the environment takes no credentials (as in Google's clients).
    anonymous = _truthy(opts.get("anonymous")) or source in GCS_EMULATOR_VARS
    # Our RetryPolicy owns retrying; keep the client's own retry window short (an
    # unreachable endpoint then fails each attempt in ~1-2 s instead of 5-11 s).
    kwargs: dict = {"anonymous": anonymous, "retry_time_limit": datetime.timedelta(seconds=1)}
    if endpoint:
        kwargs["endpoint_override"] = endpoint
    if scheme:
        kwargs["scheme"] = scheme
    if opts.get("project_id"):
        kwargs["project_id"] = opts["project_id"]
    fs = pafs.GcsFileSystem(**kwargs)
    where = f" at {scheme or 'https'}://{endpoint}" if endpoint else ""
    creds = describe_gcs_credentials(env, anonymous)
    if source in GCS_EMULATOR_VARS:
        creds += f", emulator named by {source}"
    target = f"gcs bucket {p.bucket!r}{where} (credentials: {creds})"
    return _Backend(
        fs, _join(p.bucket, p.prefix), target, (), p.bucket, lambda: fs.create_dir(p.bucket), implicit_dirs=True
    )


def _bound_azure_sdk_retries(afs) -> None:
    """The Azure SDK retries 3 times with 15 s+ backoff by default: minutes per call when the
    endpoint is down. Our RetryPolicy owns retrying, so shrink the SDK's to one quick retry."""
    policy = getattr(getattr(getattr(afs, "service_client", None), "_config", None), "retry_policy", None)
    if policy is not None:
        for attr, value in (
            ("total_retries", 1),
            ("connect_retries", 1),
            ("read_retries", 1),
            ("status_retries", 1),
            ("initial_backoff", 0.2),
            ("increment_base", 0),
            ("random_jitter_range", 0.1),
        ):
            if hasattr(policy, attr):
                setattr(policy, attr, value)


def _azure_backend(p: ParsedUri, env: Mapping[str, str]) -> _Backend:
    try:
        from adlfs import AzureBlobFileSystem
    except ImportError as exc:
        raise ValueError(f"{exc}; install the Azure extra: pip install 'raylastic[azure]'") from None

    creds = select_azure_credentials(env, p.account)
    kwargs = dict(creds.kwargs)
    if creds.source.startswith("DefaultAzureCredential"):
        kwargs["anon"] = False  # adlfs then builds azure.identity's (aio) DefaultAzureCredential
    afs = AzureBlobFileSystem(skip_instance_cache=True, connection_timeout=5, read_timeout=60, **kwargs)
    _bound_azure_sdk_retries(afs)
    # adlfs expands glob patterns in rm(): deletes go through a handler that names exact paths.
    fs = pafs.PyFileSystem(LiteralFSSpecHandler(afs))
    where = f" at {creds.endpoint}" if creds.endpoint else ""
    account = f" in account {creds.account_name!r}" if creds.account_name else ""
    target = f"azure container {p.bucket!r}{account}{where} (credentials: {creds.source})"
    return _Backend(fs, _join(p.bucket, p.prefix), target, creds.secrets(), p.bucket, lambda: afs.mkdir(p.bucket))


def _local_backend(p: ParsedUri, env: Mapping[str, str]) -> _Backend:
    return _Backend(pafs.LocalFileSystem(), p.prefix, f"local directory {p.prefix!r}")


# -- a pyarrow filesystem object given by the user (Ray Train's RunConfig.storage_filesystem) --

_FILESYSTEMS: dict[str, pafs.FileSystem] = {}


def filesystem_uri(fs: pafs.FileSystem, path: str) -> str:
    """The storage URI of ``path`` on filesystem object ``fs`` (``pyfs://<key>/<path>``).

    ``fs`` is registered in this process under a random key; a ``Storage`` of that URI
    pickles the filesystem object with it (as Ray Train pickles ``storage_filesystem`` to its
    workers), and unpickling registers it again in the receiving process, so the controller
    and the workers open the same filesystem. A filesystem registered twice keeps its key."""
    key = next((k for k, known in _FILESYSTEMS.items() if known is fs), None)
    if key is None:
        key = "fs" + uuid.uuid4().hex[:16]
        _FILESYSTEMS[key] = fs
    return f"pyfs://{key}/{path}"


def register_filesystem(key: str, fs: pafs.FileSystem) -> None:
    _FILESYSTEMS.setdefault(key, fs)


def _pyfs_backend(p: ParsedUri, env: Mapping[str, str]) -> _Backend:
    fs = _FILESYSTEMS.get(p.bucket)
    if fs is None:
        raise ValueError(
            f"filesystem {p.bucket!r} is not known in this process (a pyfs:// URI is "
            "valid only where its Storage was created or unpickled)"
        )
    handler: Any = getattr(fs, "handler", None)
    if isinstance(fs, pafs.PyFileSystem) and type(handler) is pafs.FSSpecHandler:
        fs = pafs.PyFileSystem(LiteralFSSpecHandler(handler.fs))  # deletes by exact name (names.py)
    return _Backend(fs, p.prefix, f"{fs.type_name} filesystem at {p.prefix!r}")


_BACKENDS = {"file": _local_backend, "s3": _s3_backend, "gs": _gcs_backend, "az": _azure_backend, "pyfs": _pyfs_backend}


def _join(*parts: str) -> str:
    return "/".join(s.strip("/") for s in parts if s and s.strip("/"))
