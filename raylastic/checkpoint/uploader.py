"""Checkpoint persistence off the training path (worker side).

``report(checkpoint=...)`` only *stages* the files: a kernel-side local copy (the
caller's directory is usually a temporary one deleted right after ``report`` returns).
The CRC32 of each file for the manifest and the upload to storage then run in this
worker's background thread while training continues.

Back-pressure: at most one upload is pending per worker. A ``report`` with a new
checkpoint while the previous upload is still running waits for it, so memory and local
disk hold at most two checkpoints per worker (the uploading one and the new staged one),
whatever the upload bandwidth.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

FileEntry = Tuple[str, int, str]  # (relative posix path, size, "crc32:<hex>")
_CHUNK = 8 * 1024 * 1024


def stage_dir(src: str, dst: str) -> None:
    """Copy a directory tree to ``dst`` with the kernel's copy (``copyfile`` uses
    sendfile/copy_file_range): the only work ``report()`` does on the training thread.
    Checksums are computed afterwards, in the upload thread."""
    os.makedirs(dst, exist_ok=True)  # an empty tree stages (and uploads) as an empty directory
    for root, _dirs, files in os.walk(src):
        for name in files:
            s = os.path.join(root, name)
            d = os.path.join(dst, os.path.relpath(s, src))
            os.makedirs(os.path.dirname(d), exist_ok=True)
            shutil.copyfile(s, d)


def checksum_tree(root: str) -> List[FileEntry]:
    entries: List[FileEntry] = []
    for base, _dirs, files in os.walk(root):
        for name in sorted(files):
            path = os.path.join(base, name)
            crc, size = 0, 0
            with open(path, "rb") as fh:
                while True:
                    chunk = fh.read(_CHUNK)
                    if not chunk:
                        break
                    crc = zlib.crc32(chunk, crc)
                    size += len(chunk)
            entries.append((os.path.relpath(path, root).replace(os.sep, "/"), size, f"crc32:{crc:08x}"))
    return entries


@dataclass
class UploadResult:
    rel: str
    files: List[FileEntry] = field(default_factory=list)
    upload_s: float = 0.0
    error: Optional[BaseException] = None


class AsyncUploader:
    """One background upload at a time for one worker process."""

    def __init__(self, storage, staging_root: Optional[str] = None):
        self._storage = storage
        self._root = staging_root or tempfile.mkdtemp(prefix="raylastic-staging-")
        if staging_root is None:  # ours: removed with the uploader (or at interpreter exit)
            weakref.finalize(self, shutil.rmtree, self._root, True)
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self.last_error: Optional[BaseException] = None

    def stage(self, local_dir: str, key: str) -> str:
        dst = os.path.join(self._root, key)
        shutil.rmtree(dst, ignore_errors=True)
        stage_dir(local_dir, dst)
        return dst

    def submit(self, staged: str, rel: str, on_done: Callable[[UploadResult], None]) -> float:
        """Checksum and upload ``staged`` (from :meth:`stage`) to ``rel`` in the
        background; returns seconds spent waiting for the previous upload (back-pressure)."""
        return self._start(staged, rel, on_done)

    def submit_lazy(
        self, produce: Callable[[str], None], key: str, rel: str, on_done: Callable[[UploadResult], None]
    ) -> float:
        """Like :meth:`submit`, but the files are written by ``produce(dir)`` in the
        background thread (serialising a snapshot off the training path)."""
        return self._start(os.path.join(self._root, key), rel, on_done, produce=produce)

    def _start(
        self,
        staged: str,
        rel: str,
        on_done: Callable[[UploadResult], None],
        *,
        produce: Optional[Callable[[str], None]] = None,
    ) -> float:
        waited = self.wait()

        def run() -> None:
            res = UploadResult(rel=rel)
            start = time.perf_counter()
            try:
                if produce is not None:
                    shutil.rmtree(staged, ignore_errors=True)
                    os.makedirs(staged)
                    produce(staged)
                res.files = checksum_tree(staged)
                self._storage.upload_dir(staged, rel)
            except BaseException as e:  # noqa: BLE001 - handed to the session
                res.error = e
                self.last_error = e
            finally:
                res.upload_s = time.perf_counter() - start
                shutil.rmtree(staged, ignore_errors=True)
            on_done(res)

        with self._lock:
            self._thread = threading.Thread(target=run, name="raylastic-upload", daemon=True)
            self._thread.start()
        return waited

    def wait(self, timeout_s: Optional[float] = None) -> float:
        """Block until no upload is pending; returns the seconds waited."""
        with self._lock:
            thread = self._thread
        if thread is None:
            return 0.0
        start = time.perf_counter()
        thread.join(timeout_s)
        return time.perf_counter() - start

    @property
    def pending(self) -> bool:
        with self._lock:
            return self._thread is not None and self._thread.is_alive()
