"""A committed checkpoint in a run's storage, as a Ray Train ``Checkpoint``.

Apart from ``raylastic.session`` because it subclasses Ray Train's ``Checkpoint``: importing
``ray.train`` costs a process ~0.5 s of CPU (it pulls in ``ray.air``, pandas and
``ray.data``), which the controller, and a worker whose train function never touches a
checkpoint, should not pay.
"""

from __future__ import annotations

import os

from ray.air._internal.filelock import TempFileLock
from ray.train import Checkpoint


class StorageCheckpoint(Checkpoint):
    """A committed checkpoint in the run's storage (what ``get_checkpoint()`` and
    ``Result.checkpoint`` return). Reading it (``as_directory``, ``to_directory``)
    downloads through ``Storage.download_dir``: every file under the storage's retry
    policy (a blip while a restored train function loads its state is waited out, not a
    failed attempt), and nested directories on ``gs://``, where Ray's own download finds
    no directory markers and fails. As in Ray, processes on one node that read the same
    checkpoint at once share one download."""

    def __init__(self, storage, rel: str):
        super().__init__(path=storage.path(rel), filesystem=storage.fs)
        self._storage, self._rel = storage, rel

    def to_directory(self, path=None) -> str:
        local = os.path.normpath(os.path.expanduser(str(path or self._get_temporary_checkpoint_dir())))
        os.makedirs(local, exist_ok=True)
        try:
            with TempFileLock(local, timeout=0):
                self._storage.download_dir(self._rel, local)
        except TimeoutError:  # another process here is downloading it: wait for that one
            with TempFileLock(local, timeout=-1):
                pass
        return local
