"""Sharded training state (FSDP2, DeepSpeed ZeRO) kept in peer memory and re-partitioned
at another world size.

Why this differs from the replicated (DDP) case in ``stripes.py``: under FSDP2 or ZeRO
each rank holds only its own part of the parameters and optimizer state, so no rank can
copy anyone else's part from its own memory, and after a resize the parts no longer line
up with the ranks (3 shards of a weight become 2 of other sizes). So:

* A framework **adapter** describes the rank's state as :class:`Chunk` s: pieces of
  named logical tensors (``"model/w"``, ``"optim/w/exp_avg"``) with their global shape
  and where the piece sits in it. FSDP2 pieces are the DTensors' local shards
  (:class:`FSDP2Adapter`); ZeRO pieces are the flattened fragments a rank owns
  (``sharded_deepspeed.py``). The names do not depend on the world size.
* A snapshot holds the rank's own pieces (old rank ``r``'s pieces are *shard r* of the
  snapshot) and, received over a side gloo group in the background (``peer_exchange.PeerExchange``),
  a copy of another node's shard chosen by ``holdings.plan_stripes``: any single node
  loss leaves every shard on a survivor. That is the same ``(nshards, shards)`` holding
  the controller already plans with, so coverage checks, evacuation before a drain and
  the fallback to storage work unchanged.
* Restoring (:func:`reshard_from_memory`) is a collective over the new group: every rank
  asks for the boxes of its *new* layout (``restore_targets``); for each old shard, its
  lowest holder sends each piece to the ranks whose new boxes overlap it (point to
  point, one old shard in flight at a time), and :func:`fill` copies the overlaps in
  place. Storage restores read the same pieces from per-rank files (memory-mapped: only
  the overlapping bytes are read).

Every check of whether an old layout fits the new one (keys, global shapes, coverage) is
made on metadata all ranks share, before any tensor moves, so all ranks raise together
(``ValueError``, reported as ``checkpoint_invalid``) and none waits on a peer that gave up.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
import torch.distributed as dist

logger = logging.getLogger("raylastic")

ROOT = "sharded"  # key of the sharded part in a snapshot's tensors / plain dicts


@dataclass(frozen=True)
class Chunk:
    """Where one rank's piece of one logical tensor sits in the whole."""

    key: str  # logical tensor name: unique, the same on every rank and at every world size
    global_shape: Tuple[int, ...]
    offsets: Tuple[int, ...]  # start of the piece in each dim
    sizes: Tuple[int, ...]  # shape of the piece
    dtype: str = ""  # e.g. "torch.float32"; "" = unchecked

    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def as_tuple(self) -> tuple:
        return (self.key, self.global_shape, self.offsets, self.sizes, self.dtype)

    @staticmethod
    def of(t: tuple) -> "Chunk":
        key, g, o, s, d = t
        return Chunk(key, tuple(g), tuple(o), tuple(s), d)


Piece = Tuple[Chunk, torch.Tensor]


class ShardedAdapter(Protocol):
    """What ``ElasticState`` needs from a sharding framework."""

    @property
    def model(self) -> Optional[torch.nn.Module]: ...  # the wrapped model (read only)

    def live_chunks(self) -> List[Piece]:
        """This rank's pieces as LIVE tensors (``tensor.shape == chunk.sizes``): the
        caller copies them (maybe in a background thread, over before the next
        ``optimizer.step()``)."""

    def plain(self) -> Dict[str, Any]:
        """The small, picklable rest of the state, identical on every rank."""

    def restore_targets(self) -> List[Piece]:
        """This rank's pieces in the current layout, as tensors filled in place."""

    def finish_restore(self, plain: Dict[str, Any]) -> None:
        """After the targets were filled: load ``plain``; ValueError if it does not fit."""


# -- overlap arithmetic (pure) ---------------------------------------------------------------
def _overlap(a: Chunk, b: Chunk) -> Optional[Tuple[Tuple[slice, ...], Tuple[slice, ...]]]:
    """Slices of ``a``'s piece and of ``b``'s piece covering their common box, or None."""
    sa, sb = [], []
    for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        sa.append(slice(lo - ao, hi - ao))
        sb.append(slice(lo - bo, hi - bo))
    return tuple(sa), tuple(sb)


