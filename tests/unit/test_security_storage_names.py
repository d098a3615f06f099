"""Security review (issue 22), findings 1 and 2: object and run names are data, never patterns
or paths out of the destination.

1. A run name with glob characters made retention/cleanup on Azure (adlfs expands globs in
   ``rm``) delete other runs' checkpoints: RunConfig refuses such names, and the storage
   seam deletes literally, under the exact prefix (path components, not string prefixes).
2. ``download_dir`` joined listed object names to the local directory unchecked: a ``..``
   name wrote outside it. Every listed name is validated before anything is written.

No server: Azure runs against an in-memory fsspec filesystem standing in for adlfs (it
expands globs in ``rm`` exactly as adlfs does), through the real ``_azure_backend``.
"""

from __future__ import annotations

import os

import pyarrow.fs as pafs
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from raylastic.checkpoint.manager import MANIFEST, CheckpointManager
from raylastic.checkpoint.storage import PermanentStorageError, Storage, StorageError
from raylastic.config import RunConfig
from raylastic.errors import ConfigError
from raylastic.events import EventLog

AZURITE_CONN = (
    "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey=a2V5a2V5a2V5;"
    "BlobEndpoint=http://127.0.0.1:1/devstoreaccount1;"
)
CKPT = "checkpoints/checkpoint_00000005-e0"


# ------------------------------------------------------------------------ a stand-in for adlfs

class _MemBlobFS(MemoryFileSystem):
    """adlfs-shaped paths ('container/key', no leading '/'); ``rm`` expands globs (as adlfs
    ``_rm`` does through ``_expand_path``)."""

    root_marker = ""
    store: dict = {}
    pseudo_dirs: list = [""]

    def __init__(self, *args, **kwargs):  # takes (and ignores) adlfs's keyword arguments
        super().__init__()

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, list):
            return [cls._strip_protocol(p) for p in path]
        return super()._strip_protocol(path).lstrip("/")


class _MemBlobFSWithExpandOption(_MemBlobFS):
    """Like adlfs: ``rm(..., expand_path=False)`` deletes exactly the paths given."""

    def rm(self, path, recursive=False, maxdepth=None, delimiter="/", expand_path=True, **kwargs):
        if expand_path:
            return super().rm(path, recursive=recursive, maxdepth=maxdepth)
        for p in sorted([path] if isinstance(path, str) else path, key=len, reverse=True):
            p = self._strip_protocol(p)
            if p in self.store:
                del self.store[p]
            elif p in self.pseudo_dirs:
                self.pseudo_dirs.remove(p)


@pytest.fixture(params=[_MemBlobFS, _MemBlobFSWithExpandOption], ids=["fsspec-rm", "adlfs-rm"])
def azure(request, monkeypatch):
    """A Storage over abfs://cont/runs whose adlfs filesystem is in memory."""
    import adlfs

    fake = request.param
    monkeypatch.setattr(fake, "store", {})
    monkeypatch.setattr(fake, "pseudo_dirs", [""])
    monkeypatch.setattr(adlfs, "AzureBlobFileSystem", fake)
    for name in list(os.environ):
        if name.startswith("AZURE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", AZURITE_CONN)
    fake().mkdir("cont")
    return Storage("abfs://cont/runs")


def _files(storage: Storage, rel: str = "") -> set:
    selector = pafs.FileSelector(storage.path(rel), allow_not_found=True, recursive=True)
    root = storage.path(rel).rstrip("/") + "/"
    return {i.path[len(root):] for i in storage.fs.get_file_info(selector) if i.type == pafs.FileType.File}


def _seed(storage: Storage, runs) -> None:
    for run in runs:
        storage.write_bytes(f"{run}/{CKPT}/model.pt", run.encode())
        storage.write_bytes(f"{run}/{CKPT}/{MANIFEST}", b"{}")


GLOB_RUNS = ["run*", "run?", "run[AB]", "r*"]
OTHERS = ["runA", "runB", "runA2"]


# ------------------------------------------------------------------------ finding 1: names

@pytest.mark.parametrize("name", ["run*", "run?", "run[0]", "a]b", "*", "a\x00b", "a\nb", "a\tb",
                                  "a\x7fb", "a/b", "a\\b", "..", "."])
def test_run_config_refuses_glob_control_and_path_characters(name):
    with pytest.raises(ConfigError) as info:
        RunConfig(name=name)
    message = str(info.value)
    assert "RunConfig.name" in message and "Fix:" in message


@pytest.mark.parametrize("name", ["run1", "my-run_2.v3", "raylastic_2026-01-02_03-04-05", "a b", "a..b"])
def test_run_config_accepts_plain_names(name):
    assert RunConfig(name=name).name == name


