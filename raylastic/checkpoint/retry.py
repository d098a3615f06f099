"""Storage errors and what to do about them: retry a transient one with bounded,
jittered backoff; fail at once on a permanent one, naming the cause, never the secret.

Shared by every storage backend (``backends.py``) and the ``Storage`` seam
(``storage.py``), which re-exports these names.
"""

from __future__ import annotations

import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Callable, Literal, TypeVar

logger = logging.getLogger("raylastic.checkpoint.storage")
T = TypeVar("T")
ErrorKind = Literal["transient", "permanent"]


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
    "ServiceRequestError",
    "ServiceResponseError",
    "ServiceRequestTimeoutError",
    "ServiceResponseTimeoutError",
    "ClientConnectorError",
    "ServerDisconnectedError",
    "ClientOSError",
    "ServerTimeoutError",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "IncompleteReadError",
}
_PERMANENT_TYPE_NAMES = {
    "ClientAuthenticationError",
    "CredentialUnavailableError",
    "NoCredentialsError",
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
    r"((?:sig|AccountKey|SharedAccessSignature|secret_key|session_token|access_key|account_key"
    r"|sas_token|connection_string|credential|client_secret|access_token|token|password"
    r"|X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token)=)[^&;\s'\"]+",
    re.IGNORECASE,
)
# user:secret@ in any URL (a scheme we do not support, an endpoint, an SDK message)
_USERINFO_IN_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s'\"]*@")


def _redact(text: str, secrets: tuple[str, ...]) -> str:
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, "***")
    return _USERINFO_IN_URL.sub(r"\1***@", _SECRET_IN_TEXT.sub(r"\1***", text))


def retry_call(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    what: str = "storage call",
    secrets: tuple[str, ...] = (),
    sleep: Callable[[float], None] = time.sleep,
    rand: Callable[[], float] = random.random,
) -> T:
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
                logger.warning(
                    "%s: attempt %d/%d failed, retrying in %.2fs: %s",
                    what,
                    attempt,
                    policy.max_attempts,
                    delay,
                    _summarise(exc, secrets, 200),
                )
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
