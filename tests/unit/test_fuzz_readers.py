"""Fuzzing every reader of a file a run leaves behind (security issue 22, item 5).

Those files are data from a store (possibly damaged, possibly written by someone else):
the event log and metrics (``read_jsonl``, ``load_events``, ``load_run`` and the report
built from it, ``raylastic report`` with and without ``--json``), a checkpoint's manifest
(``committed_checkpoints`` over local storage and an in-memory store), and a spot trace
CSV (``parse_trace``, ``load_trace``). Inputs start from real files (the fixture run of a
``make demo``, a manifest as a commit writes it, a shipped trace) and are damaged: cut
anywhere, bytes replaced, invalid UTF-8, lines dropped or swapped, fields given other
types, huge numbers, NaN and infinities. Allowed outcomes: a correct result, or the
reader's own named error (for the CLI: exit 2 and one line on stderr). Never another
exception, and the files read are byte-identical afterwards (nothing deleted or written).
Deterministic (``derandomize=True``, no example database): CI runs the same 2,640 cases
every time, about 12 s on a 2-core machine."""

from __future__ import annotations

import io
import json
import os
import shutil
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from raylastic.checkpoint.manager import MANIFEST, CommittedCheckpoint, committed_checkpoints
from raylastic.checkpoint.storage import Storage
from raylastic.events import (
    EVENTS_FILE, METRICS_FILE, CorruptLogError, EventKind, LossCause, load_events, load_log, read_jsonl,
)
from raylastic.reporting import JSON_KEYS, NotARunError, build_report, load_run
from raylastic.reporting.cli import main as report_main
from raylastic.reporting.loading import _captured_warnings
from raylastic.reporting.render import render_text
from raylastic.sim.trace import Trace, TraceFormatError, load_trace, parse_trace, shipped_trace_path

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "demo_spot_return")
# Generated cases per fuzz test (2,640 in all; the @example cases come on top).
CASES = {"read_jsonl": 500, "load_events_and_load_log": 300, "load_run_and_build_report": 600,
         "report_cli": 400, "manifest_readers": 420, "trace_readers": 420}


def _fuzz(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


EVENTS = Path(FIXTURE, EVENTS_FILE).read_bytes()
METRICS = Path(FIXTURE, METRICS_FILE).read_bytes()
TRACE = shipped_trace_path("long").read_bytes()
CKPT = "run/checkpoints/checkpoint_00000005-e1"
MANIFEST_OK = json.dumps({
    "schema_version": 1, "index": 5, "epoch": 1, "world_size": 2, "ts": 1_795_508_500.25,
    "files": [["model.pt", 3], ["shards/rank-1.pt", 2]], "metrics": {"loss": 0.5, "step": 5},
    "ranks_with_files": [0, 1]}).encode()

# ----------------------------------------------------------------------------- damage

# Field names the readers look at, besides those each record already has.
FIELDS = ("ts", "kind", "index", "epoch", "world_size", "metrics", "report_ts", "restore_index",
          "reached_index", "lost_steps", "bytes", "resize_s", "stage_s", "wait_s", "upload_s",
          "sync_s", "async_s", "node_id", "wid", "node_type", "market", "nodes", "cause", "graceful",
          "usd_per_hour", "markets", "on_demand_type", "state", "message", "error", "files",
          "schema_version")
HUGE = ["1e999", "-1e999", "NaN", "Infinity", "-Infinity", "9" * 5000, "1" + "0" * 400,
        "9223372036854775808", "-1", "0", "1e308", "true", '"\\udc80"', '"\\u001b[2J"',
        "[" * 3000 + "]" * 3000, "[" * 600 + "]" * 600, '{"a": ' * 400 + "1" + "}" * 400]
PLACEHOLDER = "\u0000fuzz\u0000"
BAD_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80"]

weird_values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8),
    st.lists(st.one_of(st.integers(), st.text(max_size=3)), max_size=3),
    st.dictionaries(st.text(max_size=4), st.one_of(st.integers(), st.floats()), max_size=2),
).map(json.dumps)
tokens = st.one_of(weird_values, st.sampled_from(HUGE))


