"""The storage seam: one small interface over local disk, S3, Azure Blob and GCS.

Checkpoints outlive the workers that write them, so everything above this module talks to
a :class:`Storage` (a ``pyarrow.fs`` filesystem plus a root path) and never to a cloud SDK.
Errors are sorted into two kinds because they call for opposite reactions: a *transient*
error (timeout, refused connection, 5xx, throttling) is retried with bounded, jittered
backoff; a *permanent* one (missing bucket, bad credentials, 403) fails at once with a
message naming the bucket/container and the credential source tried, never the secret.

Credentials come only from the environment (or the cloud SDK's default chain), never from
the URI: a ``Storage`` is pickled to Ray workers as its URI, so anything in the URI would
travel in plain text through the object store and into logs.

S3: ``s3://bucket/prefix``; the endpoint comes from ``?endpoint_override=`` or
AWS_ENDPOINT_URL(_S3), credentials from the AWS chain (AWS_ACCESS_KEY_ID/...). For
S3-compatible stores also set AWS_REQUEST_CHECKSUM_CALCULATION=when_required and
AWS_RESPONSE_CHECKSUM_VALIDATION=when_required (they reject the SDK's default checksums).

Azure: ``abfs://``/``az://`` go through adlfs wrapped in ``PyFileSystem(FSSpecHandler)``.
Credential order: AZURE_STORAGE_CONNECTION_STRING; AZURE_STORAGE_ACCOUNT_NAME +
AZURE_STORAGE_ACCOUNT_KEY; AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_SAS_TOKEN; else
DefaultAzureCredential with AZURE_STORAGE_ACCOUNT_NAME (or the account named in the URI).
Only a connection string can name a custom endpoint (e.g. Azurite); the other sources
talk to https://ACCOUNT.blob.core.windows.net.

GCS: ``gs://`` uses pyarrow's GcsFileSystem and its default chain
(GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server). A custom endpoint comes from
``?endpoint_override=host:port&scheme=http`` (credentials as above; add ``anonymous=true`` for
an unauthenticated server), else from CLOUD_STORAGE_EMULATOR_ENDPOINT (read by
google-cloud-cpp, which pyarrow's client is built on) or STORAGE_EMULATOR_HOST (Google's
Python client and gcsfs): those name an emulator, so they imply anonymous access, as in
Google's own clients. The test suite runs against fake-gcs-server
(raylastic.testing.gcs_emulator). GCS has no directories and pyarrow lists only "directory
marker" objects as directories, so listings under gs:// are recursive (see ``list_dir``).
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Literal, Mapping, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import pyarrow.fs as pafs

__all__ = [
    "StorageError",
    "TransientStorageError",
    "PermanentStorageError",
    "RetryPolicy",
    "Storage",
    "classify_error",
    "retry_call",
    "parse_uri",
    "select_azure_credentials",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
ErrorKind = Literal["transient", "permanent"]
_CHUNK = 8 * 1024 * 1024


class StorageError(Exception):
    """Base of storage failures; a plain message so it pickles across Ray."""


class TransientStorageError(StorageError):
    """The store was unreachable or overloaded for every attempt the RetryPolicy allowed."""


class PermanentStorageError(StorageError):
    """Retrying cannot help (missing bucket/container, denied access, bad credentials)."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with full jitter (AWS architecture blog's variant).

    Full jitter spreads the retries of many workers hitting the same throttled bucket.
    """

    max_attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts ({self.max_attempts}) must be >= 1")
        if self.base_delay_s < 0 or self.max_delay_s < 0:
            raise ValueError("base_delay_s and max_delay_s must be >= 0")

    def delay(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to sleep after failed attempt number ``attempt`` (1-based)."""
        cap = min(self.max_delay_s, self.base_delay_s * (2 ** (attempt - 1)))
        return cap * rand()


# ----------------------------------------------------------------------------- errors

