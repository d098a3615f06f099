"""The event log on object stores: segments, never a rewrite of history (security issue
22, events.py finding), and every reader reading every segment in order.

The object store is an in-memory fake of the ``Storage`` methods the log uses
(``is_local``, ``list_dir``, ``read_bytes``, ``write_bytes``): the writer's logic is what
is under test, not a store. Local storage is a real ``Storage`` on a temp directory.
"""

from __future__ import annotations

import json
import os
import threading

import pytest

from raylastic.checkpoint.retry import TransientStorageError
from raylastic.checkpoint.storage import Storage
from raylastic.events import (
    EVENTS_FILE, METRICS_FILE, EventKind, EventLog, JsonlWriter, load_events, load_log, log_segments,
    read_jsonl, read_log, segment_name, segment_number,
)

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "demo_spot_return")
NEVER = 3600.0  # the background sync never fires on its own: tests call flush()/close()


class MemoryStore:
    """An object store in memory; ``fail`` holds the operations that raise (an outage)."""

    is_local = False

    def __init__(self, objects=None):
        self.objects = dict(objects or {})
        self.fail: set = set()
        self.puts: list = []  # (rel, bytes) of every successful write
        self.put_seen = threading.Event()

    def _check(self, op: str, rel: str) -> None:
        if op in self.fail:
            raise TransientStorageError(f"{op} {rel!r}: store unreachable (after retries)")

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._check("write", rel)
        self.objects[rel] = bytes(data)
        self.puts.append((rel, len(data)))
        self.put_seen.set()

    def read_bytes(self, rel: str) -> bytes:
        self._check("read", rel)
        if rel not in self.objects:
            raise FileNotFoundError(rel)
        return self.objects[rel]

    def list_dir(self, rel: str = "") -> list:
        self._check("list", rel)
        prefix = rel.strip("/") + "/" if rel.strip("/") else ""
        return sorted({k[len(prefix):].split("/", 1)[0] for k in self.objects if k.startswith(prefix)})