def _volume(sl: Tuple[slice, ...]) -> int:
    n = 1
    for s in sl:
        n *= s.stop - s.start
    return n


def fill(chunk: Chunk, target: torch.Tensor, pieces: Iterable[Piece]) -> int:
    """Copy into ``target`` (the piece ``chunk`` describes) every overlap with the given
    pieces of the same key; returns the number of elements written (pure: no collectives).
    Scalars (``global_shape == ()``) are one element."""
    written = 0
    with torch.no_grad():
        for c, t in pieces:
            if c.key != chunk.key:
                continue
            if c.global_shape != chunk.global_shape:
                raise ValueError(f"{chunk.key}: saved with global shape {c.global_shape}, "
                                 f"the model has {chunk.global_shape}")
            if chunk.global_shape == ():
                target.copy_(t)
                written += 1
                continue
            ov = _overlap(chunk, c)
            if ov is None:
                continue
            mine, theirs = ov
            target[mine].copy_(t[theirs])
            written += _volume(mine)
    return written


def distinct(pieces: Iterable[Chunk]) -> List[Chunk]:
    """Chunks with duplicates removed (replicated pieces appear once per holder)."""
    seen, out = set(), []
    for c in pieces:
        k = (c.key, c.offsets, c.sizes)
        if k not in seen:
            seen.add(k)
            out.append(c)
    return out


def check_fits(old: Sequence[Chunk], new: Sequence[Chunk]) -> None:
    """Raise ValueError unless the old pieces (all shards of a snapshot or checkpoint)
    cover every new piece exactly: same keys, same global shapes and dtypes."""
    by_key: Dict[str, List[Chunk]] = {}
    for c in distinct(old):
        by_key.setdefault(c.key, []).append(c)
    new_keys = {c.key for c in new}
    missing = sorted(new_keys - set(by_key))
    extra = sorted(set(by_key) - new_keys)
    if missing or extra:
        raise ValueError("the saved sharded state has other tensors than the model and optimizer: "
                         + (f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "")
                         + ("; " if missing and extra else "")
                         + (f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}" if extra else "")
                         + " (another architecture, optimizer or sharding framework?)")
    for c in new:
        olds = by_key[c.key]
        if olds[0].global_shape != c.global_shape:
            raise ValueError(f"{c.key}: saved with global shape {olds[0].global_shape}, "
                             f"the model has {c.global_shape} (another architecture?)")
        if c.dtype and olds[0].dtype and olds[0].dtype != c.dtype:
            raise ValueError(f"{c.key}: saved as {olds[0].dtype}, the model has {c.dtype} "
                             "(a mixed-precision change?)")
        if c.global_shape == ():
            continue
        got = 0
        for o in olds:
            ov = _overlap(c, o)
            if ov is not None:
                got += _volume(ov[0])
        if got != c.numel():
            raise ValueError(f"{c.key}: the saved pieces cover {got} of the {c.numel()} elements "
                             f"this rank needs at {c.offsets} (inconsistent shards)")


def layout_fingerprint(chunks: Sequence[Chunk]) -> str:
    return hashlib.sha1(repr([c.as_tuple() for c in chunks]).encode()).hexdigest()


# -- FSDP2 -------------------------------------------------------------------------------------
def is_dtensor(t: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(t, DTensor)


def uses_dtensors(model: Optional[torch.nn.Module]) -> bool:
    return model is not None and any(is_dtensor(p) for p in model.parameters())


def _dtensor_chunk(key: str, t: Any) -> Piece:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    local = t._local_tensor  # the rank's shard, sharing storage with the parameter
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(f"{key}: local shard shape {tuple(local.shape)} differs from the placement's "
                           f"{tuple(shape)} (padded or strided shards are not supported)")
    return Chunk(key, tuple(t.shape), tuple(offset), tuple(local.shape), str(local.dtype)), local


def _whole_chunk(key: str, t: torch.Tensor) -> Piece:
    return Chunk(key, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), str(t.dtype)), t


