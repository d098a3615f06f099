"""The storage seam: one small interface over local disk, S3, Azure Blob and GCS.

Checkpoints outlive the workers that write them, so everything above this module talks to
a :class:`Storage` (a ``pyarrow.fs`` filesystem plus a root path) and never to a cloud SDK.
Errors are sorted into two kinds because they call for opposite reactions: a *transient*
error (timeout, refused connection, 5xx, throttling) is retried with bounded, jittered
backoff; a *permanent* one (missing bucket, bad credentials, 403) fails at once with a
message naming the bucket/container and the credential source tried, never the secret.

Credentials come only from the environment (or the cloud SDK's default chain), never from
the URI: a ``Storage`` is pickled to Ray workers as its URI, so anything in the URI would
travel in plain text through the object store and into logs.

S3: ``s3://bucket/prefix``; the endpoint comes from ``?endpoint_override=`` or
AWS_ENDPOINT_URL(_S3), credentials from the AWS chain (AWS_ACCESS_KEY_ID/...). For
S3-compatible stores also set AWS_REQUEST_CHECKSUM_CALCULATION=when_required and
AWS_RESPONSE_CHECKSUM_VALIDATION=when_required (they reject the SDK's default checksums).

Azure: ``abfs://``/``az://`` go through adlfs wrapped in ``PyFileSystem(FSSpecHandler)``.
Credential order: AZURE_STORAGE_CONNECTION_STRING; AZURE_STORAGE_ACCOUNT_NAME +
AZURE_STORAGE_ACCOUNT_KEY; AZURE_STORAGE_ACCOUNT_NAME + AZURE_STORAGE_SAS_TOKEN; else
DefaultAzureCredential with AZURE_STORAGE_ACCOUNT_NAME (or the account named in the URI).
Only a connection string can name a custom endpoint (e.g. Azurite); the other sources
talk to https://ACCOUNT.blob.core.windows.net.

GCS: ``gs://`` uses pyarrow's GcsFileSystem and its default chain
(GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server). A custom endpoint comes from
``?endpoint_override=host:port&scheme=http`` (credentials as above; add ``anonymous=true`` for
an unauthenticated server), else from CLOUD_STORAGE_EMULATOR_ENDPOINT (read by
google-cloud-cpp, which pyarrow's client is built on) or STORAGE_EMULATOR_HOST (Google's
Python client and gcsfs): those name an emulator, so they imply anonymous access, as in
Google's own clients. The test suite runs against fake-gcs-server
(raylastic.testing.gcs_emulator). GCS has no directories and pyarrow lists only "directory
marker" objects as directories, so listings under gs:// are recursive (see ``list_dir``).
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pyarrow.fs as pafs

# The seam's names live in two halves; everything is importable from here as before.
from raylastic.checkpoint.backends import (  # noqa: F401 - some re-exported
    GCS_EMULATOR_VARS,
    _BACKENDS,
    _join,
    describe_aws_credentials,
    describe_gcs_credentials,
    parse_uri,
    select_azure_credentials,
)

# Called as this module's globals (patch them here); the bodies live in local_files.py.
from raylastic.checkpoint.local_files import _atomic_local_copy, _atomic_local_write, _copy_stream, _walk_local
from raylastic.checkpoint.names import UnsafeObjectNameError, local_target, relative_to
from raylastic.checkpoint.retry import (  # noqa: F401 - some re-exported
    PermanentStorageError,
    RetryPolicy,
    StorageError,
    T,
    TransientStorageError,
    _redact,
    classify_error,
    retry_call,
)

__all__ = [
    "StorageError",
    "TransientStorageError",
    "PermanentStorageError",
    "UnsafeObjectNameError",
    "RetryPolicy",
    "Storage",
    "classify_error",
    "retry_call",
    "parse_uri",
    "select_azure_credentials",
]

logger = logging.getLogger(__name__)


class Storage:
    """A run's storage root: a pyarrow filesystem and a base path within it.

    Every method retries transient errors under ``retry`` and raises
    :class:`TransientStorageError` when the attempts run out, or
    :class:`PermanentStorageError` at once. A missing object is not a storage failure:
    ``read_bytes``/``download_dir`` raise ``FileNotFoundError`` for it.

    ``create_container=True`` creates a missing bucket/container on first use (tests and
    scratch runs); by default a missing one is a PermanentStorageError, because silently
    creating a bucket from a typo'd URI hides the typo until someone looks for the data.
    """

    def __init__(self, uri: str, *, retry: RetryPolicy | None = None, create_container: bool = False) -> None:
        """A malformed URI raises ValueError; unusable credentials PermanentStorageError.
        Credentials are read from os.environ here (and again wherever it is unpickled)."""
        parsed = parse_uri(uri)
        self.uri: str = parsed.uri
        self.retry: RetryPolicy = retry or RetryPolicy()
        self.create_container = create_container
        self.is_local: bool = parsed.kind == "file"
        self.kind: str = parsed.kind
        self.bucket: str = parsed.bucket
        self._sleep: Callable[[float], None] = time.sleep
        try:
            backend = _BACKENDS[parsed.kind](parsed, os.environ)
        except ValueError as exc:
            raise PermanentStorageError(f"cannot open storage {self.uri!r}: {exc}") from None
        self.fs: pafs.FileSystem = backend.fs
        self.root: str = backend.root
        self.target: str = backend.target
        self._backend = backend
        self._root_checked = self.is_local or self.kind == "pyfs"  # a given filesystem: paths are created

    # -- plumbing ------------------------------------------------------------------------

    def __reduce__(self):
        if self.kind == "pyfs":  # the filesystem object travels with it (backends.filesystem_uri)
            from raylastic.checkpoint.backends import _FILESYSTEMS

            return (_rebuild, (self.uri, self.retry, self.create_container, self.bucket, _FILESYSTEMS[self.bucket]))
        return (_rebuild, (self.uri, self.retry, self.create_container))

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    def path(self, *parts: str) -> str:
        """Filesystem path of ``parts`` under the root; refuses '..' so callers stay inside."""
        rel = _join(*parts)
        if any(seg in ("..", ".") for seg in rel.split("/")):
            raise ValueError(f"storage path {rel!r} must not contain '.' or '..' segments")
        if self.is_local:
            return os.path.join(self.root, *rel.split("/")) if rel else self.root
        joined = _join(self.root, rel)
        return "/" + joined if self.root.startswith("/") else joined  # (an absolute path on a given filesystem)

    def _call(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` under the retry policy, translating errors into the two kinds."""
        if not self._root_checked:
            self._check_root()
        what = f"{op} {rel!r} on {self.target}" if rel else f"{op} {self.target}"
        return retry_call(fn, self.retry, sleep=self._sleep, what=what, secrets=self._backend.secrets)

    def _check_root(self) -> None:
        """Fail fast, by name, when the bucket/container is missing or access is denied."""
        bucket = self._backend.bucket_path

        def probe() -> bool:
            return self.fs.get_file_info(bucket).type != pafs.FileType.NotFound

        self._root_checked = True  # probe runs through _call; avoid recursing
        try:
            exists = self._call("checking access to", "", probe)
            if not exists:
                create = self._backend.create_bucket  # every object-store backend has one
                if not self.create_container or create is None:
                    raise PermanentStorageError(
                        f"{self.target} does not exist; create it first (or pass "
                        "create_container=True) - raylastic does not create buckets silently"
                    )
                self._call("creating", "", create)
        except BaseException:
            self._root_checked = False
            raise

    # -- operations ------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write one object. Local writes go through a temp file + os.replace so a crash
        never leaves a half-written file under the final name (object stores PUT atomically)."""
        path = self.path(rel)
        if self.is_local:
            self._call("write", rel, lambda: _atomic_local_write(path, data))
            return

        def put() -> None:
            self._make_parent(path)
            with self.fs.open_output_stream(path) as out:
                out.write(data)

        self._call("write", rel, put)

    def read_bytes(self, rel: str) -> bytes:
        path = self.path(rel)

        def get() -> bytes:
            with self._open_input(path) as src:
                return src.read()

        return self._call("read", rel, get)

    def _open_input(self, path: str):
        """Open for reading; re-check a "not found" with a stat. fsspec's ``isfile`` (used by
        pyarrow's FSSpecHandler) turns an unreachable Azure endpoint into FileNotFoundError,
        which would read as "no checkpoint" during an outage; the stat raises the real error."""
        try:
            return self.fs.open_input_stream(path)
        except FileNotFoundError:
            if not self.is_local and self.fs.get_file_info(path).type == pafs.FileType.File:
                return self.fs.open_input_stream(path)
            raise

    def exists(self, rel: str) -> bool:
        path = self.path(rel)
        return self._call("stat", rel, lambda: self.fs.get_file_info(path).type != pafs.FileType.NotFound)

    def file_sizes(self, rels: list[str]) -> list[int | None]:
        """Size of each file in ``rels``, None where there is no file, in one retried call.

        An unreachable store raises (TransientStorageError after the retries), never None:
        "missing" must only ever mean the store answered that it is missing."""
        paths = [self.path(r) for r in rels]

        def stat() -> list[int | None]:
            infos = self.fs.get_file_info(paths) if paths else []
            return [i.size if i.type == pafs.FileType.File else None for i in infos]

        if not rels:
            return []
        what = rels[0] if len(rels) == 1 else f"{rels[0]} (+{len(rels) - 1} more)"
        return self._call("stat", what, stat)

    def list_dir(self, rel: str = "") -> list[str]:
        """Child base names (files and directories) of ``rel``; [] when it does not exist.

        Where directories are only name prefixes that the filesystem lists as marker objects
        (GCS), the listing is recursive and reduced to the first level here: a recursive
        request costs one call per 1,000 objects below ``rel``."""
        path = self.path(rel)
        recursive = self._backend.implicit_dirs
        selector = pafs.FileSelector(path, allow_not_found=True, recursive=recursive)
        parent = path.rstrip("/")

        def ls() -> list[str]:
            try:
                infos = self.fs.get_file_info(selector)
            except (FileNotFoundError, NotADirectoryError):
                return []
            if recursive:
                return sorted(
                    {i.path[len(parent) + 1 :].split("/", 1)[0] for i in infos if i.path.startswith(parent + "/")}
                    - {""}
                )
            # adlfs may return grandchildren for a depth-1 listing: keep direct children only.
            return sorted(
                {i.base_name for i in infos if i.base_name and i.path.rstrip("/").rsplit("/", 1)[0] == parent}
            )

        return self._call("list", rel, ls)

    def list_dirs(self, rel: str = "") -> list[str]:
        """Child directory names of ``rel`` (as ``list_dir``, files left out)."""
        path = self.path(rel)
        selector = pafs.FileSelector(path, allow_not_found=True, recursive=self._backend.implicit_dirs)
        parent = path.rstrip("/") + "/"

        def ls() -> list[str]:
            try:
                heads = [
                    (i.path.rstrip("/")[len(parent) :].partition("/"), i.type)
                    for i in self.fs.get_file_info(selector)
                    if i.path.startswith(parent)
                ]
            except (FileNotFoundError, NotADirectoryError):
                return []
            return sorted({h for (h, sep, _), t in heads if h and (sep or t == pafs.FileType.Directory)})

        return self._call("list", rel, ls)

    def upload_dir(self, local_dir: str, rel: str) -> list[tuple[str, int]]:
        """Copy a local tree under ``rel``; returns (relative posix path, size) per file.

        Each file is retried on its own, so one throttled PUT does not resend the whole tree.
        """
        files = _walk_local(local_dir)

        def one(item: tuple[str, int]) -> None:
            name, _ = item
            src = os.path.join(local_dir, *name.split("/"))
            dst = self.path(rel, name)
            if self.is_local:
                self._call("upload", f"{rel}/{name}", lambda: _atomic_local_copy(src, dst))
            else:
                self._call(
                    "upload",
                    f"{rel}/{name}",
                    lambda: _copy_stream(
                        pafs.LocalFileSystem().open_input_stream, src, self.fs, dst, self._make_parent
                    ),
                )

        self._map(one, files)
        return files

    def download_dir(self, rel: str, local_dir: str) -> None:
        """Copy every file under ``rel`` into ``local_dir``; FileNotFoundError if none exist.

        Listed names are data: each must lie below ``rel`` (by path components) and map to a
        plain relative path inside ``local_dir`` (no '..', absolute path, control character
        or symbolic link out of it), else UnsafeObjectNameError names the object. All names
        are checked before anything is written."""
        base = self.path(rel)
        selector = pafs.FileSelector(base, allow_not_found=True, recursive=True)
        infos = self._call("list", rel, lambda: self.fs.get_file_info(selector))
        files = [i.path for i in infos if i.type == pafs.FileType.File]
        if not files:
            raise FileNotFoundError(f"no files under {rel!r} in {self.uri}")
        where = f" (under {rel!r} in {self.uri})"
        plan = []
        for src in files:
            name = relative_to(src, base)
            if name is None:
                raise UnsafeObjectNameError(
                    f"refusing to download {src!r}{where}: the listing returned an object outside "
                    f"{rel!r}; nothing was downloaded"
                )
            plan.append((src, name, local_target(local_dir, name, where)))

        def one(item: tuple[str, str, str]) -> None:
            src, name, dst = item
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            self._call(
                "download", f"{rel}/{name}", lambda: _copy_stream(self._open_input, src, pafs.LocalFileSystem(), dst)
            )

        os.makedirs(local_dir, exist_ok=True)
        self._map(one, plan)

    def delete_dir(self, rel: str) -> None:
        """Remove ``rel`` and everything under it; no error if it is missing."""
        path = self.path(rel)
        if _join(rel) == "":
            raise ValueError("delete_dir('') would delete the storage root; name a subdirectory")

        def rm() -> None:
            if self._backend.implicit_dirs:
                self._delete_prefix(path)
                return
            try:
                self.fs.delete_dir(path)
            except FileNotFoundError:
                return
            if not self.is_local:
                self._sweep_empty_dirs(path)

        self._call("delete", rel, rm)

    def _delete_prefix(self, path: str) -> None:
        """Delete every object under ``path``, then its marker object if one exists. pyarrow's
        GCS ``delete_dir`` fails on a prefix without a marker (after deleting its objects),
        and on a missing one; our writes create no markers."""
        self.fs.delete_dir_contents(path, missing_dir_ok=True)
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            try:
                self.fs.delete_dir(path)
            except FileNotFoundError:
                pass

    def _sweep_empty_dirs(self, path: str) -> None:
        """SeaweedFS can keep emptied directories after a batch delete; they are invisible to
        recursive listings and pyarrow cannot delete them, yet ``list_dir`` shows them. Touch
        an object inside each leftover (deepest first) and delete the directory again, which
        makes the server drop it. Costs one HEAD on stores without the quirk."""
        if self.fs.get_file_info(path).type != pafs.FileType.Directory:
            return
        selector = pafs.FileSelector(path, allow_not_found=True, recursive=False)
        for info in self.fs.get_file_info(selector):
            if relative_to(info.path, path) is None:
                continue  # never act on anything outside ``path``
            if info.type == pafs.FileType.Directory:
                self._sweep_empty_dirs(info.path)
            elif info.type == pafs.FileType.File:
                self.fs.delete_file(info.path)
        if self.fs.get_file_info(path).type == pafs.FileType.Directory:
            with self.fs.open_output_stream(f"{path}/.raylastic-sweep"):
                pass
            try:
                self.fs.delete_dir(path)
            except FileNotFoundError:
                pass

    def delete_file(self, rel: str) -> None:
        path = self.path(rel)

        def rm() -> None:
            try:
                self.fs.delete_file(path)
            except FileNotFoundError:
                pass

        self._call("delete", rel, rm)

    def _make_parent(self, path: str) -> None:
        """A given filesystem (``pyfs://``) may need directories (fsspec's local one does)."""
        if self.kind == "pyfs" and "/" in path.strip("/"):
            self.fs.create_dir(path.rsplit("/", 1)[0], recursive=True)

    def _map(self, fn: Callable[[T], None], items: list) -> None:
        """Local copies are disk-bound: run them inline. Remote copies overlap their latency."""
        if self.is_local or len(items) <= 1:
            for item in items:
                fn(item)
            return
        with ThreadPoolExecutor(max_workers=min(8, len(items))) as pool:
            for future in [pool.submit(fn, item) for item in items]:
                future.result()


def _rebuild(
    uri: str, retry: RetryPolicy, create_container: bool, key: str = "", fs: pafs.FileSystem | None = None
) -> Storage:
    if fs is not None:
        from raylastic.checkpoint.backends import register_filesystem

        register_filesystem(key, fs)
    return Storage(uri, retry=retry, create_container=create_container)