@pytest.mark.parametrize("victim", GLOB_RUNS)
def test_azure_delete_dir_deletes_the_literal_path_only(azure, victim):
    _seed(azure, GLOB_RUNS + OTHERS)
    before = _files(azure)
    azure.delete_dir(f"{victim}/{CKPT}")
    gone = before - _files(azure)
    assert gone == {f"{victim}/{CKPT}/model.pt", f"{victim}/{CKPT}/{MANIFEST}"}


@pytest.mark.parametrize("victim", GLOB_RUNS)
def test_azure_delete_file_deletes_the_literal_object_only(azure, victim):
    _seed(azure, GLOB_RUNS + OTHERS)
    before = _files(azure)
    azure.delete_file(f"{victim}/{CKPT}/{MANIFEST}")
    azure.delete_file(f"{victim}/{CKPT}/missing-{MANIFEST}")  # missing: no error, nothing else goes
    assert before - _files(azure) == {f"{victim}/{CKPT}/{MANIFEST}"}


def test_azure_prefix_is_a_path_component_not_a_string_prefix(azure, tmp_path):
    _seed(azure, ["runA", "runA2", "runAB"])
    assert azure.list_dir("runA") == ["checkpoints"]
    azure.download_dir("runA", str(tmp_path / "dl"))
    assert sorted(p.name for p in (tmp_path / "dl").rglob("*") if p.is_file()) == [MANIFEST, "model.pt"]
    assert (tmp_path / "dl" / CKPT / "model.pt").read_bytes() == b"runA"
    azure.delete_dir("runA")
    assert {f.split("/")[0] for f in _files(azure)} == {"runA2", "runAB"}