def _piece(key: str, t: torch.Tensor) -> Piece:
    return _dtensor_chunk(key, t) if is_dtensor(t) else _whole_chunk(key, t)


class FSDP2Adapter:
    """FSDP2 (``fully_shard``) model + optimizer as chunks.

    Keys are parameter and buffer names (FSDP2 keeps the module's FQNs) and
    ``optim/<param name>/<state name>`` for each tensor of the optimizer's per-parameter
    state that has the parameter's shape. Scalar per-parameter state (Adam's ``step``),
    the param groups' hyper-parameters and non-tensor state are ``plain``: the same on
    every rank."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        self.model = model
        self.optimizer = optimizer
        self._names = {id(p): n for n, p in model.named_parameters()}

    def _optim_items(self) -> Iterable[Tuple[str, str, Any]]:
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                name = self._names.get(id(p))
                if name is None:
                    raise ValueError("the optimizer holds a parameter that is not the model's: register the "
                                     "model the optimizer was built on (ElasticState(model=..., optimizer=...))")
                for k, v in self.optimizer.state.get(p, {}).items():
                    yield name, k, v

    def live_chunks(self) -> List[Piece]:
        out: List[Piece] = [_piece(f"model/{n}", p.detach() if not is_dtensor(p) else p)
                            for n, p in self.model.named_parameters()]
        out += [_whole_chunk(f"buffer/{n}", b) for n, b in self.model.named_buffers()]
        for name, k, v in self._optim_items():
            if isinstance(v, torch.Tensor) and (is_dtensor(v) or v.dim() > 0):
                out.append(_piece(f"optim/{name}/{k}", v))
        return out

    def plain(self) -> Dict[str, Any]:
        scalars: Dict[str, Dict[str, Any]] = {}
        for name, k, v in self._optim_items():
            if isinstance(v, torch.Tensor) and (is_dtensor(v) or v.dim() > 0):
                continue
            scalars.setdefault(name, {})[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups] \
            if self.optimizer is not None else []
        return {"framework": "fsdp2", "optimizer": type(self.optimizer).__name__ if self.optimizer else None,
                "scalars": scalars, "param_groups": groups}

    def restore_targets(self) -> List[Piece]:
        if self.optimizer is not None and not self.optimizer.state:
            # A new optimizer has no moments yet: create them (a zero-gradient step with lr 0,
            # as torch.distributed.checkpoint does) so there are tensors to fill.
            from torch.distributed.checkpoint.state_dict import _init_optim_state
            _init_optim_state(self.optimizer)
        return self.live_chunks()

    def finish_restore(self, plain: Dict[str, Any]) -> None:
        if plain.get("framework") != "fsdp2":
            raise ValueError(f"the snapshot was taken with {plain.get('framework')!r}, not FSDP2")
        if self.optimizer is None:
            return
        if plain.get("optimizer") != type(self.optimizer).__name__:
            raise ValueError(f"the snapshot's optimizer is {plain.get('optimizer')}, this one is "
                             f"{type(self.optimizer).__name__}")
        groups = plain.get("param_groups", [])
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(f"the snapshot has {len(groups)} optimizer param groups, this optimizer "
                             f"{len(self.optimizer.param_groups)}")
        for g, saved in zip(self.optimizer.param_groups, groups):
            g.update(saved)
        scalars = plain.get("scalars", {})
        by_name = {n: p for n, p in self.model.named_parameters()}
        for name, vals in scalars.items():
            st = self.optimizer.state[by_name[name]]
            for k, v in vals.items():
                cur = st.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                    cur.copy_(v)
                else:
                    st[k] = v


def _fill_targets(targets: Sequence[Piece], pieces: Sequence[Piece], counts: List[int]) -> None:
    for i, (c, t) in enumerate(targets):
        counts[i] += fill(c, t, pieces)


def reshard_from_memory(group: Any, targets: Sequence[Piece], layout: Optional[Mapping[int, List[Chunk]]],
                        held: Mapping[int, Sequence[torch.Tensor]], plain: Optional[Dict[str, Any]]
                        ) -> Dict[str, Any]:
    """Collective over ``group``: fill every rank's ``targets`` from the old shards the
    members hold. ``layout``: old shard -> its chunks (None on a rank holding nothing);
    ``held``: old shard -> this rank's host tensors of it. Returns the snapshot's plain
    state (from the lowest holder). Raises ValueError on every rank alike when the old
    state does not fit or the holders do not cover it."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = {"held": sorted(held), "targets": [c.as_tuple() for c, _t in targets],
            "layout": {s: [c.as_tuple() for c in cs] for s, cs in layout.items()} if layout else None,
            "plain": plain if held else None}
    everyone: List[Any] = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    ref = next((e for e in everyone if e["held"]), None)
    problem = None
    if ref is None:
        problem = "no member holds any shard of the snapshot"
    else:
        old = {int(s): [Chunk.of(t) for t in cs] for s, cs in ref["layout"].items()}
        have = set().union(*(set(e["held"]) for e in everyone))
        if not have >= set(old):
            problem = f"the members hold shards {sorted(have)} of {len(old)}: not all of them"
        else:
            try:
                check_fits([c for cs in old.values() for c in cs],
                           [Chunk.of(t) for e in everyone for t in e["targets"]])
            except ValueError as e:
                problem = str(e)
    if problem is not None:
        raise ValueError(problem)
    assert ref is not None  # else problem is set
    holder = {s: min(q for q, e in enumerate(everyone) if s in e["held"]) for s in old}
    wants = [[Chunk.of(t) for t in e["targets"]] for e in everyone]
    counts = [0] * len(targets)
    seen = set()
    for s in sorted(old):
        h = holder[s]
        works, received = [], []
        for j, c in enumerate(old[s]):
            dedupe = (c.key, c.offsets, c.sizes)
            if dedupe in seen:
                continue  # a replicated piece already placed from an earlier shard
            seen.add(dedupe)
            need = [q for q in range(world)
                    if any(w.key == c.key and (w.global_shape == () or _overlap(w, c)) for w in wants[q])]
            if rank == h:
                t = held[s][j]
                if rank in need:
                    _fill_targets(targets, [(c, t)], counts)
                for q in need:
                    if q != rank and c.numel():
                        works.append(dist.isend(t.contiguous(), dst=q, group=group, tag=j))
            elif rank in need:
                buf = torch.empty(c.sizes, dtype=_dtype(c.dtype))
                if c.numel():
                    works.append(dist.irecv(buf, src=h, group=group, tag=j))
                received.append((c, buf))
        for w in works:
            assert w is not None  # None only for a rank outside the group
            w.wait()
        _fill_targets(targets, received, counts)
    short = [(c.key, n, c.numel()) for (c, _t), n in zip(targets, counts) if n < c.numel()]
    if short:  # cannot happen after check_fits; a guard against silent partial loads
        raise RuntimeError(f"rank {rank}: pieces not filled after the re-partition: {short[:3]}")
    return ref["plain"]


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name.replace("torch.", ""), None) if name else torch.float32
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a sharded snapshot")
    return d


def fill_from_files(targets: Sequence[Piece], shard_files: Mapping[int, Any]) -> None:
    """Storage restore: ``shard_files`` old rank -> its loaded file ({"chunks", "tensors"},
    memory-mapped); raises ValueError when they do not fit."""
    old = {s: [Chunk.of(t) for t in f["chunks"]] for s, f in shard_files.items()}
    check_fits([c for cs in old.values() for c in cs], [c for c, _t in targets])
    counts = [0] * len(targets)
    seen = set()
    for s in sorted(old):
        pieces = []
        for c, t in zip(old[s], shard_files[s]["tensors"]):
            k = (c.key, c.offsets, c.sizes)
            if k not in seen:
                seen.add(k)
                pieces.append((c, t))
        _fill_targets(targets, pieces, counts)


__all__ = ["Chunk", "Piece", "ShardedAdapter", "FSDP2Adapter", "fill", "check_fits",
           "distinct", "reshard_from_memory", "fill_from_files", "uses_dtensors",
           "is_dtensor", "layout_fingerprint", "ROOT"]
