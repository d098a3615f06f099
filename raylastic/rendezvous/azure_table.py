"""torchrun rendezvous held in Azure Table Storage (``--rdzv-backend=azure-table``).

The rendezvous state of a run is one entity (PartitionKey ``run-<rdzv-id>``, RowKey ``state``);
its ETag is the fencing token: ``set_state`` is a conditional replace (``If-Match``), a stale token
fails with 412 and the caller gets the current state back, as it does for a token the table never
issued (checked here, or refused by the service with 400). Nothing lives on a node, so losing any
node (rank 0 included) loses nothing: every round re-forms from the table.

The control-plane key/value store that torchelastic also needs (rank assignment, master address,
exit barrier) lives in the same partition (``AzureTableStore``). The workers' process group is
bootstrapped per round by the round's rank 0 (agent store sharing is switched off, see
``create_handler``), so it never points at a node that left.

torch unpickles the state, so every state entity carries an HMAC-SHA256 under the job's key
(``RAYLASTIC_RDZV_HMAC_KEY``) and a row without a valid one is refused before torch sees it
(``_auth``; docs/security.md).

See docs/torchrun_azure.md for the command line, credentials, limits and cleanup.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional

# Import from submodules only: torch loads this module (entry point) while its
# torch.distributed.elastic.rendezvous package is still initialising.
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    Token,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler as _dynamic_handler

from raylastic.rendezvous._auth import StateAuth
from raylastic.rendezvous._endpoint import parse_endpoint, resolve_credential
from raylastic.rendezvous._table import (
    RetrySettings,
    TableOps,
    describe,
    http_status,
    is_entity_tag,
    is_expected,
    pack_chunks,
    partition_key,
    unpack_chunks,
)
from raylastic.rendezvous.azure_store import AzureTableStore

__all__ = [
    "BACKEND_NAME",
    "AzureTableRendezvousBackend",
    "AzureTableSettings",
    "create_backend",
    "create_handler",
    "torchrun_handler",
]

logger = logging.getLogger(__name__)
BACKEND_NAME = "azure-table"
STATE_ROW = "state"
STATE_FORMAT = 1
_SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class AzureTableRendezvousBackend(RendezvousBackend):
    """``RendezvousBackend`` over one Azure Table entity per run, ETag as fencing token.

    ``auth`` authenticates the state (``_auth.StateAuth``); None reads the key from the
    environment (``RAYLASTIC_RDZV_HMAC_KEY``) and raises ValueError without one."""

    def __init__(self, ops: TableOps, run_id: str, auth: Optional[StateAuth] = None) -> None:
        if not run_id:
            raise ValueError("the run id must be a non-empty string: pass --rdzv-id=<run>")
        self._auth = auth if auth is not None else StateAuth.from_env()
        self._ops = ops
        self._run_id = run_id
        self._pk = partition_key(run_id)
        self._what = f"the rendezvous state of run {run_id!r} in {ops.where}"

    @property
    def name(self) -> str:
        return BACKEND_NAME

    def get_state(self) -> Optional[tuple[bytes, Token]]:
        entity = self._ops.get(self._pk, STATE_ROW)
        if entity is None:
            return None
        fmt = entity.get("Format")
        if fmt != STATE_FORMAT:
            raise RendezvousStateError(
                f"{self._what} has format {fmt!r}, expected {STATE_FORMAT}: written by another "
                f"version of raylastic? Use a new --rdzv-id or clean the run up"
            )
        state = unpack_chunks(entity, "s", self._what)
        # torch unpickles what we return: only state written with the job's key gets there.
        self._auth.verify(entity, self._pk, STATE_FORMAT, state, self._what)
        return state, entity.metadata["etag"]

    def set_state(self, state: bytes, token: Optional[Token] = None) -> Optional[tuple[bytes, Token, bool]]:
        """See ``RendezvousBackend.set_state``; the token is the entity's ETag.

        - No token: insert, only if there is no state yet. A falsy token (``""``, ``b""``) means
          the same, as in torch's c10d and etcd backends.
        - A token the table never issued (not a str entity-tag, e.g. ``"invalid"``, or the
          wildcard ``*``) is never sent; one the service refuses as malformed (400) or as stale
          (412) does not match either: the current state comes back with ``False``, or None when
          there is none. Only a failure to reach the service is ``RendezvousConnectionError``.
        """
        entity = {
            "PartitionKey": self._pk,
            "RowKey": STATE_ROW,
            "RunId": self._run_id,
            "Format": STATE_FORMAT,
            **pack_chunks(state, "s", self._what),
            **self._auth.seal(self._pk, STATE_FORMAT, state),
        }
        client = self._ops.client
        if not token:
            return self._write(state, "create_entity", lambda: client.create_entity(entity))
        if not is_entity_tag(token):
            return self._refused(token)
        from azure.core import MatchConditions
        from azure.data.tables import UpdateMode

        return self._write(
            state,
            "update_entity",
            lambda: client.update_entity(
                entity,
                mode=UpdateMode.REPLACE,
                etag=token,
                match_condition=MatchConditions.IfNotModified,
            ),
            token=token,
        )

    def _write(
        self, state: bytes, what: str, request: Callable[[], Mapping[str, Any]], token: Optional[str] = None
    ) -> Optional[tuple[bytes, Token, bool]]:
        """Send ``request``; a 409/412/404 or (with a token) a 400 means it changed nothing."""
        from azure.core.exceptions import HttpResponseError

        attempts = 0

        def send() -> Mapping[str, Any]:
            nonlocal attempts
            attempts += 1
            return request()

        try:
            meta = self._ops.call(
                what, send, expected=lambda exc: is_expected(exc) or (token is not None and http_status(exc) == 400)
            )
        except HttpResponseError as exc:
            if is_expected(exc):  # 409 (exists), 412 (stale token), 404 (no state to replace)
                return self._current(state, retried=attempts > 1)
            return self._refused(token, exc)
        return state, meta["etag"], True

    def _current(self, attempted: bytes, retried: bool) -> Optional[tuple[bytes, Token, bool]]:
        """The stored state after a lost race. Only a retried write can have lost to itself (the
        first attempt landed, its answer did not): then reading back our bytes is a success."""
        current = self.get_state()
        if current is None:
            return None
        state, token = current
        return state, token, retried and state == attempted

    def _refused(self, token: Token, bad_request: Optional[Exception] = None) -> Optional[tuple[bytes, Token, bool]]:
        """The stored state for a token that was never sent, or that the service called malformed
        (``bad_request``, HTTP 400). The server stays the judge: if the 400 came back although
        ``token`` IS the current ETag, the entity itself was refused, and that is an error."""
        current = self.get_state()
        if current is None:
            return None
        if bad_request is not None and current[1] == token:
            raise RendezvousConnectionError(
                f"Azure Table update_entity of {self._what} failed: {describe(bad_request, self._ops.where)}"
            )
        return *current, False


@dataclass(frozen=True)
class AzureTableSettings:
    """``--rdzv-conf`` keys of this backend (torch's own keys are handled by torch)."""

    table: Optional[str] = None
    retry_timeout_s: float = 20.0
    request_timeout_s: float = 10.0
    store_timeout_s: float = 60.0

    @classmethod
    def from_params(cls, params: RendezvousParameters) -> "AzureTableSettings":
        def positive(key: str, default: float) -> float:
            value = params.get_as_int(key, int(default))
            if value is None or value <= 0:
                raise ValueError(f"--rdzv-conf {key}={value} must be a positive number of seconds")
            return float(value)

        return cls(
            table=params.get("table"),
            retry_timeout_s=positive("retry_timeout", cls.retry_timeout_s),
            request_timeout_s=positive("request_timeout", cls.request_timeout_s),
            store_timeout_s=positive("read_timeout", cls.store_timeout_s),
        )


def create_backend(params: RendezvousParameters) -> tuple[AzureTableRendezvousBackend, AzureTableStore]:
    """Backend and control-plane store for ``params``; fails fast on bad endpoint/credentials."""
    settings = AzureTableSettings.from_params(params)
    endpoint = parse_endpoint(params.endpoint, settings.table)
    credential, source = resolve_credential(endpoint)
    retry = RetrySettings(budget_s=settings.retry_timeout_s, request_timeout_s=settings.request_timeout_s)
    ops = TableOps(endpoint, credential, retry)
    logger.info("azure-table rendezvous: run %r in %s (credentials: %s)", params.run_id, ops.where, source)
    ops.ensure_table()
    auth = StateAuth.from_env()  # after the endpoint and credentials: their errors come first
    how = (
        f"authenticated with HMAC-SHA256 (key from {auth.source})"
        if auth.enabled
        else (f"NOT authenticated ({auth.source})")
    )
    logger.info("azure-table rendezvous: state %s", how)
    backend = AzureTableRendezvousBackend(ops, params.run_id, auth)
    store = AzureTableStore(ops, params.run_id, timeout=timedelta(seconds=settings.store_timeout_s))
    return backend, store


def _quiet_azure_http_logging() -> None:
    # azure-core logs every request and its headers at INFO; torchrun agents log at INFO.
    http_logger = logging.getLogger("azure.core.pipeline.policies.http_logging_policy")
    if http_logger.level == logging.NOTSET:
        http_logger.setLevel(logging.WARNING)


def create_handler(params: RendezvousParameters) -> DynamicRendezvousHandler:
    """The ``azure-table`` rendezvous handler for torchrun (``torchrun.handlers`` entry point).

    Agent store sharing is switched off (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, torch's
    documented opt-out, read by the handler and the agent in this process): with sharing on, the
    first round's rank 0 agent hosts a TCPStore that later rounds keep using, so losing that node
    would strand the survivors. With it off, every round's rank 0 publishes a fresh
    MASTER_ADDR/MASTER_PORT in the round's store and its worker hosts the process-group store.
    """
    _quiet_azure_http_logging()
    backend, store = create_backend(params)
    previous = os.environ.get(_SHARE_STORE_ENV)
    if previous not in (None, "1"):
        logger.warning("azure-table rendezvous overrides %s=%s with 1 (see create_handler)", _SHARE_STORE_ENV, previous)
    os.environ[_SHARE_STORE_ENV] = "1"
    return _dynamic_handler(store, backend, params)


def torchrun_handler():
    """Target of the ``torchrun.handlers`` entry point: torch calls it and registers the result."""
    return create_handler
