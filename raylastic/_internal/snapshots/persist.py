"""Persist: what a persisted snapshot writes to storage, and reading it back.

Why these bytes, in this layout: they are the checkpoint format users restore from, so
they must stay readable across versions. A replicated snapshot is one file,
``elastic_state.pt``: ``{"plain": ..., "tensors": {"model": ..., "optimizer": ...}}``,
written by rank 0 from a whole copy. A sharded snapshot is one file per old rank,
``sharded/rank_<r>.pt`` (``{"chunks", "tensors"}``: the rank's own shard), plus rank 0's
``elastic_state.pt`` with the plain state and the layout (``"tensors": {}``); the
manifest commits it once every rank's part is uploaded, as for any multi-rank
checkpoint. Everything is read back with ``torch.load(weights_only=True)``.

The writers run in the upload thread, off the training path; they pin the snapshot
(its buffers are not recycled while a writer may still read them) and wait for its copy
(the own part: not for a sharded snapshot's peer copies).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional

import torch

from raylastic._internal.snapshots.placement import is_whole

STATE_FILE = "elastic_state.pt"
SHARD_DIR = "sharded"


def shard_file(rank: int) -> str:
    return f"{SHARD_DIR}/rank_{rank:05d}.pt"


def save_whole(snap: Any, directory: str) -> None:
    """Write ``snap``'s restorable part; it must be a whole copy."""
    if not is_whole(snap.holding):
        raise RuntimeError(
            f"snapshot {snap.index} holds only shards {snap.holding[1]} of "
            f"{snap.holding[0]}: assemble it before writing it to storage"
        )
    torch.save({"plain": snap.plain, "tensors": snap.tensors}, os.path.join(directory, STATE_FILE))


def _wait_for_own_copy(snap: Any) -> None:
    """Until what this rank writes of ``snap`` is in host memory (``complete``), or its copy
    ended without that (``done``, with ``error``). Not until ``done`` alone: a sharded
    snapshot is done once its peer copies are over too, and a copy to a peer whose node was
    lost waits for the side group's timeout; the upload thread waited with it, and a
    graceful stop after it waited for the upload: a ZeRO-3 survivor was replaced after 57 s
    (2026-12-08). The writer reads only the own shard, there since ``complete``."""
    while not snap.complete.wait(0.1):
        if snap.done.is_set():
            return


def _pinned_writer(snap: Any, write_files: Callable[[str], None]) -> Callable[[str], None]:
    snap.pins += 1  # released once written: the buffers must not be recycled meanwhile

    def write(directory: str) -> None:
        try:
            _wait_for_own_copy(snap)
            if snap.error is not None or not snap.complete.is_set():
                raise RuntimeError(f"snapshot {snap.index} was not copied: {snap.error}")
            write_files(directory)
        finally:
            snap.pins -= 1

    return write


def whole_writer(snap: Any) -> Callable[[str], None]:
    """Serialises ``snap`` (a whole copy) for a persisted checkpoint, in the upload thread."""
    return _pinned_writer(snap, snap.save)


def shard_writer(snap: Any, rank: int, root: str, with_plain: bool) -> Callable[[str], None]:
    """Writes ``rank``'s own shard of the sharded snapshot ``snap`` (its tensors and layout
    under ``root``); ``with_plain`` (rank 0): and the plain state."""

    def files(directory: str) -> None:
        layout = snap.plain[root]["layout"]
        os.makedirs(os.path.join(directory, SHARD_DIR), exist_ok=True)
        torch.save(
            {"chunks": layout[rank], "tensors": snap.tensors[root][rank]}, os.path.join(directory, shard_file(rank))
        )
        if with_plain:
            torch.save({"plain": snap.plain, "tensors": {}}, os.path.join(directory, STATE_FILE))

    return _pinned_writer(snap, files)


def read_state(directory: str) -> Optional[Dict[str, Any]]:
    """The ``elastic_state.pt`` of a checkpoint directory; None when there is none (a
    checkpoint written by the user's own code, not by ``ElasticState``)."""
    path = os.path.join(directory, STATE_FILE)
    if not os.path.exists(path):
        return None
    return torch.load(path, weights_only=True)


def read_shards(directory: str, layout: Dict[int, List[Any]], inline: Optional[Dict[int, Any]]) -> Dict[int, Any]:
    """Old rank -> its shard file (``{"chunks", "tensors"}``), memory-mapped: only the
    overlapping bytes are read. ``inline``: shards carried in ``elastic_state.pt`` itself."""
    files: Dict[int, Any] = {}
    for s, cs in layout.items():
        if inline and s in inline:
            files[s] = {"chunks": cs, "tensors": inline[s]}
            continue
        path = os.path.join(directory, shard_file(s))
        if not os.path.exists(path):
            raise ValueError(f"the checkpoint lacks {shard_file(s)} (written by rank {s} of {len(layout)})")
        files[s] = torch.load(path, weights_only=True, mmap=True)
    return files


__all__ = [
    "STATE_FILE",
    "SHARD_DIR",
    "shard_file",
    "save_whole",
    "whole_writer",
    "shard_writer",
    "read_state",
    "read_shards",
]