def _set_field(line: bytes, key: str, token: str) -> bytes:
    """``line`` (a JSON object) with ``key`` set to the raw JSON text ``token``; a key
    "metrics.loss" sets the value inside the nested metrics object."""
    try:
        rec = json.loads(line)
    except (ValueError, RecursionError):  # damaged by an earlier step
        return line
    if not isinstance(rec, dict):
        return line
    if key == "metrics.loss" and isinstance(rec.get("metrics"), dict):
        rec["metrics"]["loss"] = PLACEHOLDER
    else:
        rec[key] = PLACEHOLDER
    text = json.dumps(rec).replace(json.dumps(PLACEHOLDER), token)
    return text.encode("utf-8", "surrogatepass") + (b"\n" if line.endswith(b"\n") else b"")


@st.composite
def damaged(draw, original: bytes, max_steps: int = 3) -> bytes:
    """``original`` (lines of text) with 1-``max_steps`` kinds of damage applied."""
    lines = original.splitlines(keepends=True)
    for _ in range(draw(st.integers(1, max_steps))):
        how = draw(st.sampled_from(["field", "field", "field", "field", "cut", "bytes", "utf8",
                                    "insert", "drop", "swap"]))
        i = draw(st.integers(0, max(0, len(lines) - 1)))
        if not lines:
            lines = [b""]
        if how == "field":
            keys = sorted(FIELDS) + ["metrics.loss"]
            lines[i] = _set_field(lines[i], draw(st.sampled_from(keys)), draw(tokens))
        elif how == "cut":  # a crash mid-write, or a partial download
            data = b"".join(lines)
            lines = [data[:draw(st.integers(0, len(data)))]]
        elif how in ("bytes", "utf8"):  # random bytes over a slice; or a bad UTF-8 sequence
            line = lines[i]
            a = draw(st.integers(0, len(line)))
            b = draw(st.integers(a, min(len(line), a + 16))) if how == "bytes" else a
            new = draw(st.binary(max_size=16) if how == "bytes" else st.sampled_from(BAD_UTF8))
            lines[i] = line[:a] + new + line[b:]
        elif how == "insert":
            lines.insert(i, draw(st.one_of(st.binary(max_size=40), st.text(max_size=40).map(
                lambda t: t.encode("utf-8", "surrogatepass")))) + b"\n")
        elif how == "drop":
            del lines[i]
        else:
            j = draw(st.integers(0, max(0, len(lines) - 1)))
            lines[i], lines[j] = lines[j], lines[i]
    return b"".join(lines)


def any_bytes(original: bytes):  # mostly a damaged file, sometimes noise
    return st.one_of(damaged(original), damaged(original), damaged(original), st.binary(max_size=300))


WORDS = sorted({k.value for k in EventKind} | {c.value for c in LossCause} | {
    "prices", "Scheduling", "Running", "Resizing", "Finished", "Errored", "spot", "on_demand",
    "default", "stop_at", "error", "formation", "n1", "n2", ""})