_TRANSIENT_PATTERNS = re.compile(
    r"NETWORK_CONNECTION|couldn'?t connect|connection (?:refused|reset|aborted|closed)"
    r"|timed? ?out|timeout|SLOW_?DOWN|throttl|TooManyRequests|RequestLimitExceeded"
    r"|SERVICE_UNAVAILABLE|ServiceUnavailable|INTERNAL_FAILURE|InternalError|ServerBusy"
    r"|OperationTimedOut|Empty reply|broken pipe|temporarily unavailable"
    r"|Cannot connect to host|Server disconnected|curlCode: (?:6|7|28|52|55|56)\b"
    r"|CURL error \[(?:6|7|28|52|55|56)\]|\bUNAVAILABLE\b|DEADLINE_EXCEEDED|RESOURCE_EXHAUSTED",
    re.IGNORECASE,
)
_PERMANENT_PATTERNS = re.compile(
    r"NO_SUCH_BUCKET|NoSuchBucket|ContainerNotFound|ACCESS_DENIED|AccessDenied"
    r"|INVALID_ACCESS_KEY_ID|InvalidAccessKeyId|SIGNATURE_DOES_NOT_MATCH|SignatureDoesNotMatch"
    r"|AuthenticationFailed|AuthorizationFailure|AuthorizationPermissionMismatch"
    r"|ExpiredToken|InvalidToken|UNRECOGNIZED_CLIENT|Forbidden|Unauthorized"
    r"|PERMISSION_DENIED|UNAUTHENTICATED",
    re.IGNORECASE,
)
_HTTP_STATUS = re.compile(r"(?:response code|status(?: code)?|HTTP)[^0-9\n]{0,4}(\d{3})\b", re.I)
_TRANSIENT_TYPES = (TimeoutError, ConnectionError)
_TRANSIENT_TYPE_NAMES = {
    "ServiceRequestError", "ServiceResponseError", "ServiceRequestTimeoutError",
    "ServiceResponseTimeoutError", "ClientConnectorError", "ServerDisconnectedError",
    "ClientOSError", "ServerTimeoutError", "EndpointConnectionError", "ConnectTimeoutError",
    "ReadTimeoutError", "IncompleteReadError",
}
_PERMANENT_TYPE_NAMES = {
    "ClientAuthenticationError", "CredentialUnavailableError", "NoCredentialsError",
    "ResourceNotFoundError",
}


