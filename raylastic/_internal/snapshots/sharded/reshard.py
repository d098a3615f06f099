"""Re-partitioning sharded state: filling this rank's pieces in the new layout from the old
shards, in memory over the group (:func:`reshard_from_memory`) or from the shard files of
a persisted checkpoint (:func:`fill_from_files`). See ``sharded/__init__`` for why.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from raylastic._internal.snapshots.sharded.layout import Chunk, Piece, check_fits, dtype_of, fill, overlap
from raylastic._internal.snapshots.transport import Transport


def _by_key(chunks: Sequence[Chunk]) -> Dict[str, List[int]]:
    """The indices of ``chunks``, by tensor."""
    out: Dict[str, List[int]] = {}
    for i, c in enumerate(chunks):
        out.setdefault(c.key, []).append(i)
    return out


def _fill_targets(
    targets: Sequence[Piece], index: Dict[str, List[int]], pieces: Sequence[Piece], counts: List[int]
) -> None:
    """Copy the overlaps of ``pieces`` into ``targets`` (``index``: :func:`_by_key`),
    counting the elements written per target; a piece is compared with the targets of its
    own tensor only (a model of thousands of tensors must not pay pieces x targets)."""
    for piece in pieces:
        for i in index.get(piece[0].key, ()):
            c, t = targets[i]
            counts[i] += fill(c, t, [piece])


def _box(c: Chunk, wanted: Sequence[Chunk]) -> Optional[Tuple[slice, ...]]:
    """The smallest box of old piece ``c`` that holds its every overlap with ``wanted``
    (one rank's pieces of the same tensor in the new layout); None when none overlaps.
    What moves is this box, not the whole piece: a rank growing from 2 to 3 pieces of a
    tensor needs a third of it, and the old pieces it overlaps hold two thirds."""
    if wanted and c.global_shape == ():
        return ()
    lo: List[int] = []
    hi: List[int] = []
    for w in wanted:
        ov = overlap(c, w)
        if ov is None:
            continue
        if not lo:
            lo, hi = [s.start for s in ov[0]], [s.stop for s in ov[0]]
        else:
            lo = [min(a, s.start) for a, s in zip(lo, ov[0])]
            hi = [max(b, s.stop) for b, s in zip(hi, ov[0])]
    return tuple(slice(a, b) for a, b in zip(lo, hi)) if lo else None


def _sub(c: Chunk, box: Tuple[slice, ...]) -> Chunk:
    """The chunk of box ``box`` of piece ``c``."""
    offsets = tuple(o + b.start for o, b in zip(c.offsets, box))
    return Chunk(c.key, c.global_shape, offsets, tuple(b.stop - b.start for b in box), c.dtype)


def reshard_from_memory(
    transport: Transport,
    make_targets: Callable[[List[Chunk]], Sequence[Piece]],
    layout: Optional[Mapping[int, List[Chunk]]],
    held: Mapping[int, Sequence[torch.Tensor]],
    plain: Optional[Dict[str, Any]],
) -> Dict[str, Any]:
    """Collective over ``transport``'s group (host tensors: the side group): fill every
    rank's targets from the old shards the members hold. ``layout``: old shard -> its chunks (None on a rank holding nothing);
    ``held``: old shard -> this rank's host tensors of it. ``make_targets``: this rank's
    pieces in the new layout, given the old layout's chunks (sent to every rank first, so a
    rank holding nothing, a member just added, knows them too: the adapters make an empty
    optimizer's moments from them instead of by a step). Returns the snapshot's plain state
    (from the lowest holder). Raises ValueError on every rank alike when the old state does
    not fit or the holders do not cover it."""
    world, rank = transport.world, transport.rank
    mine = {
        "held": sorted(held),
        "layout": {s: [c.as_tuple() for c in cs] for s, cs in layout.items()} if layout else None,
        "plain": plain if held else None,
    }
    everyone = transport.gather(mine)
    ref = next((e for e in everyone if e["held"]), None)
    if ref is None:
        raise ValueError("no member holds any shard of the snapshot")
    old = {int(s): [Chunk.of(t) for t in cs] for s, cs in ref["layout"].items()}
    have = set().union(*(set(e["held"]) for e in everyone))
    if not have >= set(old):
        raise ValueError(f"the members hold shards {sorted(have)} of {len(old)}: not all of them")
    mine_error: Optional[BaseException] = None
    try:
        targets = make_targets([c for cs in old.values() for c in cs])
        sent: Tuple[Optional[str], List[Any]] = (None, [c.as_tuple() for c, _t in targets])
    except Exception as e:  # noqa: BLE001 - sent to the others, then raised: none waits on this rank
        mine_error, targets, sent = e, [], (f"rank {rank}: {type(e).__name__}: {e}", [])
    got = transport.gather(sent)
    failed = [err for err, _cs in got if err]
    if mine_error is not None:
        raise mine_error
    if failed:
        raise RuntimeError(f"the restore stopped: {failed[0]}")
    wants = [[Chunk.of(t) for t in cs] for _err, cs in got]
    check_fits([c for cs in old.values() for c in cs], [c for cs in wants for c in cs])  # (on every rank alike)
    by_key = [_by_key(cs) for cs in wants]  # (this rank's: its targets', in their order)
    counts, index = [0] * len(targets), by_key[rank]
    seen = set()
    for s in sorted(old):
        # Every rank holding old shard s fills from its own copy; the lowest of them sends
        # the others the box of each piece they need.
        local = {q for q, e in enumerate(everyone) if s in e["held"]}
        h = min(local)
        works, received = [], []
        for j, c in enumerate(old[s]):
            dedupe = (c.key, c.offsets, c.sizes)
            if dedupe in seen:
                continue  # a replicated piece already placed from an earlier shard
            seen.add(dedupe)
            boxes = [_box(c, [wants[q][i] for i in by_key[q].get(c.key, ())]) for q in range(world)]
            own_box = boxes[rank]
            if rank in local:
                if own_box is not None:
                    _fill_targets(targets, index, [(c, held[s][j])], counts)
                if rank == h and c.numel():
                    t = held[s][j]
                    works += [
                        transport.send(t[b], q, j) for q, b in enumerate(boxes) if b is not None and q not in local
                    ]
            elif own_box is not None:
                sub = _sub(c, own_box)
                buf = torch.empty(sub.sizes, dtype=dtype_of(c.dtype))
                if c.numel():
                    works.append(transport.recv(buf, h, j))
                received.append((sub, buf))
        transport.wait(works)
        _fill_targets(targets, index, received, counts)
    short = [(c.key, n, c.numel()) for (c, _t), n in zip(targets, counts) if n < c.numel()]
    if short:  # cannot happen after check_fits; a guard against silent partial loads
        raise RuntimeError(f"rank {rank}: pieces not filled after the re-partition: {short[:3]}")
    return ref["plain"]


def fill_from_files(
    targets: Sequence[Piece], shard_files: Mapping[int, Any], everyone: Optional[Sequence[Chunk]] = None
) -> None:
    """Storage restore: ``shard_files`` old rank -> its loaded file ({"chunks", "tensors"},
    memory-mapped); raises ValueError when they do not fit. ``everyone``: the pieces of
    every rank of the new group (default: ``targets``'): the saved state must fit the
    group, not this rank, which may hold no piece of some tensor (ZeRO-3 gives a rank
    none of a parameter smaller than the partition offset it starts at)."""
    old = {s: [Chunk.of(t) for t in f["chunks"]] for s, f in shard_files.items()}
    check_fits(
        [c for cs in old.values() for c in cs], list(everyone) if everyone is not None else [c for c, _t in targets]
    )
    counts, index = [0] * len(targets), _by_key([c for c, _t in targets])
    seen = set()
    for s in sorted(old):
        pieces = []
        for c, t in zip(old[s], shard_files[s]["tensors"]):
            k = (c.key, c.offsets, c.sizes)
            if k not in seen:
                seen.add(k)
                pieces.append((c, t))
        _fill_targets(targets, index, pieces, counts)


__all__ = ["reshard_from_memory", "fill_from_files"]
