"""Striped snapshot replication: each rank copies only its share of the replicated state.

Why: under DDP every rank holds the same model and optimizer state, so W full snapshots
per step are W-1 copies too many; the copy costs memory bandwidth every step and host
memory. Surviving the loss of any one node needs every byte on two nodes, not on W.
So (as Gemini, SOSP'23, places checkpoint replicas) the state's tensors are split into
W shards of about equal bytes; rank r copies shard r and one other rank's shard, chosen
on another node (``plan_stripes``). Each rank then copies about 2/W of the state per
step and holds 2/W of it per snapshot: 2/3 with 3 workers, 1/4 with 8 (with the same
number of workers on every node; uneven nodes load some ranks more, see ``plan_stripes``).

Restoring (``assemble``): the members of the new group tell each other which shards of
the chosen snapshot they hold, and every tensor some member lacks is broadcast from the
lowest rank that holds it. Workers that joined hold nothing and receive everything;
this also replaces the pickled whole-snapshot broadcast. Losing a node *and* the node
holding its shard's second copy leaves a shard uncovered: the controller then restores
from storage (``covered`` decides).

Tensors a rank does not hold are kept in the snapshot as ``meta`` tensors (shape and
dtype, no memory), so every rank's snapshot has the full structure.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from raylastic._internal.holdings import HOLDS_NONE, WHOLE, Holding, covered, is_whole, plan_stripes


def shard_of_leaves(sizes: Sequence[int], nshards: int) -> List[int]:
    """Shard id of each tensor (by its bytes): largest first onto the lightest shard.
    Deterministic in ``sizes``, so every rank computes the same split."""
    return list(_shard_of_leaves(tuple(sizes), nshards))


@functools.lru_cache(maxsize=16)  # the same split every commit: not worth recomputing
def _shard_of_leaves(sizes: Tuple[int, ...], nshards: int) -> Tuple[int, ...]:
    load = [0] * nshards
    out = [0] * len(sizes)
    for j in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        s = min(range(nshards), key=lambda k: (load[k], k))
        out[j] = s
        load[s] += sizes[j]
    return tuple(out)


def leaves(obj: Any) -> List[torch.Tensor]:
    """The tensors of a state-dict-like tree, in traversal order."""
    out: List[torch.Tensor] = []

    def walk(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            out.append(o)
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return out


def map_leaves(obj: Any, fn: Callable[[int, torch.Tensor], Any]) -> Any:
    """A copy of the tree with the j-th tensor replaced by ``fn(j, tensor)``."""
    counter = [0]

    def walk(o: Any) -> Any:
        if isinstance(o, torch.Tensor):
            j = counter[0]
            counter[0] += 1
            return fn(j, o)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(walk(v) for v in o)
        return o

    return walk(obj)


def held_leaves(tree: Any) -> Dict[int, torch.Tensor]:
    """The tensors a (striped) copy really holds, by leaf position."""
    return {j: t for j, t in enumerate(leaves(tree)) if not t.is_meta}


def leaf_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def keep_mask(tree: Any, holding: Holding) -> Optional[List[bool]]:
    """Per tensor of ``tree``: does a rank with ``holding`` copy it? None: all."""
    if is_whole(holding):
        return None
    nshards, shards = holding
    mine = frozenset(shards)
    return [s in mine for s in _shard_of_leaves(tuple(leaf_bytes(t) for t in leaves(tree)), nshards)]


def to_meta(tree: Any) -> Any:
    return map_leaves(tree, lambda _j, t: torch.empty(t.shape, dtype=t.dtype, device="meta"))


def assemble(index: int, tensors: Optional[Any], plain: Optional[Dict[str, Any]],
             holding: Optional[Holding]) -> Tuple[Any, Dict[str, Any]]:
    """Collective over the default process group: every rank ends with all tensors of
    snapshot ``index``. ``tensors``/``plain``: this rank's copy (None when it holds
    none); ``holding``: which shards it holds (``WHOLE`` for a full copy). Returns
    (full tensors, plain state)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = holding if tensors is not None else HOLDS_NONE
    # Every check below is made on the same gathered facts by every rank, so all raise
    # together (none is left waiting in a broadcast for a rank that gave up).
    everyone: List[Any] = [None] * world  # per rank: [what it holds, its tree's fingerprint]
    dist.all_gather_object(everyone, [mine, fingerprint(tensors) if tensors is not None else None])
    holdings: List[Optional[Holding]] = [h for h, _fp in everyone]
    problem = None
    if len({fp for h, fp in everyone if h is not HOLDS_NONE}) > 1:
        problem = "the ranks' copies differ in tensor shapes or dtypes (not copies of one replicated state)"
    elif not covered(holdings):
        problem = f"the ranks' shards {holdings} do not cover the state"
    if problem is not None:
        dist.barrier()  # no rank tears the group down while another still reads the gather
        raise RuntimeError(f"snapshot {index}: {problem}")
    ref = min(r for r, h in enumerate(holdings) if h is not HOLDS_NONE)
    box: List[Any] = [{"plain": plain, "skeleton": to_meta(tensors)} if rank == ref else None]
    dist.broadcast_object_list(box, src=ref)
    skeleton = box[0]["skeleton"]
    masks = [None if h is HOLDS_NONE else (keep_mask(skeleton, h) or [True] * len(leaves(skeleton)))
             for h in holdings]
    own = leaves(tensors) if tensors is not None else None
    device = _collective_device()

    def fill(j: int, meta: torch.Tensor) -> torch.Tensor:
        holders = [r for r, m in enumerate(masks) if m is not None and m[j]]
        mine = masks[rank]
        if mine is not None and mine[j]:
            assert own is not None  # a rank that holds leaf j has its tensors
            if len(holders) == world:
                return own[j]
            return _broadcast(own[j], meta, holders[0], device)
        return _broadcast(None, meta, holders[0], device)

    full = map_leaves(skeleton, fill)
    return full, (plain if plain is not None else box[0]["plain"])


def _collective_device() -> torch.device:
    """NCCL moves only CUDA tensors; gloo moves CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _broadcast(t: Optional[torch.Tensor], meta: torch.Tensor, src: int, device: torch.device) -> torch.Tensor:
    """Send ``t`` (the source) or receive into a new host tensor shaped like ``meta``."""
    if device.type == "cpu":
        t = t if t is not None else torch.empty(meta.shape, dtype=meta.dtype)
        dist.broadcast(t, src=src)
        return t
    staged = t.to(device) if t is not None else torch.empty(meta.shape, dtype=meta.dtype, device=device)
    dist.broadcast(staged, src=src)
    return t if t is not None else staged.cpu()


def fingerprint(tree: Any) -> str:
    """Shapes and dtypes of a tree's tensors, in order (equal on every rank for copies of
    one replicated state)."""
    spec = repr([(tuple(t.shape), str(t.dtype)) for t in leaves(tree)])
    return hashlib.sha1(spec.encode()).hexdigest()


__all__ = ["Holding", "WHOLE", "plan_stripes", "shard_of_leaves", "leaves", "map_leaves", "held_leaves", "keep_mask",
           "covered", "to_meta", "assemble"]
