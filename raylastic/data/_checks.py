"""Construction-time validation of ``ElasticDataLoader`` arguments.

Every check raises ``ValueError`` naming the argument, its value and the fix, before any
worker process or data is touched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import IterableDataset

from raylastic.data.policy import BatchPolicy

# DataLoader arguments the elastic loader owns; passing them in dataloader_kwargs is an error.
OWNED_KWARGS = frozenset(
    {"dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "drop_last", "num_workers", "collate_fn"}
)


def dataset_length(dataset: Any) -> int:
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            "dataset is an IterableDataset: ElasticDataLoader needs a map-style dataset "
            "(__getitem__ and __len__) to place every sample exactly once per epoch"
        )
    try:
        n = len(dataset)
    except TypeError:
        raise ValueError(
            f"dataset ({type(dataset).__name__}) has no __len__: ElasticDataLoader needs a "
            "map-style dataset; wrap it in one that defines __len__ and __getitem__"
        ) from None
    if n <= 0:
        raise ValueError(f"dataset is empty (len(dataset) == {n}); pass a non-empty dataset")
    return n


def check_batch_sizes(
    policy: BatchPolicy, global_batch_size: int | None, micro_batch_size: int | None
) -> tuple[int | None, int]:
    if micro_batch_size is not None:
        check_int("micro_batch_size", micro_batch_size, minimum=1)
    if policy is BatchPolicy.DYNAMIC:
        if global_batch_size is not None:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be None under the dynamic "
                "policy: the global batch is micro_batch_size * world_size; drop it or use "
                "batch_policy='fixed'"
            )
        if micro_batch_size is None:
            raise ValueError("micro_batch_size is required under the dynamic policy")
        return None, micro_batch_size
    if global_batch_size is None:
        raise ValueError("global_batch_size is required under the fixed policy")
    check_int("global_batch_size", global_batch_size, minimum=1)
    return global_batch_size, micro_batch_size or global_batch_size


def check_explicit_world(world_size: int | None, rank: int | None) -> tuple[int, int] | None:
    if world_size is None and rank is None:
        return None
    if world_size is None or rank is None:
        raise ValueError(
            f"pass both world_size and rank or neither (got world_size={world_size!r}, "
            f"rank={rank!r}); with neither they come from torch.distributed"
        )
    check_int("world_size", world_size, minimum=1)
    check_int("rank", rank, minimum=0)
    if rank >= world_size:
        raise ValueError(f"rank ({rank}) must be < world_size ({world_size})")
    return world_size, rank


def check_dataloader_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    kwargs = dict(kwargs or {})
    owned = sorted(OWNED_KWARGS & set(kwargs))
    if owned:
        raise ValueError(
            f"dataloader_kwargs may not set {owned}: ElasticDataLoader controls them; use its "
            "own arguments (global_batch_size, micro_batch_size, shuffle, num_workers, collate_fn)"
        )
    return kwargs


def check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        bound = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} ({value!r}) must be {bound}")
