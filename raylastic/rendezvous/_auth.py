"""Authenticated rendezvous state: torch unpickles what the backend returns, so it returns
only state that an agent holding the job's key wrote.

torch's ``DynamicRendezvousHandler`` pickles its ``_RendezvousState`` and ``pickle.loads`` the
bytes that ``RendezvousBackend.get_state``/``set_state`` hand back. Unpickling runs code, so
anyone who can write the table could otherwise run code on every agent. Each state entity
therefore carries an HMAC-SHA256 (property ``sHmac``) of its partition, format and bytes,
under a key every agent of the job gets from ``RAYLASTIC_RDZV_HMAC_KEY``; a row whose MAC is
missing or wrong is refused with ``RendezvousStateError`` and never reaches torch. The MAC
binds the partition, so a row copied from another run does not verify either.

Without a key the backend refuses to start, unless ``RAYLASTIC_RDZV_INSECURE_NO_HMAC=1`` says
that everyone with write access to the table is trusted to run code on the agents.
See docs/security.md and docs/torchrun_azure.md.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from torch.distributed.elastic.rendezvous.api import RendezvousStateError

logger = logging.getLogger(__name__)

ENV_HMAC_KEY = "RAYLASTIC_RDZV_HMAC_KEY"
ENV_INSECURE = "RAYLASTIC_RDZV_INSECURE_NO_HMAC"
MAC_PROPERTY = "sHmac"
MIN_KEY_CHARS = 32
_DOMAIN = b"raylastic-rdzv-state-v1"
_GENERATE = "python -c 'import secrets; print(secrets.token_hex(32))'"
KEY_HELP = (
    f"set {ENV_HMAC_KEY} to the same secret of at least {MIN_KEY_CHARS} characters on every node "
    f"of the job (generate one with: {_GENERATE}); it authenticates the rendezvous state, which "
    f"torch unpickles, so that someone who can write the table cannot run code on the agents. "
    f"To run without it (only if everyone with write access to the table may run code on every "
    f"node), set {ENV_INSECURE}=1"
)


@dataclass(frozen=True)
class StateAuth:
    """The key that authenticates state entities, or None for the explicit insecure opt-out."""

    key: Optional[bytes] = field(repr=False)
    source: str

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "StateAuth":
        """The key from ``RAYLASTIC_RDZV_HMAC_KEY``; ValueError (naming the fix, never the key)
        when it is missing or short, unless ``RAYLASTIC_RDZV_INSECURE_NO_HMAC=1``."""
        env = os.environ if environ is None else environ
        key = env.get(ENV_HMAC_KEY, "")
        if key:
            if len(key.strip()) < MIN_KEY_CHARS:
                raise ValueError(f"{ENV_HMAC_KEY} is {len(key.strip())} characters, too short to be a key: {KEY_HELP}")
            return cls(key.strip().encode("utf-8"), ENV_HMAC_KEY)
        if env.get(ENV_INSECURE, "").strip() == "1":
            return cls.insecure()
        raise ValueError(f"the azure-table rendezvous needs a state key: {KEY_HELP}")

    @classmethod
    def insecure(cls) -> "StateAuth":
        logger.warning(
            "azure-table rendezvous: %s=1: the rendezvous state is NOT authenticated; anyone who "
            "can write the table can run code on every agent (torch unpickles the state)",
            ENV_INSECURE,
        )
        return cls(None, f"{ENV_INSECURE}=1")

    @property
    def enabled(self) -> bool:
        return self.key is not None

    def mac(self, partition: str, fmt: int, state: bytes) -> str:
        message = b"\0".join([_DOMAIN, partition.encode("utf-8"), str(fmt).encode(), state])
        return hmac.new(self.key or b"", message, hashlib.sha256).hexdigest()

    def seal(self, partition: str, fmt: int, state: bytes) -> dict:
        """Properties to store beside the state (none in insecure mode)."""
        return {MAC_PROPERTY: self.mac(partition, fmt, state)} if self.enabled else {}

    def verify(self, entity: Mapping[str, Any], partition: str, fmt: int, state: bytes, what: str) -> None:
        """Raise RendezvousStateError unless ``entity`` carries the MAC of ``state``."""
        if not self.enabled:
            return
        stored = entity.get(MAC_PROPERTY)
        if not isinstance(stored, str) or not stored:
            problem = (
                f"it has no {MAC_PROPERTY} property (written by an agent without a key, by a "
                f"raylastic release before state authentication, or by someone else)"
            )
        elif not hmac.compare_digest(stored.encode("utf-8", "replace"), self.mac(partition, fmt, state).encode()):
            problem = (
                f"its MAC does not match (written by someone without {ENV_HMAC_KEY}, copied from "
                f"another run, or the nodes were given different keys)"
            )
        else:
            return
        raise RendezvousStateError(
            f"{what} failed authentication: {problem}. It was not handed to torch (which would unpickle "
            f"it). Fix: give every node the same {ENV_HMAC_KEY}; if the row was tampered with, treat the "
            f"table's credentials as compromised, delete the run (`python -m raylastic.rendezvous.cleanup "
            f"--run-id ...`) and use a new --rdzv-id"
        )
