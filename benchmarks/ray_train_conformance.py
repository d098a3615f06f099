"""Ray Train's own v2 tests, run with Ray's trainer and with ``raylastic.TorchTrainer``.

Why: a user moving a Ray Train script to raylastic relies on what Ray's tests check
(results, checkpoint retention, persistence layout, errors, callbacks, Ray Data). Running
the same test files twice in the same environment, once as Ray ships them and once with
raylastic's trainer substituted, tells which of those behaviours differ, and the pass
counts go to docs/migrating.md.

The test files are Ray's (``python/ray/train/v2/tests/`` of ray-project/ray, the version
matching the installed ray); they are public reference code and are not part of this
repository: fetch them into a directory and pass it with ``--tests``. They need helpers
that the ray wheel does not ship (``ray.train.tests.util``, ``ray.tests.client_test_utils``,
``ray.train.v2.tests.util``, ``ray.data.tests.conftest``'s ``restore_data_context``, the
``mock_s3_bucket_uri`` fixture); this script writes small
stand-ins for them into ``<tests>/_conformance/`` and serves them through a
``sitecustomize`` on ``PYTHONPATH``, so that Ray's worker processes (which import the test
modules to unpickle train functions) find them too. ``ray.train.v2.tests.util`` is taken
from ``<tests>/util.py`` when it is there (else the stand-in has the three names
``test_data_integration.py`` imports).

Substitution (``--trainer ours``): before a test module is imported, in every process,
``ray.train.torch.TorchTrainer`` and ``ray.train.v2.torch.torch_trainer.TorchTrainer`` become
``raylastic.TorchTrainer``, and ``DataParallelTrainer(fn, backend_config=B, ...)`` becomes
``raylastic.TorchTrainer(fn, torch_config=B, ...)``.

Each file runs in its own pytest process with a per-test timeout (Ray's trainer can hang
in ``fit()``: a hung test fails, the file goes on) and a per-file timeout; after each file
the processes it started (they carry a marker in their environment) are killed, so a timed-out
file leaves no Ray cluster behind (``ray stop`` is never run: it would end other clusters).
Every command that starts Ray must hold the project's Ray lock::

    timeout 3600 flock /tmp/raylastic-ray.lock .venv/bin/python benchmarks/ray_train_conformance.py \\
        --tests /tmp/raytests [--trainer both|ray|ours] [--files test_result.py ...]

-> benchmarks/results/ray_train_conformance.json (pass counts per file and trainer, and
the outcome of every test).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import textwrap
import time
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILES = ["test_torch_trainer.py", "test_data_parallel_trainer.py", "test_persistence.py",
                 "test_result.py", "test_data_integration.py", "test_lightning_integration.py"]
OUT = os.path.join(ROOT, "benchmarks", "results", "ray_train_conformance.json")

# -- stand-ins for the helpers the wheel lacks (written by this script, not Ray's code) --

_CLIENT_TEST_UTILS = '''
"""ray.tests.client_test_utils.create_remote_signal_actor: an actor one side waits on
until the other sends."""
import asyncio


def create_remote_signal_actor(ray):
    @ray.remote(num_cpus=0)
    class SignalActor:
        def __init__(self):
            self.ready_event = asyncio.Event()

        def send(self, clear=False):
            self.ready_event.set()
            if clear:
                self.ready_event.clear()

        async def wait(self, should_wait=True):
            if should_wait:
                await self.ready_event.wait()

    return SignalActor
'''

_TRAIN_TESTS_UTIL = '''
"""ray.train.tests.util: a checkpoint holding one pickled dict, and reading it back."""
import contextlib
import os
import pickle
import tempfile

from ray.train import Checkpoint


@contextlib.contextmanager
def create_dict_checkpoint(data, checkpoint_cls=None):
    with tempfile.TemporaryDirectory() as tmpdir:
        with open(os.path.join(tmpdir, "data.pkl"), "wb") as f:
            pickle.dump(data, f)
        yield (checkpoint_cls or Checkpoint).from_directory(tmpdir)


def load_dict_checkpoint(checkpoint):
    with checkpoint.as_directory() as checkpoint_dir:
        with open(os.path.join(checkpoint_dir, "data.pkl"), "rb") as f:
            return pickle.load(f)
'''

_V2_TESTS_UTIL = '''
"""ray.train.v2.tests.util, the three names test_data_integration.py takes from it: a worker
group of mock workers (enough for DatasetsCallback.before_init_train_context), an
ObjectRefWrapper that skips ray.put, and a TrainRunContext with test defaults."""
import dataclasses
from unittest.mock import MagicMock

from ray.train.v2._internal.util import ObjectRefWrapper


class DummyWorkerGroup:
    def __init__(self, train_run_context, worker_group_context, callbacks=None):
        self._num_workers = worker_group_context.num_workers
        self._workers = None

    def _start(self):
        self._workers = [MagicMock() for _ in range(self._num_workers)]

    def get_workers(self):
        assert self._workers is not None, "not started"
        return self._workers

    def shutdown(self):
        self._workers = None


class DummyObjectRefWrapper(ObjectRefWrapper):
    def __init__(self, obj):
        self._obj = obj

    def get(self):
        return self._obj


def create_dummy_run_context(**kwargs):
    from ray.train import BackendConfig, DataConfig
    from ray.train.v2._internal.execution.context import TrainRunContext
    from ray.train.v2.api.config import RunConfig, ScalingConfig

    config = dict(run_config=RunConfig(name="test"), train_loop_config={},
                  scaling_config=ScalingConfig(num_workers=1), backend_config=BackendConfig(),
                  datasets={}, dataset_config=DataConfig())
    config.update(kwargs)
    # (the installed wheel's TrainRunContext may take fewer fields, e.g. 2.60.0 has no datasets)
    accepted = {f.name for f in dataclasses.fields(TrainRunContext) if f.init}
    return TrainRunContext(**{k: v for k, v in config.items() if k in accepted})
'''

_DATA_CONFTEST = '''
"""ray.data.tests.conftest's ``restore_data_context`` fixture: the test may change the
current DataContext; it is put back afterwards."""
import copy

import pytest
from ray.data.context import DataContext


@pytest.fixture
def restore_data_context():
    original = copy.deepcopy(DataContext.get_current())
    yield original
    DataContext._set_current(original)
'''

_PLUGIN = '''
"""pytest plugin: the ``mock_s3_bucket_uri`` fixture of ray's python/ray/tests/conftest.py
(a moto S3 server on localhost with a fresh bucket), and the trainer swap in the pytest
process: pytest's assertion-rewriting import hook sits before sitecustomize's finder and
imports the test modules itself, so the swap must happen here, before collection."""
import logging
import os

import pytest

if os.environ.get("RAYLASTIC_CONFORMANCE") == "ours":
    import sitecustomize

    sitecustomize._swap()


@pytest.fixture
def mock_s3_bucket_uri():
    import boto3
    from ray._common.test_utils import simulate_s3_bucket
    from ray.air._internal.uri_utils import URI

    port, region = 5002, "us-west-2"
    with simulate_s3_bucket(port=port, region=region) as s3_uri:
        s3 = boto3.client("s3", region_name=region, endpoint_url=f"http://localhost:{port}")
        s3.create_bucket(Bucket=URI(s3_uri).name,
                         CreateBucketConfiguration={"LocationConstraint": region})
        logging.getLogger("werkzeug").setLevel(logging.WARNING)
        yield s3_uri
        logging.getLogger("werkzeug").setLevel(logging.INFO)
'''

_SITECUSTOMIZE = '''
"""Serve the helper modules the ray wheel lacks, and (RAYLASTIC_CONFORMANCE=ours) swap
Ray's trainers for raylastic's before any test module is imported, in every process."""
import importlib.abc
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
_TESTS = os.path.dirname(_HERE)
_PACKAGES = {"ray.tests": None, "ray.train.tests": None, "ray.train.v2.tests": None, "ray.data.tests": None}
_MODULES = {
    "ray.tests.client_test_utils": os.path.join(_HERE, "client_test_utils.py"),
    "ray.train.tests.util": os.path.join(_HERE, "train_tests_util.py"),
    "ray.train.v2.tests.util": os.path.join(_HERE, "v2_tests_util.py"),
    "ray.data.tests.conftest": os.path.join(_HERE, "data_tests_conftest.py"),
}
if os.path.exists(os.path.join(_TESTS, "util.py")):
    _MODULES["ray.train.v2.tests.util"] = os.path.join(_TESTS, "util.py")
for _name in ("lightning_test_utils.py",):
    if os.path.exists(os.path.join(_TESTS, _name)):
        _MODULES["ray.train.v2.tests." + _name[:-3]] = os.path.join(_TESTS, _name)
        _MODULES["ray.train.tests." + _name[:-3]] = os.path.join(_TESTS, _name)  # (where the Lightning test imports it)
_patched = False


def _data_parallel_trainer(train_loop_per_worker, *, backend_config=None, **kwargs):
    import raylastic

    return raylastic.TorchTrainer(train_loop_per_worker, torch_config=backend_config, **kwargs)


def _swap():
    global _patched
    if _patched:
        return
    _patched = True
    import ray.train.torch
    import ray.train.v2.api.data_parallel_trainer as dpt
    import ray.train.v2.torch.torch_trainer as v2tt

    import raylastic

    ray.train.torch.TorchTrainer = raylastic.TorchTrainer
    v2tt.TorchTrainer = raylastic.TorchTrainer
    dpt.DataParallelTrainer = _data_parallel_trainer


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in _PACKAGES:
            return importlib.util.spec_from_loader(fullname, _Empty(), is_package=True)
        if fullname in _MODULES:
            return importlib.util.spec_from_file_location(fullname, _MODULES[fullname])
        if (os.environ.get("RAYLASTIC_CONFORMANCE") == "ours" and fullname.startswith("test_")
                and os.path.exists(os.path.join(_TESTS, fullname + ".py"))):
            _swap()
        return None


class _Empty(importlib.abc.Loader):
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []


sys.meta_path.insert(0, _Finder())
'''


def write_support(tests_dir: str) -> str:
    """Write the stand-ins into ``<tests>/_conformance`` and return that directory."""
    support = os.path.join(tests_dir, "_conformance")
    os.makedirs(support, exist_ok=True)
    for name, text in (("client_test_utils.py", _CLIENT_TEST_UTILS), ("train_tests_util.py", _TRAIN_TESTS_UTIL),
                       ("v2_tests_util.py", _V2_TESTS_UTIL), ("data_tests_conftest.py", _DATA_CONFTEST),
                       ("conformance_plugin.py", _PLUGIN), ("sitecustomize.py", _SITECUSTOMIZE)):
        with open(os.path.join(support, name), "w") as f:
            f.write(textwrap.dedent(text).lstrip())
    return support


_LINE_RE = re.compile(r"^(\S+\.py::\S+)\s+(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def parse_outcomes(output: str) -> Dict[str, str]:
    """``{test id: outcome}`` from pytest ``-v`` output (``-rA`` summary lines included).
    Ray Data progress bars end lines with ``\\r``, so a result can start mid-line."""
    outcomes: Dict[str, str] = {}
    for raw in output.replace("\r", "\n").splitlines():
        line = raw.strip()
        m = _LINE_RE.match(line)
        if m:
            outcomes.setdefault(m.group(1), m.group(2))
            continue
        for word in ("PASSED", "FAILED", "ERROR", "SKIPPED"):  # -rA summary: "PASSED file::test"
            if line.startswith(word + " ") and "::" in line:
                test_id = line.split()[1]
                if word == "PASSED" or test_id not in outcomes:
                    outcomes[test_id] = word
    return outcomes


_MARK = "RAYLASTIC_CONFORMANCE_RUN"


def _kill_marked(run_id: str = "") -> int:
    """SIGKILL the processes that carry this harness's marker in their environment (the
    pytest process of a file and every Ray process it started: they inherit it), for one
    file's ``run_id`` or, with "", those any earlier run of this harness left behind.
    Never ``ray stop``: other Ray clusters on this machine are not ours to end."""
    import signal

    want = f"{_MARK}={run_id}".encode() if run_id else f"{_MARK}=".encode()
    killed = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(want) and (run_id == "" or e == want) for e in env):
            try:
                os.kill(int(pid), signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def run_file(tests_dir: str, support: str, name: str, trainer: str, file_timeout_s: int,
             test_timeout_s: int, log_dir: str, src: str = ROOT) -> Dict[str, object]:
    env = dict(os.environ)
    env["PYTHONPATH"] = support + os.pathsep + src
    env["RAYLASTIC_CONFORMANCE"] = trainer
    env.setdefault("HF_HUB_OFFLINE", "1")
    run_id = f"{os.getpid()}-{time.time_ns()}"
    env[_MARK] = run_id
    cmd = [sys.executable, "-m", "pytest", "-v", "-rA", "-p", "conformance_plugin", "-p", "no:cacheprovider",
           f"--timeout={test_timeout_s}", name]
    _kill_marked()  # what an earlier, killed run of this harness left
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=tests_dir, env=env, capture_output=True, text=True, timeout=file_timeout_s)
        output, timed_out, rc = proc.stdout + proc.stderr, False, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        timed_out, rc = True, None
    wall_s = time.monotonic() - start
    time.sleep(2)
    _kill_marked(run_id)  # a killed or crashed run can leave its Ray cluster behind; the next file needs the CPUs
    with open(os.path.join(log_dir, f"{name[:-3]}.{trainer}.{os.path.basename(src.rstrip(os.sep))}.log"), "w") as f:
        f.write(output)
    outcomes = parse_outcomes(output)
    collected = re.search(r"collected (\d+) items?", output)
    return {
        "tests": int(collected.group(1)) if collected else len(outcomes),
        "passed": sum(1 for o in outcomes.values() if o == "PASSED"),
        "skipped": sum(1 for o in outcomes.values() if o == "SKIPPED"),
        "timed_out": timed_out, "returncode": rc, "wall_s": round(wall_s, 1),
        "raylastic_src": src if trainer == "ours" else None,
        "outcomes": dict(sorted(outcomes.items())),
    }


def main(argv: List[str] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tests", required=True, help="directory holding Ray's v2 test files (and conftest.py)")
    ap.add_argument("--files", nargs="*", default=None, help="test files to run (default: those present of "
                    + ", ".join(DEFAULT_FILES) + ")")
    ap.add_argument("--trainer", choices=("both", "ray", "ours"), default="both")
    ap.add_argument("--file-timeout", type=int, default=1500, help="seconds per file and trainer")
    ap.add_argument("--test-timeout", type=int, default=300, help="seconds per test (pytest-timeout)")
    ap.add_argument("--out", default=OUT)
    ap.add_argument("--raylastic-src", default=ROOT, help="directory holding the raylastic package to test "
                    "(a copy of an earlier tree gives 'before' numbers)")
    ap.add_argument("--label", default="", help="key prefix for the results, e.g. 'before:'")
    ap.add_argument("--ray-commit", default="", help="the ray-project/ray commit(s) the files were taken from")
    args = ap.parse_args(argv)
    tests_dir = os.path.abspath(args.tests)
    files = args.files or [f for f in DEFAULT_FILES if os.path.exists(os.path.join(tests_dir, f))]
    support = write_support(tests_dir)
    log_dir = os.path.join(tests_dir, "_conformance", "logs")
    os.makedirs(log_dir, exist_ok=True)
    trainers = ["ray", "ours"] if args.trainer == "both" else [args.trainer]
    previous_doc: Dict[str, object] = {}
    if os.path.exists(args.out):  # keep the other files' (and trainers') earlier numbers and notes
        with open(args.out) as f:
            previous_doc = json.load(f)
    results = dict(previous_doc.get("files", {}))  # type: ignore[call-overload]
    for name in files:
        for trainer in trainers:
            res = run_file(tests_dir, support, name, trainer, args.file_timeout, args.test_timeout, log_dir,
                           os.path.abspath(args.raylastic_src))
            results.setdefault(name, {})[args.label + trainer] = res
            print(f"{name:36s} {trainer:5s} {res['passed']}/{res['tests']} passed"
                  f"{' (timed out)' if res['timed_out'] else ''} in {res['wall_s']:.0f} s", flush=True)
    import ray
    import torch

    doc = {
        **previous_doc,
        "what": "Ray Train 2.60 v2 test files run with Ray's trainer ('ray') and with raylastic.TorchTrainer "
                "substituted ('ours'), in the same environment",
        "ray": ray.__version__, "ray_commit_installed": ray.__commit__,
        "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
        "files": results,
        "totals": {t: {"passed": sum(r[t]["passed"] for r in results.values() if t in r),
                       "tests": sum(r[t]["tests"] for r in results.values() if t in r)}
                   for t in sorted({k for r in results.values() for k in r})},
    }
    if args.ray_commit:
        doc["test_files_from"] = args.ray_commit
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc["totals"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
