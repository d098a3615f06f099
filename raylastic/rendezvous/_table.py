"""Azure Table plumbing shared by the rendezvous backend, the store and the cleanup command.

- ``TableOps``: one ``TableClient`` with bounded retries; Azure exceptions become
  ``RendezvousConnectionError`` (cause and fix in the message, secrets redacted).
- ``is_entity_tag``: whether a fencing token can be an ETag the service issued.
- ``pack_chunks`` / ``unpack_chunks``: a byte string spread over 64 KiB binary properties.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, TypeVar

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousStateError

from raylastic.rendezvous._endpoint import CREDENTIAL_HELP, TableEndpoint

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Azure Tables: a binary property holds at most 64 KiB, an entity at most 1 MiB (keys and names
# included), so 15 full chunks (960 KiB) leave room for the bookkeeping properties.
CHUNK_BYTES = 64 * 1024
MAX_CHUNKS = 15
_TRANSIENT_STATUS = frozenset({408, 429, 500, 502, 503, 504})

# -- errors --------------------------------------------------------------------------------------
_SECRET_RES = (
    re.compile(r"(?i)(sig=)[^&\s'\"]+"),
    re.compile(r"(?i)(accountkey=)[^;\s'\"]+"),
    re.compile(r"(?i)(sharedaccesssignature=)[^;\s'\"]+"),
)


def redact(text: str) -> str:
    """Remove SAS signatures and account keys from an error message."""
    for pattern in _SECRET_RES:
        text = pattern.sub(r"\1<redacted>", text)
    return text


def http_status(exc: BaseException) -> Optional[int]:
    return getattr(exc, "status_code", None)


def is_expected(exc: BaseException) -> bool:
    """409, 404 and 412: outcomes of a conditional request, not failures of the service."""
    from azure.core.exceptions import ResourceExistsError, ResourceModifiedError, ResourceNotFoundError

    return isinstance(exc, (ResourceExistsError, ResourceModifiedError, ResourceNotFoundError))


def is_transient(exc: BaseException) -> bool:
    from azure.core.exceptions import HttpResponseError, ServiceRequestError, ServiceResponseError

    if isinstance(exc, (ServiceRequestError, ServiceResponseError)):
        return True
    return isinstance(exc, HttpResponseError) and http_status(exc) in _TRANSIENT_STATUS


def _dns_error(exc: BaseException) -> bool:
    msg = str(exc)
    return "Failed to resolve" in msg or "Name or service not known" in msg or "nodename nor servname" in msg


def _hint(exc: BaseException, where: str) -> str:
    msg = str(exc)
    status = http_status(exc)
    if _dns_error(exc):
        return f"cannot resolve the host of {where}: check the storage account name in --rdzv-endpoint"
    if "Connection refused" in msg or "Failed to establish" in msg:
        return f"nothing answers at {where}: check the endpoint (and that the emulator is running)"
    if status in (401, 403) or type(exc).__name__ == "ClientAuthenticationError":
        return f"{where} rejected the credentials: {CREDENTIAL_HELP}"
    if status == 404:
        return f"{where} does not exist: check the account name in --rdzv-endpoint"
    return f"request to {where} failed" + (f" with HTTP {status}" if status else "")


def table_missing(exc: BaseException) -> bool:
    code = str(getattr(exc, "error_code", "") or "")
    return "TableNotFound" in code or "TABLE_NOT_FOUND" in code


def describe(exc: BaseException, where: str) -> str:
    first = redact(str(exc)).strip().splitlines()
    return f"{_hint(exc, where)} ({type(exc).__name__}: {first[0] if first else ''})"


# -- the client ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RetrySettings:
    """Bounded retries for transient errors: exponential backoff with jitter, up to ``budget_s``."""

    budget_s: float = 20.0
    first_backoff_s: float = 0.05
    max_backoff_s: float = 2.0
    request_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("budget_s", "first_backoff_s", "max_backoff_s", "request_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be > 0")


class TableOps:
    """A ``TableClient`` whose calls retry transient errors and raise rendezvous errors."""

    def __init__(self, endpoint: TableEndpoint, credential, retry: RetrySettings = RetrySettings()) -> None:
        from azure.data.tables import TableClient

        self.endpoint = endpoint
        self.retry = retry
        self.where = f"{endpoint.account_url}/{endpoint.table}"
        # The SDK's own retry policy would sleep up to minutes; ours is bounded (retry_total=0).
        self.client = TableClient(
            endpoint=endpoint.account_url,
            table_name=endpoint.table,
            credential=credential,
            retry_total=0,
            connection_timeout=min(retry.request_timeout_s, 5.0),
            read_timeout=retry.request_timeout_s,
        )

    def call(
        self,
        what: str,
        fn: Callable[[], T],
        *,
        budget_s: Optional[float] = None,
        retryable: Callable[[BaseException], bool] = is_transient,
        expected: Callable[[BaseException], bool] = is_expected,
    ) -> T:
        """Run ``fn``; retry ``retryable`` errors until the budget is spent; map the rest.

        ``expected`` outcomes (by default 409, 404, 412) are raised unchanged for the caller to
        interpret.
        """
        budget = self.retry.budget_s if budget_s is None else budget_s
        deadline = time.monotonic() + budget
        backoff = self.retry.first_backoff_s
        attempt = 0
        while True:
            attempt += 1
            try:
                return fn()
            except Exception as exc:  # noqa: BLE001 - classified below
                if expected(exc):
                    raise
                if not retryable(exc):
                    raise RendezvousConnectionError(f"Azure Table {what} failed: {describe(exc, self.where)}") from None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RendezvousConnectionError(
                        f"Azure Table {what} failed after {attempt} attempts in {budget:.0f}s: "
                        f"{describe(exc, self.where)}; raise --rdzv-conf retry_timeout=... to wait "
                        f"longer for transient errors"
                    ) from None
                sleep = min(backoff * random.uniform(0.5, 1.5), remaining)
                logger.warning(
                    "Azure Table %s: transient %s (attempt %d), retrying in %.2fs",
                    what,
                    type(exc).__name__,
                    attempt,
                    sleep,
                )
                time.sleep(sleep)
                backoff = min(backoff * 2, self.retry.max_backoff_s)

    def ensure_table(self, budget_s: Optional[float] = None) -> None:
        """Create the table if missing; proves the endpoint and credentials work.

        An unknown host fails at once here (a mistyped account name never resolves); later, during
        training, the same error is retried like any other connection error.
        """
        from azure.core.exceptions import HttpResponseError, ResourceExistsError, ResourceNotFoundError

        def create() -> None:
            try:
                self.client.create_table()
            except ResourceExistsError:
                pass
            except HttpResponseError as exc:
                if http_status(exc) != 403:
                    raise
                # A SAS scoped to one table may not create tables: fine if the table exists.
                # Reading a row that is never written tells "table there" (entity 404) apart.
                try:
                    self.client.get_entity("__probe__", "__probe__")
                except ResourceNotFoundError as missing:
                    if table_missing(missing):
                        raise exc from None
                    return

        self.call("create_table", create, budget_s=budget_s, retryable=lambda e: is_transient(e) and not _dns_error(e))

    def get(self, pk: str, rk: str):
        """The entity or None."""
        from azure.core.exceptions import ResourceNotFoundError

        try:
            return self.call("get_entity", lambda: self.client.get_entity(pk, rk))
        except ResourceNotFoundError as exc:
            if table_missing(exc):
                raise RendezvousConnectionError(
                    f"table {self.where} was deleted while in use; restart the rendezvous"
                ) from None
            return None

    def close(self) -> None:
        self.client.close()


# -- fencing tokens ------------------------------------------------------------------------------
# RFC 9110 entity-tag: optional weak prefix, then printable ASCII other than '"' between quotes. The
# Table service issues weak ones (W/"datetime'...'"); which well-formed tags match stays its call.
_ENTITY_TAG = re.compile(r'(W/)?"[\x21\x23-\x7e]*"')


def is_entity_tag(token: object) -> bool:
    """Whether ``token`` may be sent as ``If-Match``: a str entity-tag (so never ``*``, which
    matches any entity, never empty, never a header-breaking or non-ASCII string)."""
    return isinstance(token, str) and _ENTITY_TAG.fullmatch(token) is not None


# -- chunked values ------------------------------------------------------------------------------
def pack_chunks(data: bytes, prefix: str, what: str) -> dict:
    """Spread ``data`` over properties ``<prefix>00..`` plus length/count/sha256 bookkeeping."""
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    if len(chunks) > MAX_CHUNKS:
        raise RendezvousStateError(
            f"{what} is {len(data)} bytes; one Azure Table entity holds at most "
            f"{MAX_CHUNKS * CHUNK_BYTES} bytes ({MAX_CHUNKS} x 64 KiB properties). Lower --nnodes "
            f"MAX or use --rdzv-backend=c10d for very large jobs"
        )
    props: dict[str, Any] = {f"{prefix}{i:02d}": chunk for i, chunk in enumerate(chunks)}
    props[f"{prefix}Chunks"] = len(chunks)
    props[f"{prefix}Length"] = len(data)
    props[f"{prefix}Sha256"] = hashlib.sha256(data).hexdigest()
    return props


def unpack_chunks(entity: Mapping[str, Any], prefix: str, what: str) -> bytes:
    """Inverse of ``pack_chunks``; any inconsistency is ``RendezvousStateError``."""
    try:
        count = int(entity[f"{prefix}Chunks"])
        length = int(entity[f"{prefix}Length"])
        digest = str(entity[f"{prefix}Sha256"])
        parts = [entity[f"{prefix}{i:02d}"] for i in range(count)]
        data = b"".join(bytes(p) for p in parts)
    except (KeyError, TypeError, ValueError) as exc:
        raise RendezvousStateError(
            f"{what} is corrupt ({type(exc).__name__}: {exc}); delete the entity (see "
            f"`python -m raylastic.rendezvous.cleanup --help`) or use a new --rdzv-id"
        ) from None
    if len(data) != length or hashlib.sha256(data).hexdigest() != digest:
        raise RendezvousStateError(
            f"{what} is corrupt (length or sha256 mismatch); delete the entity (see "
            f"`python -m raylastic.rendezvous.cleanup --help`) or use a new --rdzv-id"
        )
    return data


def partition_key(run_id: str) -> str:
    """A PartitionKey for ``run_id``: the id itself when its characters are safe, else a hash."""
    if re.match(r"^[A-Za-z0-9._:@=+-]{1,200}$", run_id):
        return f"run-{run_id}"
    return "runh-" + hashlib.sha256(run_id.encode()).hexdigest()[:40]
