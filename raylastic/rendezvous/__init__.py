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
    except ValueError:
        # Already registered with another callable. Ours under another identity (the entry
        # point, or this module imported twice) is fine; a foreign one would otherwise
        # silently serve --rdzv-backend=azure-table whatever the import order, so refuse.
        current = rendezvous_handler_registry._registry.get(BACKEND_NAME)
        if (
            getattr(current, "__module__", None) != create_handler.__module__
            or getattr(current, "__qualname__", None) != create_handler.__qualname__
        ):
            raise ValueError(
                f"rendezvous backend {BACKEND_NAME!r} is already registered with {current!r}, not "
                "raylastic's: two packages claim the name. Fix: uninstall or unregister the other "
                "one, or launch with a backend name only one of them registers"
            ) from None
