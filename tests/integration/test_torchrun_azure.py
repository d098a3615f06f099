"""End to end: real ``torchrun`` agents, ``--rdzv-backend=azure-table``, against Azurite.

Three agents on this machine (each ``--nproc-per-node=1``, its own process group) run
examples/torchrun_azure/train.py with ``--nnodes=2:3``: training starts with 2, grows to 3 when
the third agent starts, survives SIGKILL of the first agent and its worker (usually rank 0), and
finishes. The pace is set by events, not sleeps: the script's ``--hold-file`` makes rank 0 wait
before a step until the test raises the limit, so each phase is observed before the next begins.
Every agent gets the same state key (``RAYLASTIC_RDZV_HMAC_KEY``) through its environment, as on
a real job; without one torchrun fails at startup naming the fix.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import psutil
import pytest

from raylastic.testing.azurite import Azurite, find_azurite

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "examples" / "torchrun_azure" / "train.py"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEPS = 14
# Tight rendezvous timings so membership changes settle in seconds (defaults are minutes).
RDZV_CONF = (
    "join_timeout=60,last_call_timeout=1,close_timeout=10,heartbeat_timeout=5,"
    "keep_alive_interval=1,keep_alive_max_attempt=3,read_timeout=30,retry_timeout=10"
)
ENTRY_POINT_HELP = (
    'add to pyproject.toml:  [project.entry-points."torchrun.handlers"]\n'
    '                        azure-table = "raylastic.rendezvous.azure_table:torchrun_handler"\n'
    "then reinstall: .venv/bin/pip install --no-deps -e ."
)
KEY_ENV = "RAYLASTIC_RDZV_HMAC_KEY"
INSECURE_ENV = "RAYLASTIC_RDZV_INSECURE_NO_HMAC"
# The job's state key (docs/security.md): fixed, 64 hex characters, as
# `python -c 'import secrets; print(secrets.token_hex(32))'` makes them.
TEST_HMAC_KEY = "5f0c2a9e7b41d8c3e6a1f09b2d7c4e85a3b6f1d0c9e8a7b2f4d1c6e3a0b9f8d7"

pytestmark = pytest.mark.skipif(find_azurite() is None, reason="azurite not installed (make install)")


@pytest.fixture(autouse=True)
def _rdzv_state_key(monkeypatch):
    """The key every agent of a test's job shares; ``_clean_env`` passes it to the agents."""
    monkeypatch.setenv(KEY_ENV, TEST_HMAC_KEY)
    monkeypatch.delenv(INSECURE_ENV, raising=False)


@pytest.fixture(scope="module")
def azurite():
    with Azurite() as az:
        yield az


def _require_entry_point() -> None:
    names = {ep.name for ep in entry_points(group="torchrun.handlers")}
    if "azure-table" not in names:
        pytest.fail(f"torchrun cannot find --rdzv-backend=azure-table: {ENTRY_POINT_HELP}")