def _status_of(exc: BaseException) -> int | None:
    for attr in ("status_code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value <= 599:
            return value
    match = _HTTP_STATUS.search(str(exc))
    return int(match.group(1)) if match else None


def classify_error(exc: BaseException) -> ErrorKind:
    """Sort an exception from pyarrow, adlfs/azure or the OS into transient or permanent.

    Unknown errors are permanent: retrying a bug only delays the traceback. Message patterns
    are needed because pyarrow surfaces every S3/GCS failure as a bare ``OSError``.
    """
    if isinstance(exc, TransientStorageError):
        return "transient"
    if isinstance(exc, (PermanentStorageError, PermissionError, FileNotFoundError)):
        return "permanent"
    if isinstance(exc, _TRANSIENT_TYPES):
        return "transient"
    names = {cls.__name__ for cls in type(exc).__mro__}
    status = _status_of(exc)
    if status is not None:
        return "transient" if status >= 500 or status in (408, 429) else "permanent"
    if names & _PERMANENT_TYPE_NAMES:
        return "permanent"
    if names & _TRANSIENT_TYPE_NAMES:
        return "transient"
    text = f"{type(exc).__name__}: {exc}"
    if _PERMANENT_PATTERNS.search(text):
        return "permanent"
    if _TRANSIENT_PATTERNS.search(text):
        return "transient"
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        return classify_error(cause)
    return "permanent"


def _is_storage_exception(exc: BaseException | None, depth: int = 0) -> bool:
    """True for errors raised by I/O layers, or wrapping one (adlfs raises RuntimeError from
    azure errors); programming errors propagate unwrapped."""
    if exc is None or depth > 8:
        return False
    if isinstance(exc, (OSError, StorageError)):
        return True
    module = type(exc).__module__ or ""
    if module.split(".")[0] in {"azure", "aiohttp", "adlfs", "botocore", "google", "fsspec"}:
        return True
    return _is_storage_exception(exc.__cause__ or exc.__context__, depth + 1)


_SECRET_IN_TEXT = re.compile(
    r"((?:sig|AccountKey|SharedAccessSignature|secret_key|session_token|access_key"
    r"|X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token)=)[^&;\s'\"]+",
    re.IGNORECASE,
)


def _redact(text: str, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return _SECRET_IN_TEXT.sub(r"\1***", text)


def retry_call(fn: Callable[[], T], policy: RetryPolicy, *, what: str = "storage call",
               secrets: tuple[str, ...] = (), sleep: Callable[[float], None] = time.sleep,
               rand: Callable[[], float] = random.random) -> T:
    """Call ``fn``; retry transient errors under ``policy``, then raise a StorageError.

    FileNotFoundError (a missing object is an answer, not a failure) and non-I/O exceptions
    (bugs) propagate unchanged. The original error is summarised, secrets redacted, and not
    chained: an SDK message can carry a signed URL.
    """
    attempt = 0
    while True:
        attempt += 1
        try:
            return fn()
        except FileNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            if isinstance(exc, StorageError) or not _is_storage_exception(exc):
                raise
            kind = classify_error(exc)
            if kind == "transient" and attempt < policy.max_attempts:
                delay = policy.delay(attempt, rand)
                logger.warning("%s: attempt %d/%d failed, retrying in %.2fs: %s", what, attempt,
                               policy.max_attempts, delay, _summarise(exc, secrets, 200))
                sleep(delay)
                continue
            detail = _summarise(exc, secrets)
            if kind == "transient":
                raise TransientStorageError(
                    f"{what}: still failing after {attempt} attempt(s) (raise "
                    f"RetryPolicy.max_attempts={policy.max_attempts} to wait longer): {detail}"
                ) from None
            raise PermanentStorageError(f"{what}: {detail}") from None


def _summarise(exc: BaseException, secrets: tuple[str, ...], limit: int = 400) -> str:
    """One line, bounded, secrets redacted (Azure errors embed multi-line XML bodies)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    text = _redact(text, secrets)
    return text if len(text) <= limit else text[:limit] + " ..."


# ----------------------------------------------------------------------------- URIs

_SECRET_QUERY_KEYS = {
    "access_key", "secret_key", "session_token", "sas_token", "account_key",
    "connection_string", "credential", "client_secret", "access_token", "sig",
}
_ALLOWED_QUERY = {
    "s3": {"endpoint_override", "region", "scheme", "force_virtual_addressing", "anonymous"},
    "gs": {"endpoint_override", "scheme", "anonymous", "project_id"},
    "az": set(),
    "file": set(),
}
_SCHEMES = {"": "file", "file": "file", "s3": "s3", "gs": "gs", "gcs": "gs",
            "abfs": "az", "abfss": "az", "az": "az"}


@dataclass(frozen=True)
class ParsedUri:
    """A storage URI split into parts, with nothing secret in it."""

    kind: str            # "file" | "s3" | "gs" | "az"
    bucket: str          # bucket / container ("" for local)
    prefix: str          # path inside the bucket, or the absolute local path
    account: str | None  # Azure account named in the URI host, if any
    options: Mapping[str, str] = field(default_factory=dict)
    uri: str = ""        # normalised URI


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
            "use a local path, file://, s3://, gs://, abfs:// or az://")
    kind = _SCHEMES[scheme]
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    leaked = sorted(k for k in query if k.lower() in _SECRET_QUERY_KEYS)
    if leaked or (parts.password is not None) or (kind in ("s3", "gs") and "@" in parts.netloc):
        raise ValueError(
            f"storage uri {scheme}://{parts.hostname or ''}/... carries credentials "
            f"({', '.join(leaked) or 'user:secret@'}); pass them through the environment "
            "instead (they would be pickled to every worker and logged)")
    unknown = sorted(set(query) - _ALLOWED_QUERY[kind])
    if unknown:
        raise ValueError(f"unknown query option(s) {unknown} for {scheme}:// "
                         f"(allowed: {sorted(_ALLOWED_QUERY[kind]) or 'none'})")
    if kind == "file":
        path = os.path.abspath(os.path.expanduser((parts.netloc or "") + parts.path))
        return ParsedUri("file", "", path, None, {}, path)
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

    source: str                    # e.g. "AZURE_STORAGE_CONNECTION_STRING"
    account_name: str | None
    endpoint: str | None = None    # blob endpoint, when the connection string names one
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
                f"is for {conn_account!r}")
        return AzureCredentials("AZURE_STORAGE_CONNECTION_STRING", conn_account or account,
                                fields.get("BlobEndpoint"), {"connection_string": conn})
    if account and env.get("AZURE_STORAGE_ACCOUNT_KEY"):
        return AzureCredentials("AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_ACCOUNT_KEY", account,
                                None, {"account_name": account,
                                       "account_key": env["AZURE_STORAGE_ACCOUNT_KEY"]})
    if account and env.get("AZURE_STORAGE_SAS_TOKEN"):
        return AzureCredentials("AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_SAS_TOKEN", account,
                                None, {"account_name": account,
                                       "sas_token": env["AZURE_STORAGE_SAS_TOKEN"]})
    if not account:
        raise ValueError(
            "no Azure credentials: set AZURE_STORAGE_CONNECTION_STRING, or "
            "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY / AZURE_STORAGE_SAS_TOKEN "
            "/ a DefaultAzureCredential identity (or name the account in the URI: "
            "abfs://container@ACCOUNT.dfs.core.windows.net/path)")
    return AzureCredentials("DefaultAzureCredential (azure-identity)", account, None,
                            {"account_name": account})


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
    target: str                  # "s3 bucket 'b' at http://... (credentials: ...)"
    secrets: tuple[str, ...] = ()
    bucket_path: str | None = None   # fs path whose existence means the bucket exists
    create_bucket: Callable[[], None] | None = None
    # Directories are only prefixes the filesystem cannot list one level at a time (GCS
    # through pyarrow: a non-recursive listing shows marker objects only, not prefixes).
    implicit_dirs: bool = False


def _s3_backend(p: ParsedUri, env: Mapping[str, str]) -> _Backend:
    opts = p.options
    anonymous = _truthy(opts.get("anonymous"))
    endpoint = opts.get("endpoint_override") or env.get("AWS_ENDPOINT_URL_S3") or env.get(
        "AWS_ENDPOINT_URL")
    kwargs: dict = {"anonymous": anonymous, "connect_timeout": 5.0, "request_timeout": 60.0,
                    "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=2)}
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


def gcs_endpoint(options: Mapping[str, str], env: Mapping[str, str]
                 ) -> tuple[str | None, str | None, str | None]:
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
    kwargs: dict = {"anonymous": anonymous,
                    "retry_time_limit": datetime.timedelta(seconds=1)}
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
    return _Backend(fs, _join(p.bucket, p.prefix), target, (), p.bucket,
                    lambda: fs.create_dir(p.bucket), implicit_dirs=True)


def _bound_azure_sdk_retries(afs) -> None:
    """The Azure SDK retries 3 times with 15 s+ backoff by default: minutes per call when the
    endpoint is down. Our RetryPolicy owns retrying, so shrink the SDK's to one quick retry."""
    policy = getattr(getattr(getattr(afs, "service_client", None), "_config", None),
                     "retry_policy", None)
    if policy is not None:
        for attr, value in (("total_retries", 1), ("connect_retries", 1), ("read_retries", 1),
                            ("status_retries", 1), ("initial_backoff", 0.2),
                            ("increment_base", 0), ("random_jitter_range", 0.1)):
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
    afs = AzureBlobFileSystem(skip_instance_cache=True, connection_timeout=5, read_timeout=60,
                              **kwargs)
    _bound_azure_sdk_retries(afs)
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(afs))
    where = f" at {creds.endpoint}" if creds.endpoint else ""
    account = f" in account {creds.account_name!r}" if creds.account_name else ""
    target = f"azure container {p.bucket!r}{account}{where} (credentials: {creds.source})"
    return _Backend(fs, _join(p.bucket, p.prefix), target, creds.secrets(), p.bucket,
                    lambda: afs.mkdir(p.bucket))


def _local_backend(p: ParsedUri, env: Mapping[str, str]) -> _Backend:
    return _Backend(pafs.LocalFileSystem(), p.prefix, f"local directory {p.prefix!r}")


_BACKENDS = {"file": _local_backend, "s3": _s3_backend, "gs": _gcs_backend, "az": _azure_backend}


def _join(*parts: str) -> str:
    return "/".join(s.strip("/") for s in parts if s and s.strip("/"))


# ----------------------------------------------------------------------------- Storage

class Storage:
    """A run's storage root: a pyarrow filesystem and a base path within it.

    Every method retries transient errors under ``retry`` and raises
    :class:`TransientStorageError` when the attempts run out, or
    :class:`PermanentStorageError` at once. A missing object is not a storage failure:
    ``read_bytes``/``download_dir`` raise ``FileNotFoundError`` for it.

    ``create_container=True`` creates a missing bucket/container on first use (tests and
    scratch runs); by default a missing one is a PermanentStorageError, because silently
    creating a bucket from a typo'd URI hides the typo until someone looks for the data.
    """

    def __init__(self, uri: str, *, retry: RetryPolicy | None = None,
                 create_container: bool = False) -> None:
        """A malformed URI raises ValueError; unusable credentials PermanentStorageError.
        Credentials are read from os.environ here (and again wherever it is unpickled)."""
        parsed = parse_uri(uri)
        self.uri: str = parsed.uri
        self.retry: RetryPolicy = retry or RetryPolicy()
        self.create_container = create_container
        self.is_local: bool = parsed.kind == "file"
        self.kind: str = parsed.kind
        self.bucket: str = parsed.bucket
        self._sleep: Callable[[float], None] = time.sleep
        try:
            backend = _BACKENDS[parsed.kind](parsed, os.environ)
        except ValueError as exc:
            raise PermanentStorageError(f"cannot open storage {self.uri!r}: {exc}") from None
        self.fs: pafs.FileSystem = backend.fs
        self.root: str = backend.root
        self.target: str = backend.target
        self._backend = backend
        self._root_checked = self.is_local

    # -- plumbing ------------------------------------------------------------------------

    def __reduce__(self):
        return (_rebuild, (self.uri, self.retry, self.create_container))

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    def path(self, *parts: str) -> str:
        """Filesystem path of ``parts`` under the root; refuses '..' so callers stay inside."""
        rel = _join(*parts)
        if any(seg in ("..", ".") for seg in rel.split("/")):
            raise ValueError(f"storage path {rel!r} must not contain '.' or '..' segments")
        return _join(self.root, rel) if not self.is_local else (
            os.path.join(self.root, *rel.split("/")) if rel else self.root)

    def _call(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` under the retry policy, translating errors into the two kinds."""
        if not self._root_checked:
            self._check_root()
        what = f"{op} {rel!r} on {self.target}" if rel else f"{op} {self.target}"
        return retry_call(fn, self.retry, sleep=self._sleep, what=what,
                          secrets=self._backend.secrets)

    def _check_root(self) -> None:
        """Fail fast, by name, when the bucket/container is missing or access is denied."""
        bucket = self._backend.bucket_path

        def probe() -> bool:
            return self.fs.get_file_info(bucket).type != pafs.FileType.NotFound

        self._root_checked = True  # probe runs through _call; avoid recursing
        try:
            exists = self._call("checking access to", "", probe)
            if not exists:
                if not self.create_container:
                    raise PermanentStorageError(
                        f"{self.target} does not exist; create it first (or pass "
                        "create_container=True) - raylastic does not create buckets silently")
                self._call("creating", "", self._backend.create_bucket)
        except BaseException:
            self._root_checked = False
            raise

    # -- operations ------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write one object. Local writes go through a temp file + os.replace so a crash
        never leaves a half-written file under the final name (object stores PUT atomically)."""
        path = self.path(rel)
        if self.is_local:
            self._call("write", rel, lambda: _atomic_local_write(path, data))
            return

        def put() -> None:
            with self.fs.open_output_stream(path) as out:
                out.write(data)

        self._call("write", rel, put)

    def read_bytes(self, rel: str) -> bytes:
        path = self.path(rel)

        def get() -> bytes:
            with self._open_input(path) as src:
                return src.read()

        return self._call("read", rel, get)

    def _open_input(self, path: str):
        """Open for reading; re-check a "not found" with a stat. fsspec's ``isfile`` (used by
        pyarrow's FSSpecHandler) turns an unreachable Azure endpoint into FileNotFoundError,
        which would read as "no checkpoint" during an outage; the stat raises the real error."""
        try:
            return self.fs.open_input_stream(path)
        except FileNotFoundError:
            if not self.is_local and self.fs.get_file_info(path).type == pafs.FileType.File:
                return self.fs.open_input_stream(path)
            raise

    def exists(self, rel: str) -> bool:
        path = self.path(rel)
        return self._call("stat", rel,
                          lambda: self.fs.get_file_info(path).type != pafs.FileType.NotFound)

    def file_sizes(self, rels: list[str]) -> list[int | None]:
        """Size of each file in ``rels``, None where there is no file, in one retried call.

        An unreachable store raises (TransientStorageError after the retries), never None:
        "missing" must only ever mean the store answered that it is missing."""
        paths = [self.path(r) for r in rels]

        def stat() -> list[int | None]:
            infos = self.fs.get_file_info(paths) if paths else []
            return [i.size if i.type == pafs.FileType.File else None for i in infos]

        what = rels[0] if len(rels) <= 1 else f"{rels[0]} (+{len(rels) - 1} more)"
        return self._call("stat", what, stat)

    def list_dir(self, rel: str = "") -> list[str]:
        """Child base names (files and directories) of ``rel``; [] when it does not exist.

        Where directories are only name prefixes that the filesystem lists as marker objects
        (GCS), the listing is recursive and reduced to the first level here: a recursive
        request costs one call per 1,000 objects below ``rel``."""
        path = self.path(rel)
        recursive = self._backend.implicit_dirs
        selector = pafs.FileSelector(path, allow_not_found=True, recursive=recursive)
        parent = path.rstrip("/")

        def ls() -> list[str]:
            try:
                infos = self.fs.get_file_info(selector)
            except (FileNotFoundError, NotADirectoryError):
                return []
            if recursive:
                return sorted({i.path[len(parent) + 1:].split("/", 1)[0] for i in infos
                               if i.path.startswith(parent + "/")} - {""})
            # adlfs may return grandchildren for a depth-1 listing: keep direct children only.
            return sorted({i.base_name for i in infos
                           if i.base_name and i.path.rstrip("/").rsplit("/", 1)[0] == parent})

        return self._call("list", rel, ls)

    def upload_dir(self, local_dir: str, rel: str) -> list[tuple[str, int]]:
        """Copy a local tree under ``rel``; returns (relative posix path, size) per file.

        Each file is retried on its own, so one throttled PUT does not resend the whole tree.
        """
        files = _walk_local(local_dir)

        def one(item: tuple[str, int]) -> None:
            name, _ = item
            src = os.path.join(local_dir, *name.split("/"))
            dst = self.path(rel, name)
            if self.is_local:
                self._call("upload", f"{rel}/{name}", lambda: _atomic_local_copy(src, dst))
            else:
                self._call("upload", f"{rel}/{name}", lambda: _copy_stream(
                    pafs.LocalFileSystem().open_input_stream, src, self.fs, dst))

        self._map(one, files)
        return files

    def download_dir(self, rel: str, local_dir: str) -> None:
        """Copy every file under ``rel`` into ``local_dir``; FileNotFoundError if none exist."""
        base = self.path(rel)
        selector = pafs.FileSelector(base, allow_not_found=True, recursive=True)
        infos = self._call("list", rel, lambda: self.fs.get_file_info(selector))
        files = [i.path for i in infos if i.type == pafs.FileType.File]
        if not files:
            raise FileNotFoundError(f"no files under {rel!r} in {self.uri}")
        prefix = base.rstrip("/") + "/"

        def one(src: str) -> None:
            name = src[len(prefix):] if src.startswith(prefix) else os.path.basename(src)
            dst = os.path.join(local_dir, *name.split("/"))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            self._call("download", f"{rel}/{name}", lambda: _copy_stream(
                self._open_input, src, pafs.LocalFileSystem(), dst))

        os.makedirs(local_dir, exist_ok=True)
        self._map(one, files)

    def delete_dir(self, rel: str) -> None:
        """Remove ``rel`` and everything under it; no error if it is missing."""
        path = self.path(rel)
        if _join(rel) == "":
            raise ValueError("delete_dir('') would delete the storage root; name a subdirectory")

        def rm() -> None:
            if self._backend.implicit_dirs:
                self._delete_prefix(path)
                return
            try:
                self.fs.delete_dir(path)
            except FileNotFoundError:
                return
            if not self.is_local:
                self._sweep_empty_dirs(path)

        self._call("delete", rel, rm)

    def _delete_prefix(self, path: str) -> None:
        """Delete every object under ``path``, then its marker object if one exists. pyarrow's
        GCS ``delete_dir`` fails on a prefix without a marker (after deleting its objects),
        and on a missing one; our writes create no markers."""
        self.fs.delete_dir_contents(path, missing_dir_ok=True)
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            try:
                self.fs.delete_dir(path)
            except FileNotFoundError:
                pass

    def _sweep_empty_dirs(self, path: str) -> None:
        """SeaweedFS can keep emptied directories after a batch delete; they are invisible to
        recursive listings and pyarrow cannot delete them, yet ``list_dir`` shows them. Touch
        an object inside each leftover (deepest first) and delete the directory again, which
        makes the server drop it. Costs one HEAD on stores without the quirk."""
        if self.fs.get_file_info(path).type != pafs.FileType.Directory:
            return
        selector = pafs.FileSelector(path, allow_not_found=True, recursive=False)
        for info in self.fs.get_file_info(selector):
            if info.type == pafs.FileType.Directory:
                self._sweep_empty_dirs(info.path)
            elif info.type == pafs.FileType.File:
                self.fs.delete_file(info.path)
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            with self.fs.open_output_stream(f"{path}/.raylastic-sweep"):
                pass
            try:
                self.fs.delete_dir(path)
            except FileNotFoundError:
                pass

    def delete_file(self, rel: str) -> None:
        path = self.path(rel)

        def rm() -> None:
            try:
                self.fs.delete_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", rel, rm)

    def _map(self, fn: Callable[[T], None], items: list) -> None:
        """Local copies are disk-bound: run them inline. Remote copies overlap their latency."""
        if self.is_local or len(items) <= 1:
            for item in items:
                fn(item)
            return
        with ThreadPoolExecutor(max_workers=min(8, len(items))) as pool:
            for future in [pool.submit(fn, item) for item in items]:
                future.result()


def _rebuild(uri: str, retry: RetryPolicy, create_container: bool) -> Storage:
    return Storage(uri, retry=retry, create_container=create_container)


def _walk_local(local_dir: str) -> list[tuple[str, int]]:
    if not os.path.isdir(local_dir):
        raise FileNotFoundError(f"upload_dir: {local_dir!r} is not a directory")
    out = []
    for dirpath, _, filenames in os.walk(local_dir):
        for name in filenames:
            full = os.path.join(dirpath, name)
            out.append((os.path.relpath(full, local_dir).replace(os.sep, "/"),
                        os.path.getsize(full)))
    return sorted(out)


def _atomic_local_write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _atomic_local_copy(src: str, dst: str) -> None:
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _copy_stream(open_src: Callable, src: str, dst_fs: pafs.FileSystem, dst: str) -> None:
    with open_src(src) as fin, dst_fs.open_output_stream(dst) as fout:
        while True:
            chunk = fin.read(_CHUNK)
            if not chunk:
                break
            fout.write(chunk)
