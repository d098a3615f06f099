"""Object names are data: never glob patterns, never paths out of a destination.

- ``relative_to``: a listed path's name below a base, compared by path components (``runA``
  is not a prefix of ``runA2/x``).
- ``local_target``: where a listed object may be written under a local directory; a name that
  is absolute, has ``..``/``.``/empty segments or control characters, or would land outside
  the directory (symbolic links included) raises ``UnsafeObjectNameError``.
- ``LiteralFSSpecHandler``: pyarrow's ``FSSpecHandler`` deletes through ``fs.rm``, which
  expands glob patterns (fsspec's and adlfs's ``expand_path``): deleting ``runs/run*/x``
  deleted every run's ``x``. This handler deletes exact names only.

See docs/security.md.
"""

from __future__ import annotations

import inspect
import os
from typing import Iterable, List, Optional

import pyarrow.fs as pafs

from raylastic.checkpoint.retry import PermanentStorageError


class UnsafeObjectNameError(PermanentStorageError):
    """A listed object's name cannot be used as a local path (it would escape the
    destination, or is not a plain relative name). Nothing was written for it."""


def has_control_chars(text: str) -> bool:
    """C0 controls (NUL, newline, escape, ...), DEL and C1 controls."""
    return any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in text)


def relative_to(path: str, base: str) -> Optional[str]:
    """``path``'s name below ``base`` ('b/c' for 'a/b/c' under 'a'); None unless ``path`` is
    strictly below ``base``, comparing whole path components (trailing slashes ignored)."""
    base_parts = base.rstrip("/").split("/")
    parts = path.rstrip("/").split("/")
    if len(parts) <= len(base_parts) or parts[: len(base_parts)] != base_parts:
        return None
    return "/".join(parts[len(base_parts) :])


def name_problem(name: str) -> Optional[str]:
    """Why ``name`` is not a plain relative object name, or None."""
    if not isinstance(name, str) or name == "":
        return "the name is empty"
    if has_control_chars(name):
        return "it contains a control character"
    if name.startswith("/") or os.path.isabs(name) or os.path.splitdrive(name)[0]:
        return "it is an absolute path"
    segments = name.split("/")
    if any(s in ("", ".", "..") for s in segments):
        return "it has an empty, '.' or '..' path segment"
    if any(sep in s for s in segments for sep in (os.sep, os.altsep) if sep and sep != "/"):
        return f"it contains this system's path separator {os.sep!r}"
    return None


def local_target(local_dir: str, name: str, where: str = "") -> str:
    """The local path for object ``name`` (relative, '/'-separated) under ``local_dir``.

    Raises UnsafeObjectNameError, naming the object, when ``name`` is not a plain relative
    name or the path (normalised, symbolic links resolved) is not inside ``local_dir``."""
    problem = name_problem(name)
    if problem is None:
        dst = os.path.join(local_dir, *name.split("/"))
        for resolve in (os.path.abspath, os.path.realpath):
            root, target = resolve(local_dir), resolve(dst)
            if os.path.commonpath([root, target]) != root or target == root:
                problem = f"it would be written outside {local_dir!r}" + (
                    " (through a symbolic link)" if resolve is os.path.realpath else ""
                )
                break
        else:
            return dst
    raise UnsafeObjectNameError(
        f"refusing to download object {name!r}{where}: {problem}. Checkpoint objects are written "
        "only as plain relative names inside the destination; someone with write access to the "
        "storage may have planted it: inspect the checkpoint before using it"
    )


def _takes_expand_path(rm) -> bool:
    try:
        return "expand_path" in inspect.signature(rm).parameters
    except (TypeError, ValueError):
        return False


class LiteralFSSpecHandler(pafs.FSSpecHandler):
    """An ``FSSpecHandler`` whose deletes never interpret a name as a glob pattern.

    A file is deleted with ``rm_file``. A directory is listed by prefix (``find``, which takes
    no patterns); every entry is checked to lie below it by path components, then the entries
    and the directory are deleted by exact name: through ``rm(paths, expand_path=False)``
    where the filesystem has it (adlfs: its batch delete, directory markers last), else one
    ``rm_file``/``rmdir`` each, deepest first. A bare container/bucket is never deleted."""

    def delete_file(self, path):
        # ``exists``, not ``isfile``: adlfs's isfile answers False when the store is unreachable.
        if not self.fs.exists(path):
            raise FileNotFoundError(path)
        self.fs.rm_file(path)

    def delete_dir(self, path):
        entries = self._tree(path)
        if entries is None:
            raise FileNotFoundError(path)
        self._remove_exact(entries)

    def _delete_dir_contents(self, path, missing_dir_ok):
        entries = self._tree(path)
        if entries is None:
            if missing_dir_ok:
                return
            raise FileNotFoundError(path)
        self._remove_exact(entries[:-1])  # the last entry is ``path`` itself

    def _tree(self, path: str) -> Optional[List[str]]:
        """Everything strictly below ``path``, deepest first, then ``path``; None if absent."""
        base = self.fs._strip_protocol(path).rstrip("/")
        if "/" not in base.strip("/"):
            raise ValueError(f"refusing to delete {path!r}: a whole bucket/container")
        if not self.fs.exists(base):
            return None
        found = self.fs.find(base, withdirs=True, detail=False)
        stripped = {self.fs._strip_protocol(p).rstrip("/") for p in found}
        below = [p for p in stripped if relative_to(p, base) is not None]
        return sorted(below, key=lambda p: (p.count("/"), p), reverse=True) + [base]

    def _remove_exact(self, paths: Iterable[str]) -> None:
        paths = list(paths)
        if not paths:
            return
        if _takes_expand_path(self.fs.rm):
            self.fs.rm(paths, expand_path=False)
            return
        for p in paths:  # deepest first: a directory is empty when its turn comes
            try:
                if self.fs.isdir(p):
                    self.fs.rmdir(p)
                else:
                    self.fs.rm_file(p)
            except FileNotFoundError:
                pass