def _same_type(value):
    """Values of the type ``value`` has: what a log of a stranger run could hold."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.one_of(st.integers(-2, 60), st.integers(-(2**63) + 1, 2**63 - 1))
    if isinstance(value, float):
        return st.one_of(st.floats(-1e13, 1e13), st.floats(-100, 100).map(lambda d: value + d))
    if isinstance(value, str):
        return st.one_of(st.sampled_from(WORDS), st.text(max_size=6))
    if isinstance(value, list):
        return st.permutations(value).flatmap(lambda v: st.integers(0, len(v)).map(lambda n: v[:n]))
    return st.just(value)


@st.composite
def reshaped(draw, original: bytes) -> bytes:
    """``original`` with records dropped, repeated, reordered, re-kinded, or with values
    replaced by others of the same type: every field stays well-typed, so the records get
    past the loader's checks and exercise the report's passes."""
    records = [json.loads(line) for line in original.splitlines()]
    for _ in range(draw(st.integers(1, 6))):
        how = draw(st.sampled_from(["value", "value", "value", "kind", "drop", "dup", "swap"]))
        i, j = draw(st.integers(0, len(records) - 1)), draw(st.integers(0, len(records) - 1))
        if how == "value":
            key = draw(st.sampled_from(sorted(records[i])))
            records[i] = dict(records[i], **{key: draw(_same_type(records[i][key]))})
        elif how == "kind" and "kind" in records[i]:
            records[i] = dict(records[i], kind=draw(st.sampled_from(WORDS)))
        elif how == "drop" and len(records) > 1:
            del records[i]
        elif how == "dup":
            records.insert(j, records[i])
        else:
            records[i], records[j] = records[j], records[i]
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def run_files(original: bytes):
    return st.one_of(any_bytes(original), reshaped(original), reshaped(original))


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fuzz"))


def _fresh(root: str, files: dict) -> str:
    """``root`` emptied, then holding ``files`` (relative path -> bytes)."""
    shutil.rmtree(root, ignore_errors=True)
    for rel, data in files.items():
        path = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    return root


def _snapshot(root: str) -> dict:
    """Every file under ``root`` and its bytes: equal before and after = nothing touched."""
    return {os.path.relpath(os.path.join(d, n), root): Path(d, n).read_bytes()
            for d, _, names in os.walk(root) for n in names}


def _check_records(records, required=()) -> None:
    assert isinstance(records, list) and all(
        isinstance(r, dict) and all(k in r for k in required) for r in records)


# ----------------------------------------------------------------------------- event logs

@_fuzz(CASES["read_jsonl"])
@given(any_bytes(EVENTS))
@example(b'{"ts": 1}\n' + b"[" * 100_000 + b"\n{}\n")
@example(b'{"ts": 1, "kind": "x"}\n{"index": ' + b"9" * 5000 + b"}\n{}\n")
def test_read_jsonl(data):
    try:
        records = list(read_jsonl(data.decode("utf-8", "replace"), "events.jsonl"))
    except CorruptLogError as e:
        assert "events.jsonl line " in str(e)
        event("CorruptLogError")
        return
    _check_records(records)
    event("records")


@_fuzz(CASES["load_events_and_load_log"])
@given(any_bytes(EVENTS), any_bytes(METRICS))
def test_load_events_and_load_log(workdir, events, metrics):
    run = _fresh(workdir, {EVENTS_FILE: events, "events.2.jsonl": events[: len(events) // 3],
                           METRICS_FILE: metrics})
    before = _snapshot(run)
    for read in (load_events, lambda path: load_log(path, METRICS_FILE)):
        try:
            _check_records(read(run))
        except CorruptLogError:
            pass
    assert _snapshot(run) == before


def _check_report(data) -> None:
    """A report can be built, printed as strict JSON and rendered from what load_run read."""
    _check_records(data.events, ("ts", "kind"))
    _check_records(data.metrics, ("ts", "index"))
    report = build_report(data.events, data.metrics, run_path=data.path, notes=data.notes)
    doc = report.to_json()
    assert list(doc) == list(JSON_KEYS)
    json.dumps(doc, allow_nan=False)
    render_text(report).encode("utf-8", "backslashreplace")


@_fuzz(CASES["load_run_and_build_report"])
@given(run_files(EVENTS), run_files(METRICS))
@example(EVENTS.replace(b'"epoch": 1,', b'"epoch": "1",', 1), METRICS)
@example(EVENTS, METRICS.replace(b'"loss": ', b'"loss": 1' + b"0" * 400 + b', "x": ', 1))
@example(EVENTS.replace(b'"markets": {', b'"markets": [1, 2], "m": {', 1), METRICS)
def test_load_run_and_build_report(workdir, events, metrics):
    run = _fresh(workdir, {EVENTS_FILE: events, METRICS_FILE: metrics})
    before = _snapshot(run)
    try:
        data = load_run(run)
    except (NotARunError, CorruptLogError) as e:
        event(type(e).__name__)
    else:
        _check_report(data)
        event("report built")
    assert _snapshot(run) == before


def _cli(argv):
    """main(argv) with stdout/stderr as a terminal's: UTF-8, strict (a lone surrogate fails)."""
    out, err = io.TextIOWrapper(io.BytesIO(), "utf-8"), io.TextIOWrapper(io.BytesIO(), "utf-8")
    with redirect_stdout(out), redirect_stderr(err):
        rc = report_main(argv)
    out.flush(), err.flush()
    return rc, out.buffer.getvalue().decode(), err.buffer.getvalue().decode()