def _lines(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _record(i: int, pad: int = 80) -> dict:
    return {"ts": 1_700_000_000.0 + i, "kind": "decision", "message": "x" * pad, "i": i}


# ----------------------------------------------------------------------------- naming

def test_segment_names_and_order():
    assert [segment_number(n, EVENTS_FILE) for n in (
        "events.jsonl", "events.1.jsonl", "events.12.jsonl", "events.012.jsonl", "events.0.jsonl",
        "events.jsonl.tmp-1a2b", "events.x.jsonl", "metrics.1.jsonl", "events.1234567890.jsonl",
    )] == [0, 1, 12, None, None, None, None, None, None]
    assert segment_name(EVENTS_FILE, 0) == "events.jsonl"
    assert segment_name(METRICS_FILE, 3) == "metrics.3.jsonl"
    names = ["events.10.jsonl", "metrics.jsonl", "events.2.jsonl", "events.jsonl", "checkpoints",
             "events.jsonl.tmp-1a2b"]
    assert log_segments(names, EVENTS_FILE) == ["events.jsonl", "events.2.jsonl", "events.10.jsonl"]


# ----------------------------------------------------------------------------- object stores

def test_a_read_error_at_start_never_rewrites_the_history():
    """The finding: a transient read error at start was taken for "no file", and the next
    sync replaced the run's history with the new lines only."""
    old = _lines([_record(i) for i in range(3)])
    store = MemoryStore({"run/events.jsonl": old})
    store.fail = {"read"}
    w = JsonlWriter(store, "run/events.jsonl", sync_interval_s=NEVER)
    w.write(_record(3))
    w.close()
    assert store.objects["run/events.jsonl"] == old
    store.fail = set()
    assert [r["i"] for r in read_log(store, "run")] == [0, 1, 2, 3]


def test_a_writer_never_writes_an_object_it_did_not_create():
    old = _lines([_record(0)])
    store = MemoryStore({"run/events.jsonl": old, "run/events.1.jsonl": old, "run/events.7.jsonl": old,
                         "run/events.jsonl.tmp-1a2b": b"junk", "run/other.jsonl": b"{}\n"})
    w = JsonlWriter(store, "run/events.jsonl", sync_interval_s=NEVER)
    w.write(_record(1))
    w.flush()
    w.write(_record(2))
    w.close()
    assert {rel for rel, _ in store.puts} == {"run/events.8.jsonl"}  # above every listed number
    assert [r["i"] for r in read_log(store, "run")] == [0, 0, 0, 1, 2]


def test_a_listing_error_is_not_an_empty_directory():
    """The name of a new segment comes from a listing: one that fails (after the store's
    retries) must not be read as "no segments yet" (that would overwrite events.jsonl).
    The upload waits for the next sync instead."""
    old = _lines([_record(0)])
    store = MemoryStore({"run/events.jsonl": old})
    store.fail = {"list"}
    w = JsonlWriter(store, "run/events.jsonl", sync_interval_s=NEVER)
    w.write(_record(1))
    w.flush()
    assert store.puts == [] and store.objects["run/events.jsonl"] == old
    store.fail = set()
    w.write(_record(2))
    w.close()
    assert [rel for rel, _ in store.puts] == ["run/events.1.jsonl"]
    assert [r["i"] for r in read_log(store, "run")] == [0, 1, 2]


def test_uploads_are_bounded_and_total_bytes_grow_linearly():
    """Each sync uploads at most the growing segment (plus a full one not yet uploaded
    whole), never the whole log: over a long run the bytes sent grow linearly, not
    quadratically as with one object rewritten at every sync."""
    store = MemoryStore()
    seg = 4096
    w = JsonlWriter(store, "run/metrics.jsonl", sync_interval_s=NEVER, segment_bytes=seg)
    line = len(json.dumps(_record(0))) + 1
    per_flush = []
    for i in range(2000):
        w.write(_record(i))
        if i % 10 == 9:
            before = sum(n for _, n in store.puts)
            w.flush()
            per_flush.append(sum(n for _, n in store.puts) - before)
    w.close()
    content = 2000 * line
    assert max(n for _, n in store.puts) <= seg + line  # every object is bounded
    assert max(per_flush) <= 2 * (seg + line)  # so is every sync
    assert sum(n for _, n in store.puts) <= 4 * content  # linear (one object: ~100x here)
    segments = log_segments(store.list_dir("run"), METRICS_FILE)
    assert len(segments) >= content // (seg + line)
    assert [r["i"] for r in read_log(store, "run", METRICS_FILE)] == list(range(2000))


def test_a_resumed_run_continues_the_log_after_the_last_segment():
    store = MemoryStore()
    first = JsonlWriter(store, "run/events.jsonl", sync_interval_s=NEVER, segment_bytes=1024)
    for i in range(40):
        first.write(_record(i))
        first.flush()
    first.close()
    names = log_segments(store.list_dir("run"), EVENTS_FILE)
    assert names[0] == "events.jsonl" and len(names) > 2
    second = JsonlWriter(store, "run/events.jsonl", sync_interval_s=NEVER, segment_bytes=1024)
    second.write(_record(40))
    second.close()
    assert store.puts[-1][0] == f"run/events.{len(names)}.jsonl"
    assert [r["i"] for r in read_log(store, "run")] == list(range(41))


def test_lines_written_during_an_outage_are_uploaded_once_the_store_is_back():
    store = MemoryStore()
    w = JsonlWriter(store, "run/events.jsonl", sync_interval_s=NEVER, segment_bytes=512)
    store.fail = {"write"}
    for i in range(30):  # several segments fill up while nothing can be uploaded
        w.write(_record(i))
        w.flush()
    assert store.objects == {}
    store.fail = set()
    w.close()
    assert [r["i"] for r in read_log(store, "run")] == list(range(30))
    assert all(n <= 512 + len(json.dumps(_record(0))) + 1 for _, n in store.puts)


def test_the_background_thread_uploads_on_its_own():
    store = MemoryStore()
    w = JsonlWriter(store, "run/events.jsonl", sync_interval_s=0.01)
    w.write(_record(0))
    assert store.put_seen.wait(30), "the background thread uploaded nothing"
    w.close()
    assert [r["i"] for r in read_log(store, "run")] == [0]


# ----------------------------------------------------------------------------- local disk

def test_local_storage_appends_to_events_jsonl(tmp_path):
    storage = Storage(str(tmp_path))
    for resume in (None, 3):
        log = EventLog(storage, "run", verbose=False)
        log.emit(EventKind.RUN_STARTED, resume_from=resume)
        log.metrics({"ts": 1.0, "index": 1, "epoch": 1, "world_size": 1, "metrics": {}})
        log.close()
    assert sorted(os.listdir(tmp_path / "run")) == [EVENTS_FILE, METRICS_FILE]
    assert [e["resume_from"] for e in load_events(str(tmp_path / "run"))] == [None, 3]
    assert len(load_log(str(tmp_path / "run"), METRICS_FILE)) == 2


def test_a_local_writer_appends_to_the_last_segment(tmp_path):
    """A run directory copied down from an object store, then resumed on local storage:
    new lines go after the newest segment, so the order still holds."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_bytes(_lines([_record(0)]))
    (run / "events.3.jsonl").write_bytes(_lines([_record(1)]))
    w = JsonlWriter(Storage(str(tmp_path)), "run/events.jsonl")
    w.write(_record(2))
    w.close()
    assert [r["i"] for r in load_events(str(run))] == [0, 1, 2]
    assert (run / "events.jsonl").read_bytes() == _lines([_record(0)])


# ----------------------------------------------------------------------------- readers

def _split_fixture(dst) -> None:
    """The fixture run with each log cut into segments (numbers with gaps), plus names
    that are not segments (a temp file, a zero-padded number) holding garbage."""
    os.makedirs(dst)
    for base, cuts in ((EVENTS_FILE, (0, 2, 10)), (METRICS_FILE, (0, 3))):
        with open(os.path.join(FIXTURE, base), "rb") as fh:
            lines = fh.read().splitlines(keepends=True)
        size = -(-len(lines) // len(cuts))
        for k, number in enumerate(cuts):
            with open(os.path.join(dst, segment_name(base, number)), "wb") as fh:
                fh.write(b"".join(lines[k * size:(k + 1) * size]))
    for junk in ("events.01.jsonl", "events.jsonl.tmp-1a2b", "metrics.x.jsonl"):
        with open(os.path.join(dst, junk), "wb") as fh:
            fh.write(b"not json\nnot json\n")


def test_single_file_runs_read_as_before():
    with open(os.path.join(FIXTURE, EVENTS_FILE), encoding="utf-8") as fh:
        assert load_events(FIXTURE) == list(read_jsonl(fh.read()))
    assert load_events(os.path.join(FIXTURE, "no-such-run")) == []


def test_every_reader_reads_every_segment_in_number_order(tmp_path):
    from raylastic.reporting import build_report, load_run

    split = str(tmp_path / "split")
    _split_fixture(split)
    assert load_events(split) == load_events(FIXTURE)
    assert load_log(split, METRICS_FILE) == load_log(FIXTURE, METRICS_FILE)
    whole, parts = load_run(FIXTURE), load_run(split)
    assert (parts.events, parts.metrics) == (whole.events, whole.metrics)
    assert build_report(parts.events, parts.metrics).to_json() == \
        build_report(whole.events, whole.metrics).to_json()
    local = Storage(str(tmp_path))
    assert read_log(local, "split") == load_events(FIXTURE)
    assert read_log(local, "split", METRICS_FILE) == load_log(FIXTURE, METRICS_FILE)


def test_report_reads_a_run_written_by_object_store_writers(tmp_path):
    """Two fit() sessions on an object store, then the run copied to disk as it is (the
    way `aws s3 sync` would): `raylastic report` sees both sessions."""
    from raylastic.reporting import load_run

    store = MemoryStore()
    for session in range(2):
        log = EventLog(store, "run", verbose=False)
        log._writer._segment_bytes = log._metrics._segment_bytes = 600
        log.emit(EventKind.RUN_STARTED, resume_from=None if session == 0 else 9)
        for i in range(10):
            log.metrics({"ts": 1_700_000_000.0 + i, "index": i + 1, "epoch": 1, "world_size": 1,
                         "metrics": {"loss": 1.0}})
            log.flush()
        log.emit(EventKind.RUN_FINISHED, index=10)
        log.close()
    for rel, data in store.objects.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(data)
    assert len(log_segments(os.listdir(tmp_path / "run"), METRICS_FILE)) >= 4  # 2+ per session
    data = load_run(str(tmp_path / "run"))
    assert [e.get("resume_from") for e in data.events if e["kind"] == "run_started"] == [None, 9]
    assert len(data.metrics) == 20


@pytest.mark.parametrize("bad", [b"[1, 2]\n", b"42\n{}\n"])
def test_a_line_that_is_not_an_object_is_a_named_error(tmp_path, bad):
    from raylastic.events import CorruptLogError

    (tmp_path / EVENTS_FILE).write_bytes(_lines([_record(0)]) + bad + _lines([_record(1)]))
    with pytest.raises(CorruptLogError, match="line 2 is not a JSON object"):
        load_events(str(tmp_path))
