"""Rendezvous backends for torchrun that survive the loss of any node.

``--rdzv-backend=azure-table`` keeps torchelastic's rendezvous state and control-plane store in
Azure Table Storage (see ``azure_table`` and docs/torchrun_azure.md). torchrun finds it through the
``torchrun.handlers`` entry point; ``register()`` does the same by hand (e.g. in a launcher that
builds its own ``LaunchConfig``).
"""

from raylastic.rendezvous.azure_store import AzureTableStore
from raylastic.rendezvous.azure_table import (
    BACKEND_NAME,
    AzureTableRendezvousBackend,
    AzureTableSettings,
    create_backend,
    create_handler,
)

__all__ = [
    "BACKEND_NAME",
    "AzureTableRendezvousBackend",
    "AzureTableSettings",
    "AzureTableStore",
    "create_backend",
    "create_handler",
    "register",
]


def register() -> None:
    """Register ``azure-table`` with torch's handler registry (idempotent)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    try:
        rendezvous_handler_registry.register(BACKEND_NAME, create_handler)
    except ValueError:  # already registered (e.g. by the entry point) with a different callable
        pass