@_fuzz(CASES["report_cli"])
@given(run_files(EVENTS), run_files(METRICS), st.booleans())
@example(EVENTS.replace(b'"ts": ', b'"ts": 1e999, "t": ', 1), METRICS, True)
def test_report_cli(workdir, events, metrics, as_json):
    run = _fresh(workdir, {EVENTS_FILE: events, METRICS_FILE: metrics})
    before = _snapshot(run)
    rc, out, err = _cli([run, "--json"] if as_json else [run])
    event(f"exit {rc}")
    assert "Traceback" not in err
    if rc == 2:
        assert out == "" and err.count("\n") == 1, err
        assert err.startswith("raylastic report: error: ") and "internal error" not in err, err
    else:
        assert rc == 0, err
        assert all(ln.startswith("raylastic report: warning: ") for ln in err.splitlines()), err
        if as_json:
            def strict(name):
                raise AssertionError(f"not strict JSON: {name}")
            assert list(json.loads(out, parse_constant=strict)) == list(JSON_KEYS)
        else:
            assert out.startswith(f"raylastic report: {run}")
    assert _snapshot(run) == before


# ----------------------------------------------------------------------------- manifests

class _MemoryStore(dict):
    """The two ``Storage`` methods that listing checkpoints uses, over a dict in memory."""

    def list_dir(self, rel=""):
        prefix = rel.strip("/") + "/"
        return sorted({k[len(prefix):].split("/", 1)[0] for k in self if k.startswith(prefix)})

    def read_bytes(self, rel):
        if rel not in self:
            raise FileNotFoundError(rel)
        return self[rel]


def _valid_checkpoint(c: CommittedCheckpoint) -> None:
    for v in (c.index, c.epoch, c.world_size):
        assert type(v) is int and v >= 0
    assert type(c.ts) is float and c.ts - c.ts == 0
    assert isinstance(c.metrics, dict)
    for f in c.files:
        assert len(f) == 2 and isinstance(f[0], str) and type(f[1]) is int and f[1] >= 0
        assert all(p not in ("", ".", "..") for p in f[0].split("/"))
    assert c.num_bytes >= 0


def _committed(storage):
    """committed_checkpoints(), each result checked; a skipped manifest warned about."""
    with _captured_warnings() as warnings:
        found = committed_checkpoints(storage, "run")
    assert len(found) <= 1
    for c in found:
        _valid_checkpoint(c)
    if not found:
        assert any("corrupt manifest" in w for w in warnings)  # skipped, never silently
    return found


CORRUPT_MANIFESTS = [
    ("index", "1e999"), ("index", "true"), ("index", "-1"), ("index", '"5"'), ("index", "5.0"),
    ("epoch", "null"), ("world_size", "[]"), ("ts", "NaN"), ("ts", '"now"'), ("ts", "1e999"),
    ("ts", "1" + "0" * 400), ("files", '"model.pt"'), ("files", '[["model.pt"]]'),
    ("files", '[["model.pt", -1]]'), ("files", '[["../x", 1]]'), ("files", '[[1, 2]]'),
    ("files", '[["a", true]]'), ("files", '[["a//b", 1]]'), ("files", '[["\\ud800x", 1]]'),
    ("metrics", "[]"), ("index", "9" * 5000),
]


@pytest.mark.parametrize("field, token", CORRUPT_MANIFESTS,
                         ids=[f"{f}={t[:12]}" for f, t in CORRUPT_MANIFESTS])
def test_a_wrong_typed_manifest_is_corrupt_and_skipped(tmp_path, field, token):
    """The low finding: ``"index": 1e999`` raised OverflowError out of the listing; a
    wrong-typed field (a bool index, a file list of strings) crashed later or not at all."""
    manifest = _set_field(MANIFEST_OK, field, token)
    root = _fresh(str(tmp_path), {f"{CKPT}/{MANIFEST}": manifest, f"{CKPT}/model.pt": b"abc"})
    assert _committed(Storage(root)) == []
    assert Path(root, *CKPT.split("/"), MANIFEST).read_bytes() == manifest  # left for a human


