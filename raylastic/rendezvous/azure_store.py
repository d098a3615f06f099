"""A ``torch.distributed.Store`` in Azure Table Storage: torchelastic's control-plane store.

torchrun's agents use this store (always through a per-round ``PrefixStore``) to assign worker
ranks, to publish the round's MASTER_ADDR/MASTER_PORT and for the exit barrier. Keeping it in the
table instead of a TCPStore on some agent means no node is special. Each key is one entity in the
run's partition (RowKey ``kv-<base64url(key)>``); values use the same 64 KiB chunking as the
rendezvous state. Blocking reads poll with backoff (10 ms up to 250 ms) until the store timeout.
Not a data-plane store: the workers' process group uses its own TCPStore on the round's rank 0.
"""

from __future__ import annotations

import base64
import hashlib
import random
import time
import uuid
from datetime import timedelta
from typing import Optional, Union

import torch.distributed as dist

from raylastic.rendezvous._table import TableOps, pack_chunks, partition_key, unpack_chunks

__all__ = ["AzureTableStore"]

_FIRST_POLL_S = 0.01
_MAX_POLL_S = 0.25
_MAX_RAW_KEY = 600  # longer keys are hashed: a RowKey holds at most 1 KiB

Bytesish = Union[str, bytes]


def _as_bytes(value: Bytesish) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class AzureTableStore(dist.Store):
    """Key/value ``Store`` for one run, over ``TableOps`` (bounded retries, mapped errors)."""

    def __init__(self, ops: TableOps, run_id: str, timeout: timedelta = timedelta(seconds=60)) -> None:
        super().__init__()  # required by the pybind trampoline
        self.set_timeout(timeout)
        self._ops = ops
        self._pk = partition_key(run_id)
        self._run_id = run_id

    # -- encoding -----------------------------------------------------------------------------
    @staticmethod
    def _row_key(key: Bytesish) -> str:
        raw = _as_bytes(key)
        if len(raw) > _MAX_RAW_KEY:
            return "kvh-" + hashlib.sha256(raw).hexdigest()
        return "kv-" + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def _entity(self, key: Bytesish, value: bytes, writer: str) -> dict:
        return {
            "PartitionKey": self._pk,
            "RowKey": self._row_key(key),
            "Key": _as_bytes(key)[:256].decode(errors="replace"),  # for humans browsing the table
            "Writer": writer,
            **pack_chunks(value, "v", f"store key {key!r} of run {self._run_id!r}"),
        }

    def _read(self, key: Bytesish) -> Optional[tuple[bytes, str, str]]:
        """``(value, etag, writer)`` or None when the key is absent."""
        entity = self._ops.get(self._pk, self._row_key(key))
        if entity is None:
            return None
        value = unpack_chunks(entity, "v", f"store key {key!r} of run {self._run_id!r}")
        return value, entity.metadata["etag"], str(entity.get("Writer", ""))

    def _create(self, key: Bytesish, value: bytes, writer: str) -> bool:
        """Insert; False when the key already exists (written by someone else)."""
        from azure.core.exceptions import ResourceExistsError

        try:
            self._ops.call("store create", lambda: self._ops.client.create_entity(self._entity(key, value, writer)))
            return True
        except ResourceExistsError:
            return False

    def _replace(self, key: Bytesish, value: bytes, writer: str, etag: str) -> bool:
        """Conditional replace; False when the ETag is stale or the key vanished."""
        from azure.core import MatchConditions
        from azure.core.exceptions import ResourceModifiedError, ResourceNotFoundError
        from azure.data.tables import UpdateMode

        try:
            self._ops.call(
                "store update",
                lambda: self._ops.client.update_entity(
                    self._entity(key, value, writer),
                    mode=UpdateMode.REPLACE,
                    etag=etag,
                    match_condition=MatchConditions.IfNotModified,
                ),
            )
            return True
        except (ResourceModifiedError, ResourceNotFoundError):
            return False

    def _poll(self, keys: list, timeout: timedelta) -> dict:
        """Values of all ``keys``, polling until present; ``DistStoreError`` after ``timeout``."""
        deadline = time.monotonic() + timeout.total_seconds()
        found: dict = {}
        delay = _FIRST_POLL_S
        while True:
            for key in keys:
                if key not in found:
                    hit = self._read(key)
                    if hit is None:
                        break
                    found[key] = hit[0]
            if len(found) == len(keys):
                return found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [k for k in keys if k not in found]
                raise dist.DistStoreError(
                    f"timeout after {timeout.total_seconds():.0f}s waiting for key(s) {missing} in the "
                    f"azure-table store of run {self._run_id!r}; another agent may have died before "
                    f"writing them (raise --rdzv-conf read_timeout=... if agents are just slow)"
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 1.5, _MAX_POLL_S)

    # -- Store API ----------------------------------------------------------------------------
    def set(self, key: Bytesish, value: Bytesish) -> None:
        from azure.data.tables import UpdateMode

        entity = self._entity(key, _as_bytes(value), uuid.uuid4().hex)
        self._ops.call("store set", lambda: self._ops.client.upsert_entity(entity, mode=UpdateMode.REPLACE))

    def get(self, key: Bytesish) -> bytes:
        # Store.timeout: not in torch's .pyi
        return self._poll([key], self.timeout)[key]  # type: ignore[attr-defined]

    def wait(self, keys, override_timeout: Optional[timedelta] = None) -> None:
        # Store.timeout: as in get()
        timeout = self.timeout if override_timeout is None else override_timeout  # type: ignore[attr-defined]
        self._poll(list(keys), timeout)

    def check(self, keys) -> bool:
        return all(self._read(key) is not None for key in keys)

    def add(self, key: Bytesish, amount: int) -> int:
        """Atomic increment (CAS loop). A per-call writer id makes a retried write that did land
        count once."""
        writer = uuid.uuid4().hex
        while True:
            current = self._read(key)
            if current is None:
                if self._create(key, str(amount).encode(), writer):
                    return amount
            else:
                value, etag, last_writer = current
                if last_writer == writer:  # our earlier attempt landed; its response was lost
                    return int(value)
                new = int(value) + amount
                if self._replace(key, str(new).encode(), writer, etag):
                    return new
            time.sleep(random.uniform(0, 0.02))

    def compare_set(self, key: Bytesish, expected: Bytesish, desired: Bytesish) -> bytes:
        """TCPStore semantics: set ``desired`` if the value is ``expected`` (or absent and
        ``expected`` is empty); return the value now stored (``expected`` if absent)."""
        expected_b, desired_b = _as_bytes(expected), _as_bytes(desired)
        writer = uuid.uuid4().hex
        while True:
            current = self._read(key)
            if current is None:
                if expected_b:
                    return expected_b
                if self._create(key, desired_b, writer):
                    return desired_b
                continue
            value, etag, last_writer = current
            if last_writer == writer:
                return value
            if value != expected_b:
                return value
            if self._replace(key, desired_b, writer, etag):
                return desired_b

    def delete_key(self, key: Bytesish) -> bool:
        if self._read(key) is None:
            return False
        rk = self._row_key(key)
        self._ops.call("store delete", lambda: self._ops.client.delete_entity(self._pk, rk))
        return True

    def num_keys(self) -> int:
        def count() -> int:
            rows = self._ops.client.query_entities(
                "PartitionKey eq @pk and RowKey ge @lo and RowKey lt @hi",
                parameters={"pk": self._pk, "lo": "kv", "hi": "kw"},
                select=["RowKey"],
            )
            return sum(1 for _ in rows)

        return self._ops.call("store num_keys", count)
