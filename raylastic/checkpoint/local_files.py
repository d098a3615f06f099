"""The local-file half of the storage seam: atomic writes and copies, walking a tree,
copying a stream in chunks.

Split out of ``storage.py`` so the ``Storage`` class reads as retry and path plumbing
over a filesystem, while the guarantees about bytes on local disk live in one place: an
atomic write or copy goes through a temp file and ``os.replace``, so a crash never leaves
a half-written file under the final name (and the temp file is removed on any error).
``storage.py`` imports these names and calls them as its own module globals, so code
(and tests) that patch them on ``raylastic.checkpoint.storage`` still take effect.
"""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Callable

import pyarrow.fs as pafs

_CHUNK = 8 * 1024 * 1024


def _walk_local(local_dir: str) -> list[tuple[str, int]]:
    """Every file under ``local_dir`` as (posix path relative to it, size), sorted, so an
    upload's file list is the same on every platform and run."""
    if not os.path.isdir(local_dir):
        raise FileNotFoundError(f"upload_dir: {local_dir!r} is not a directory")
    out = []
    for dirpath, _, filenames in os.walk(local_dir):
        for name in filenames:
            full = os.path.join(dirpath, name)
            out.append((os.path.relpath(full, local_dir).replace(os.sep, "/"), os.path.getsize(full)))
    return sorted(out)


def _atomic_local_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fsynced temp file and ``os.replace``: readers
    see the old file or the whole new one, never a partial write."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _atomic_local_copy(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` through a temp file and ``os.replace``, for the same reason
    as :func:`_atomic_local_write`."""
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = f"{dst}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _copy_stream(
    open_src: Callable, src: str, dst_fs: pafs.FileSystem, dst: str, make_parent: Callable[[str], None] = lambda _: None
) -> None:
    """Copy ``src`` (opened with ``open_src``) to ``dst`` on ``dst_fs`` in ``_CHUNK``-sized
    pieces, so a large checkpoint file never has to fit in memory at once."""
    make_parent(dst)
    with open_src(src) as fin, dst_fs.open_output_stream(dst) as fout:
        while True:
            chunk = fin.read(_CHUNK)
            if not chunk:
                break
            fout.write(chunk)