@pytest.mark.parametrize("raw", [b"[]", b'"x"', b"null", b"[" * 100_000, b"\xff\xfe", b""])
def test_a_manifest_that_is_not_an_object_is_corrupt(tmp_path, raw):
    storage = Storage(str(_fresh(str(tmp_path), {f"{CKPT}/{MANIFEST}": raw})))
    assert _committed(storage) == []


def test_a_valid_manifest_still_reads(tmp_path):
    storage = Storage(str(_fresh(str(tmp_path), {f"{CKPT}/{MANIFEST}": MANIFEST_OK})))
    (c,) = _committed(storage)
    assert (c.index, c.epoch, c.world_size, c.num_bytes) == (5, 1, 2, 5)
    assert c.files == [("model.pt", 3), ("shards/rank-1.pt", 2)] and c.metrics["loss"] == 0.5


@_fuzz(CASES["manifest_readers"])
@given(any_bytes(MANIFEST_OK + b"\n"))
@example(MANIFEST_OK.replace(b"shards/", b"\xed\xa0\x80shards/"))  # json.loads(bytes): surrogatepass
def test_manifest_readers(workdir, data):
    files = {f"{CKPT}/{MANIFEST}": data, f"{CKPT}/model.pt": b"abc"}
    root = _fresh(workdir, files)
    before = _snapshot(root)
    local, memory = _committed(Storage(root)), _committed(_MemoryStore(files))
    assert [(c.index, c.epoch, c.files) for c in local] == [(c.index, c.epoch, c.files) for c in memory]
    for c in local:  # what a restore does next with it: stat every file it names
        if c.files:  # (as CheckpointManager._verify: file_sizes([]) is an IndexError)
            Storage(root).file_sizes([f"{c.rel}/{f[0]}" for f in c.files])
    event("committed" if local else "skipped")
    assert _snapshot(root) == before


# ----------------------------------------------------------------------------- traces

def _check_trace(trace: Trace) -> None:
    times = [e.time_s for e in trace.events]
    assert times == sorted(times) and all(type(t) is float and 0 <= t < float("inf") for t in times)
    for e in trace.events:
        assert type(e.count) is int and (e.notice_s is None or 0 <= e.notice_s < float("inf"))
    trace.capacity_at("spot", trace.duration_s)
    trace.due(float("-inf"), trace.duration_s)
    try:
        trace.check_node_types(["spot", "on_demand"])
    except TraceFormatError:
        pass


trace_cells = st.one_of(st.sampled_from(["", "-1", "0", "1e999", "nan", "inf", "-0", "9" * 5000,
                                         "capacity", "add", "preempt", "spot", '"', "a,b", "\x00",
                                         "1_000", "\u0661", " 5 "]),
                        st.text(max_size=6))


@st.composite
def damaged_trace(draw) -> bytes:
    """The shipped "long" trace with cells replaced, or any damage of its bytes."""
    if draw(st.booleans()):
        return draw(damaged(TRACE))
    lines = TRACE.decode().split("\n")
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        cells = lines[i].split(",")
        cells[draw(st.integers(0, len(cells) - 1))] = draw(trace_cells)
        lines[i] = ",".join(cells)
    return "\n".join(lines).encode("utf-8", "surrogatepass")


@_fuzz(CASES["trace_readers"])
@given(st.one_of(damaged_trace(), st.binary(max_size=200)))
def test_trace_readers(workdir, data):
    path = _fresh(workdir, {"t.csv": data}) + "/t.csv"
    try:
        _check_trace(load_trace(path))
        event("trace")
    except TraceFormatError as e:
        assert str(e).startswith(f"{path}:")
        event("TraceFormatError")
    try:
        _check_trace(parse_trace(data.decode("utf-8", "surrogateescape"), "t.csv"))
    except TraceFormatError as e:
        assert str(e).startswith("t.csv:")
    assert Path(path).read_bytes() == data


def test_the_fuzz_cases_add_up():
    assert sum(CASES.values()) >= 2000  # the bar (the @example cases not counted)
