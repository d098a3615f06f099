"""Sharded layouts: chunks (which box of which logical tensor a piece is) and the overlap
arithmetic between an old layout and a new one. Pure: no collectives, no files.

Every check of whether an old layout fits the new one (keys, global shapes, coverage) is
made here on metadata all ranks share, before any tensor moves (see ``__init__``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Protocol, Sequence, Tuple

import torch

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


def overlap(a: Chunk, b: Chunk) -> Optional[Tuple[Tuple[slice, ...], Tuple[slice, ...]]]:
    """Slices of ``a``'s piece and of ``b``'s piece covering their common box, or None."""
    sa, sb = [], []
    for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        sa.append(slice(lo - ao, hi - ao))
        sb.append(slice(lo - bo, hi - bo))
    return tuple(sa), tuple(sb)


def volume(sl: Tuple[slice, ...]) -> int:
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
                raise ValueError(
                    f"{chunk.key}: saved with global shape {c.global_shape}, the model has {chunk.global_shape}"
                )
            if chunk.global_shape == ():
                target.copy_(t)
                written += 1
                continue
            ov = overlap(chunk, c)
            if ov is None:
                continue
            mine, theirs = ov
            target[mine].copy_(t[theirs])
            written += volume(mine)
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
        raise ValueError(
            "the saved sharded state has other tensors than the model and optimizer: "
            + (f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "")
            + ("; " if missing and extra else "")
            + (f"unexpected {extra[:5]}{' ...' if len(extra) > 5 else ''}" if extra else "")
            + " (another architecture, optimizer or sharding framework?)"
        )
    for c in new:
        olds = by_key[c.key]
        if olds[0].global_shape != c.global_shape:
            raise ValueError(
                f"{c.key}: saved with global shape {olds[0].global_shape}, "
                f"the model has {c.global_shape} (another architecture?)"
            )
        if c.dtype and olds[0].dtype and olds[0].dtype != c.dtype:
            raise ValueError(f"{c.key}: saved as {olds[0].dtype}, the model has {c.dtype} (a mixed-precision change?)")
        if c.global_shape == ():
            continue
        got = 0
        for o in olds:
            ov = overlap(c, o)
            if ov is not None:
                got += volume(ov[0])
        if got != c.numel():
            raise ValueError(
                f"{c.key}: the saved pieces cover {got} of the {c.numel()} elements "
                f"this rank needs at {c.offsets} (inconsistent shards)"
            )


def layout_fingerprint(chunks: Sequence[Chunk]) -> str:
    return hashlib.sha1(repr([c.as_tuple() for c in chunks]).encode()).hexdigest()


def hyper_params(group: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer param group's hyper-parameters (all but ``params``), tensors copied: an
    LR scheduler updates a tensor ``lr`` in place, which would otherwise move a snapshot's
    value along with the live one, or the live one along with the snapshot's."""
    return {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in group.items() if k != "params"}


def state_key(key: str, prefix: str) -> Optional[Tuple[str, str]]:
    """(parameter name, state name) of an adapter's ``<prefix>/<param>/<state>`` chunk key;
    None for a key of another kind."""
    if not key.startswith(prefix + "/"):
        return None
    name, _, k = key[len(prefix) + 1 :].rpartition("/")
    return name, k


def saved_scalar(v: torch.Tensor, group: Dict[str, Any], device: torch.device) -> torch.Tensor:
    """A copy of a saved per-parameter scalar (Adam's ``step``; the optimizer steps it in
    place), on ``device`` where the group steps there (``capturable``/``fused``), else
    where it was saved, as a torch optimizer places it."""
    return v.detach().clone().to(device if group.get("capturable") or group.get("fused") else v.device)


def dtype_of(name: str) -> torch.dtype:
    d = getattr(torch, name.replace("torch.", ""), None) if name else torch.float32
    if not isinstance(d, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a sharded snapshot")
    return d


def meta(c: Chunk) -> torch.Tensor:
    """A placeholder for a piece this rank does not hold: shape and dtype, no memory."""
    return torch.empty(c.sizes, dtype=dtype_of(c.dtype), device="meta")


__all__ = [
    "Chunk",
    "Piece",
    "ShardedAdapter",
    "fill",
    "check_fits",
    "distinct",
    "layout_fingerprint",
    "dtype_of",
    "hyper_params",
    "state_key",
    "saved_scalar",
    "meta",
    "ROOT",
]