def _clean_env(**extra: str) -> dict:
    """The agents' environment: no ambient Azure credentials, no insecure opt-out, and the state
    key (set by ``_rdzv_state_key``) passed through, so all agents of a job share it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AZURE_STORAGE_") and k != INSECURE_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **{KEY_ENV: os.environ[KEY_ENV]})
    env.update(extra)
    return env


class Agents:
    """torchrun agents, each in its own process group; ``close()`` leaves no process behind."""

    def __init__(self, tmp: Path, azurite: Azurite) -> None:
        self.tmp = tmp
        self.run_id = f"e2e-{uuid.uuid4().hex[:10]}"
        self.log = tmp / "train.jsonl"
        self.hold = tmp / "hold"
        self.ckpt = tmp / "ckpt"
        self.env = _clean_env(AZURE_STORAGE_CONNECTION_STRING=azurite.connection_string)
        self.endpoint = azurite.table_endpoint
        self.procs: dict[str, subprocess.Popen] = {}
        self.set_hold(0)

    def set_hold(self, limit: int) -> None:
        tmp = self.hold.with_suffix(".tmp")
        tmp.write_text(str(limit))
        os.replace(tmp, self.hold)

    def start(self, name: str) -> None:
        cmd = [
            TORCHRUN, "--nnodes=2:3", "--nproc-per-node=1", "--rdzv-backend=azure-table",
            f"--rdzv-endpoint={self.endpoint}", f"--rdzv-id={self.run_id}", f"--rdzv-conf={RDZV_CONF}",
            "--max-restarts=5", "--monitor-interval=0.2", "--local-addr=127.0.0.1",
            str(TRAIN), "--steps", str(STEPS), "--checkpoint", str(self.ckpt), "--train-log", str(self.log),
            "--hold-file", str(self.hold), "--pg-timeout", "60",
        ]
        out = open(self.tmp / f"agent-{name}.log", "wb")
        self.procs[name] = subprocess.Popen(
            cmd, cwd=REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        out.close()

    def records(self, event: str) -> list:
        if not self.log.exists():
            return []
        lines = self.log.read_text().splitlines()
        return [r for r in (json.loads(line) for line in lines if line.strip()) if r["event"] == event]

    def output(self) -> str:
        parts = []
        for name in self.procs:
            text = (self.tmp / f"agent-{name}.log").read_text(errors="replace")
            parts.append(f"--- agent {name} (last 3000 chars) ---\n{text[-3000:]}")
        parts.append(f"--- {self.log.name} ---\n" + (self.log.read_text() if self.log.exists() else ""))
        return "\n".join(parts)

    def wait_for(self, what: str, predicate, timeout: float = 90.0, alive: tuple = ()) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            for name in alive:
                if self.procs[name].poll() is not None:
                    pytest.fail(f"agent {name} exited ({self.procs[name].returncode}) while waiting for "
                                f"{what}\n{self.output()}")
            time.sleep(0.1)
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{self.output()}")

    def kill(self, name: str) -> None:
        """SIGKILL the agent's process group and its workers (they run in their own sessions)."""
        proc = self.procs[name]
        try:
            victims = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            victims = []
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for child in victims:
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait(timeout=10)
        psutil.wait_procs(victims, timeout=10)

    def close(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is None:
                self.kill(name)


def _world_sizes(steps: list) -> list:
    seen: list = []
    for record in sorted(steps, key=lambda r: r["step"]):
        if not seen or seen[-1] != record["world_size"]:
            seen.append(record["world_size"])
    return seen


def test_torchrun_grows_shrinks_and_finishes(azurite, tmp_path):
    _require_entry_point()
    agents = Agents(tmp_path, azurite)
    try:
        # Phase 1: two agents meet the minimum; train to step 4 at world size 2.
        agents.set_hold(4)
        agents.start("a")
        agents.start("b")
        agents.wait_for("4 steps at world size 2",
                        lambda: any(r["step"] == 4 and r["world_size"] == 2 for r in agents.records("step")),
                        alive=("a", "b"))
        # Phase 2: a third agent joins; the running group restarts at world size 3 from step 4.
        agents.start("c")
        agents.wait_for("3 workers started at world size 3",
                        lambda: len([r for r in agents.records("start") if r["world_size"] == 3]) >= 3,
                        alive=("a", "b", "c"))
        agents.set_hold(8)
        agents.wait_for("step 8 at world size 3",
                        lambda: any(r["step"] == 8 and r["world_size"] == 3 for r in agents.records("step")),
                        alive=("a", "b", "c"))
        # Phase 3: SIGKILL agent a and its worker (the lowest pid: rank 0 of the rendezvous).
        victim_ranks = [r["rank"] for r in agents.records("start")
                        if r["world_size"] == 3 and r["agent_pid"] == agents.procs["a"].pid]
        agents.kill("a")
        agents.set_hold(STEPS)
        for name in ("b", "c"):
            try:
                rc = agents.procs[name].wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"agent {name} did not finish\n{agents.output()}")
            assert rc == 0, f"agent {name} exited {rc}\n{agents.output()}"

        steps = agents.records("step")
        assert _world_sizes(steps) == [2, 3, 2], agents.output()
        assert max(r["step"] for r in steps) == STEPS
        assert {r["step"] for r in steps} == set(range(1, STEPS + 1)), "a step was skipped"
        assert (agents.ckpt / "LATEST").read_text() == f"ckpt-{STEPS:08d}.pt"
        restarts = [r for r in agents.records("start") if r["world_size"] == 2 and r["resumed_step"] >= 8]
        assert len(restarts) == 2, "both survivors resume from the step-8 checkpoint or later"
        for name in agents.procs:
            log = (tmp_path / f"agent-{name}.log").read_text(errors="replace")
            assert TEST_HMAC_KEY not in log, f"agent {name} logged the state key"
        print(f"killed agent a (rank {victim_ranks}); world sizes {_world_sizes(steps)}")
    finally:
        agents.close()


@pytest.mark.parametrize(
    "case, endpoint, env, expected",
    [
        ("not an Azure URL", "10.0.0.1:29400", {"AZURE_STORAGE_ACCOUNT_KEY": "a2V5"},
         ["is not an Azure Table URL", "--rdzv-backend=c10d"]),
        ("missing credentials", None, {}, ["no storage credentials", "AZURE_STORAGE_CONNECTION_STRING"]),
        ("unknown account", "https://nosuchacct4raylastic.table.core.windows.net",
         {"AZURE_STORAGE_ACCOUNT_KEY": "a2V5"}, ["cannot resolve", "check the storage account name"]),
    ],
)
def test_torchrun_bad_input_names_the_fix(azurite, tmp_path, case, endpoint, env, expected):
    _require_entry_point()
    cmd = [
        TORCHRUN, "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=azure-table",
        f"--rdzv-endpoint={endpoint or azurite.table_endpoint}", "--rdzv-id=bad-input",
        str(TRAIN), "--checkpoint", str(tmp_path / "ckpt"),
    ]
    result = subprocess.run(cmd, cwd=REPO, env=_clean_env(**env), capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    for text in expected:
        assert text in output, f"{case}: {text!r} missing from:\n{output[-3000:]}"
    assert "a2V5" not in output, "a credential was logged"
    assert TEST_HMAC_KEY not in output, "the state key was logged"


@pytest.mark.parametrize(
    "key, expected",
    [("", "needs a state key"), ("short-key-0123", "too short to be a key")],
    ids=["missing", "short"],
)
def test_torchrun_without_a_usable_state_key_names_the_fix(azurite, tmp_path, key, expected):
    """The endpoint and credentials are fine; the agent refuses to start without the job's key
    and says how to make one, never echoing what it was given."""
    _require_entry_point()
    cmd = [
        TORCHRUN, "--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=azure-table",
        f"--rdzv-endpoint={azurite.table_endpoint}", "--rdzv-id=no-key",
        str(TRAIN), "--checkpoint", str(tmp_path / "ckpt"),
    ]
    env = _clean_env(AZURE_STORAGE_CONNECTION_STRING=azurite.connection_string, **{KEY_ENV: key})
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    for text in (expected, KEY_ENV, "secrets.token_hex(32)", f"{INSECURE_ENV}=1"):
        assert text in output, f"{text!r} missing from:\n{output[-3000:]}"
    assert not key or key not in output, "the state key was logged"
    assert azurite.account_key not in output, "a credential was logged"