def test_local_prefix_is_a_path_component_not_a_string_prefix(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    _seed(storage, ["runA", "runA2"])
    storage.delete_dir("runA")
    assert _files(storage) == {f"runA2/{CKPT}/model.pt", f"runA2/{CKPT}/{MANIFEST}"}


def test_retention_and_cleanup_of_a_glob_named_run_spare_other_runs(azure):
    """A manager for run 'run*' (a name RunConfig now refuses, e.g. from an older release)
    deletes its own uncommitted directory and its retired checkpoints, nothing of runA's."""
    _seed(azure, ["runA"])  # runA: checkpoint 5, committed (it has a manifest), in epochs 0 and 1
    e1 = CKPT.replace("-e0", "-e1")
    azure.write_bytes(f"runA/{e1}/model.pt", b"runA")
    azure.write_bytes(f"runA/{e1}/{MANIFEST}", b"{}")
    azure.write_bytes(f"run*/{CKPT}/model.pt", b"half-written")  # run*: 5, never committed
    events = EventLog(azure, "run*", verbose=False)
    manager = CheckpointManager(azure, "run*", 1, events)
    manager.begin_epoch(1, 1)  # delete_uncommitted
    assert not azure.exists(f"run*/{CKPT}/model.pt")
    assert azure.read_bytes(f"runA/{CKPT}/model.pt") == b"runA"
    from raylastic.session import ReportRecord

    for index in (5, 6):
        rel = f"run*/checkpoints/checkpoint_{index:08d}-e1"
        azure.write_bytes(f"{rel}/model.pt", b"x")
        manager.on_records([ReportRecord(index=index, rank=0, epoch=1, ts=0.0, metrics={},
                                         checkpoint_rel=rel, files=[["model.pt", 1]])])
    assert [c.index for c in manager.committed] == [6]  # 5 retired (num_to_keep=1)
    assert _files(azure, "runA") == {f"{c}/{f}" for c in (CKPT, e1) for f in ("model.pt", MANIFEST)}


def test_retention_deletes_only_this_runs_checkpoint_directories(tmp_path):
    """A report naming a directory that is not ``<run>/checkpoints/checkpoint_<i>-e<e>`` (here:
    another run's) is not committed: no manifest is written there, and nothing there is deleted."""
    from raylastic.session import ReportRecord

    storage = Storage(str(tmp_path / "store"))
    _seed(storage, ["runA"])
    manager = CheckpointManager(storage, "runB", 1, EventLog(storage, "runB", verbose=False))
    manager.begin_epoch(1, 1)
    for index, rel in ((5, f"runA/{CKPT}"), (6, "runB/checkpoints/checkpoint_00000006-e1"),
                       (7, "runB/checkpoints/checkpoint_00000007-e1")):
        manager.on_records([ReportRecord(index=index, rank=0, epoch=1, ts=0.0, metrics={},
                                         checkpoint_rel=rel, files=[["model.pt", 1]])])
    assert [c.index for c in manager.committed] == [7]
    assert storage.read_bytes(f"runA/{CKPT}/model.pt") == b"runA"
    assert storage.read_bytes(f"runA/{CKPT}/{MANIFEST}") == b"{}"


# ------------------------------------------------------------------------ finding 2: downloads

@pytest.mark.parametrize("name", ["../x", "a/../../x", "..", "a/..", "/etc/passwd", "a//b", "", "a/./b",
                                  "a\x00b", "a\nb", "a/\x1bb", "a\\..\\x" if os.sep == "\\" else "a/\x7f"])
def test_unsafe_object_names_are_refused(name):
    from raylastic.checkpoint.names import UnsafeObjectNameError, local_target

    with pytest.raises(UnsafeObjectNameError) as info:
        local_target("/tmp/dest", name)
    assert isinstance(info.value, PermanentStorageError)
    assert repr(name)[1:-1][:20] in str(info.value) or name == ""


@pytest.mark.parametrize("name", ["model.pt", "a/b/c.bin", "model[0].pt", "x*y", "a..b", ".hidden"])
def test_safe_object_names_map_inside_the_destination(name):
    from raylastic.checkpoint.names import local_target

    assert local_target("/tmp/dest", name) == os.path.join("/tmp/dest", *name.split("/"))


def test_download_refuses_a_name_escaping_the_directory_on_azure(azure, tmp_path):
    azure.write_bytes("r/ck/model.pt", b"ok")
    with azure.fs.open_output_stream(azure.path("r/ck") + "/../escaped.bin") as out:  # Storage.path
        out.write(b"evil")  # refuses '..'; an object store keeps it as part of the name
    dest = tmp_path / "dl" / "inner"
    with pytest.raises(StorageError) as info:
        azure.download_dir("r/ck", str(dest))
    assert "../escaped.bin" in str(info.value)
    assert not (tmp_path / "dl" / "escaped.bin").exists()
    assert not any(p.is_file() for p in tmp_path.rglob("*")), "nothing is written, not even the good file"


class _CraftedListing(pafs.FSSpecHandler):
    """Local files, plus listing entries the store should never have returned."""

    def __init__(self, extra):
        from fsspec.implementations.local import LocalFileSystem

        super().__init__(LocalFileSystem())
        self.extra = extra

    def get_file_info_selector(self, selector):
        infos = super().get_file_info_selector(selector)
        base = selector.base_dir.rstrip("/")
        return infos + [pafs.FileInfo(f"{base}/{e}" if not e.startswith("/") else e, pafs.FileType.File, size=1)
                        for e in self.extra]


@pytest.mark.parametrize("extra, named", [
    ("../escaped.bin", "../escaped.bin"),
    ("a/../../escaped.bin", "a/../../escaped.bin"),
    ("x\nescaped.bin", "escaped.bin"),
])
def test_download_refuses_crafted_listing_names_on_local_storage(tmp_path, extra, named):
    storage = Storage(str(tmp_path / "store"))
    storage.write_bytes("r/ck/model.pt", b"ok")
    (tmp_path / "store" / "r" / "escaped.bin").write_bytes(b"evil")  # what '../escaped.bin' reads
    if "\n" in extra:  # a real local file with a newline in its name
        (tmp_path / "store" / "r" / "ck" / extra).write_bytes(b"evil")
        extra = None
    (tmp_path / "store" / "r" / "ck" / "a").mkdir()  # so that 'a/../../escaped.bin' can be read
    storage.fs = pafs.PyFileSystem(_CraftedListing([extra] if extra else []))
    dest = tmp_path / "dl" / "inner"
    with pytest.raises(StorageError) as info:
        storage.download_dir("r/ck", str(dest))
    assert named in str(info.value).replace("\\n", "\n")
    assert not (tmp_path / "dl" / "escaped.bin").exists()
    assert not dest.exists() or not any(dest.rglob("*"))


def test_download_refuses_a_listed_object_outside_the_prefix(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    storage.write_bytes("r/ck/model.pt", b"ok")
    storage.write_bytes("r/ck2/other.pt", b"other run")
    storage.fs = pafs.PyFileSystem(_CraftedListing([str(tmp_path / "store" / "r" / "ck2" / "other.pt")]))
    with pytest.raises(StorageError, match="outside"):
        storage.download_dir("r/ck", str(tmp_path / "dl"))
    assert not (tmp_path / "dl" / "other.pt").exists()


def test_download_does_not_follow_a_symlink_out_of_the_destination(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    storage.write_bytes("r/ck/sub/model.pt", b"ok")
    dest, outside = tmp_path / "dl", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    os.symlink(outside, dest / "sub")
    with pytest.raises(StorageError, match="outside"):
        storage.download_dir("r/ck", str(dest))
    assert not (outside / "model.pt").exists()


def test_a_normal_download_still_works(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    storage.write_bytes("r/ck/a/b.bin", b"b")
    storage.write_bytes("r/ck/model[0].pt", b"m")
    storage.download_dir("r/ck", str(tmp_path / "dl"))
    assert (tmp_path / "dl" / "a" / "b.bin").read_bytes() == b"b"
    assert (tmp_path / "dl" / "model[0].pt").read_bytes() == b"m"
