"""The three ways users run raylastic, against a real ``ray start --head``:

1. ``examples/elastic_script.py``: a plain script calling ``ElasticTrainer(...).fit()``,
   run with ``RAY_ADDRESS`` pointing at the head;
2. the same script submitted with the real ``ray job submit --working-dir
   examples/job_submit`` CLI to a running head;
3. ``examples/notebook/elastic_training.ipynb`` executed with nbclient on a kernel that
   runs this venv's python and connects to the head through ``RAY_ADDRESS``.

The head is started by :class:`RayHead` with the venv's ``ray`` CLI in its own temp dir, and
stopped by killing exactly the processes of that head (never ``ray stop``, which would kill
every Ray cluster on the machine).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import pytest
from raylastic.testing.ports import free_ports

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
VENV_BIN = Path(sys.executable).parent  # the venv running the tests: python, ray, ...
MARKER_ENV = "RAYLASTIC_TEST_HEAD"


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:120]}"
    except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
        return f"{proc.pid} (gone)"


class RayHead:
    """A single-node Ray head started with ``ray start --head`` in its own temp dir.

    Started with ``RAY_ADDRESS`` unset and the venv's ``bin`` first on ``PATH`` (so a job's
    ``python`` is the venv's). Every process of the head carries ``RAYLASTIC_TEST_HEAD=<temp
    dir>`` in its environment, and the daemons name the temp dir on their command lines;
    :meth:`stop` kills those processes and their descendants (SIGTERM, then SIGKILL) and
    returns what is left (should be nothing). ``ray stop`` is never used.
    """

    def __init__(self, num_cpus: int = 2, start_timeout_s: float = 90.0):
        self.num_cpus = num_cpus
        self.start_timeout_s = start_timeout_s
        self.temp_dir: Optional[str] = None
        self.gcs_port = self.dashboard_port = 0
        self._recorded: List[psutil.Process] = []  # psutil checks create_time: no PID reuse
        self.survived_sigterm: List[str] = []
        # Ray 2.60 turns token auth on for `ray start` when ~/.ray/auth_token exists, and a
        # client given an explicit address only uses it with RAY_AUTH_MODE=token: pin both.
        self.token = secrets.token_hex(32)

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def auth_env(self) -> Dict[str, str]:
        """Token auth with this head's own token: never the shared ~/.ray/auth_token."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token}

    def env(self, **extra: str) -> Dict[str, str]:
        """Environment for commands run against this head (RAY_ADDRESS unset, venv first)."""
        env = dict(os.environ)
        for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
            env.pop(var, None)
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
        env.update(self.auth_env)
        env.update(extra)
        return env

    def start(self, attempts: int = 2) -> "RayHead":
        """``ray start --head`` on free ports; one retry (a port taken in between, say)."""
        for attempt in range(1, attempts + 1):
            try:
                self._start_once()
                return self
            except Exception:
                left = self.stop()
                if attempt == attempts or left:
                    raise
        return self

    def _start_once(self) -> None:
        # Short path: Ray's unix socket paths live under the temp dir (108-byte limit).
        self.temp_dir = tempfile.mkdtemp(prefix="rlj-", dir="/tmp")
        self._recorded = []
        (self.gcs_port, self.dashboard_port, client_port, agent_port,
         runtime_env_port, metrics_port) = free_ports(6)
        cmd = [str(VENV_BIN / "ray"), "start", "--head",
               "--node-ip-address=127.0.0.1", f"--port={self.gcs_port}",
               "--include-dashboard=true", "--dashboard-host=127.0.0.1",
               f"--dashboard-port={self.dashboard_port}",
               f"--dashboard-agent-listen-port={agent_port}",
               f"--ray-client-server-port={client_port}",
               f"--runtime-env-agent-port={runtime_env_port}",
               f"--metrics-export-port={metrics_port}",
               f"--num-cpus={self.num_cpus}", "--num-gpus=0",
               "--object-store-memory=200000000",
               f"--temp-dir={self.temp_dir}", "--disable-usage-stats"]
        deadline = time.monotonic() + self.start_timeout_s
        proc = subprocess.run(cmd, env=self.env(**{MARKER_ENV: self.temp_dir}),
                              capture_output=True, text=True, timeout=self.start_timeout_s)
        if proc.returncode != 0:
            hint = ""
            if "dashboard" in proc.stderr and "missing packages" in proc.stderr:
                hint = ("\nJob submission needs the dashboard: install ray[default] "
                        "(requirements-dev.txt: ray[default,train]==2.60.0).")
            raise RuntimeError(f"ray start failed ({proc.returncode}):\n{proc.stdout}\n"
                               f"{proc.stderr[-4000:]}{hint}")
        self._wait_for_job_server(deadline)
        self._recorded = self.processes()

    def _wait_for_job_server(self, deadline: float) -> None:
        last: object = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.dashboard_url}/api/version", timeout=2) as r:
                    if r.status == 200:
                        return
            except urllib.error.HTTPError as e:  # the server answers: it is up
                if e.code in (401, 403):
                    return
                last = e
            except OSError as e:
                last = e
            time.sleep(0.5)
        raise TimeoutError(f"dashboard at {self.dashboard_url} not up: {last!r}")

    def _is_ours(self, proc: psutil.Process) -> bool:
        try:
            if any(self.temp_dir in arg for arg in proc.cmdline()):
                return True
            return proc.environ().get(MARKER_ENV) == self.temp_dir
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            return False

    def processes(self) -> List[psutil.Process]:
        """Live processes of this head: marked ones, recorded ones, and their descendants."""
        if not self.temp_dir:
            return []
        found: Dict[int, psutil.Process] = {}
        me = os.getpid()
        for proc in self._recorded:
            if proc.is_running():
                found[proc.pid] = proc
        for proc in psutil.process_iter():
            if proc.pid != me and proc.pid not in found and self._is_ours(proc):
                found[proc.pid] = proc
        for proc in list(found.values()):
            try:
                for child in proc.children(recursive=True):
                    found.setdefault(child.pid, child)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass
        found.pop(me, None)
        return [p for p in found.values() if _alive(p)]

    def stop(self, grace_s: float = 3.0) -> List[psutil.Process]:
        """Kill this head's processes; returns those still alive afterwards (should be []).

        SIGTERM, then SIGKILL after ``grace_s``: the dashboard and its helpers exit in ~0.1 s,
        but gcs_server, raylet, the autoscaler monitor and the runtime-env agent were still
        up 8 s after SIGTERM here, so a long grace only slows the test down.
        """
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            procs = self.processes()
            if not procs:
                break
            for p in procs:
                try:
                    p.send_signal(sig)
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    pass
            # Not psutil.wait_procs: the daemons are not our children, and a zombie that
            # nobody reaps would count as alive until the timeout.
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and self.processes():
                time.sleep(0.3)
            if sig == signal.SIGTERM:
                self.survived_sigterm = [_describe(p) for p in self.processes()]
        left = self.processes()
        if not left and self.temp_dir:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left

    def __enter__(self) -> "RayHead":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="module")
def ray_head():
    head = RayHead(num_cpus=2)
    head.start()
    try:
        yield head
    finally:
        t0 = time.monotonic()
        left = head.stop()
        print(f"head stopped in {time.monotonic() - t0:.1f} s; survived SIGTERM: {head.survived_sigterm}")
        assert not left, f"processes of the head left after stop: {[_describe(p) for p in left]}"
        assert not [p for p in psutil.process_iter() if head._is_ours(p)]


def _world_sizes(text: str) -> List[int]:
    m = re.findall(r"World sizes: ([\d >-]+)", text)
    assert m, f"no 'World sizes:' line in:\n{text[-4000:]}"
    return [int(w) for w in m[-1].split("->")]


def test_plain_script(ray_head, tmp_path):
    """(1): python examples/elastic_script.py with RAY_ADDRESS set joins that cluster."""
    storage = tmp_path / "results"
    cmd = [sys.executable, str(EXAMPLES / "elastic_script.py"), "--steps", "20",
           "--storage-path", str(storage), "--name", "script"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=ray_head.env(RAY_ADDRESS=ray_head.gcs_address),
                          capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    print(out[-3000:])
    assert proc.returncode == 0, f"elastic_script.py exited {proc.returncode}:\n{out[-6000:]}"
    assert re.search(rf"Ray GCS: [\d.]+:{ray_head.gcs_port}\b", out), out[-4000:]
    assert "ELASTIC_SCRIPT_OK steps=20" in out, out[-4000:]
    sizes = _world_sizes(out)
    assert sizes and all(1 <= w <= 2 for w in sizes), sizes
    assert (storage / "script" / "events.jsonl").is_file()
    print(f"plain script: {time.monotonic() - t0:.1f} s")


def test_ray_job_submit(ray_head, tmp_path):
    """(1)+(2): examples/elastic_script.py submitted with the real ray job submit CLI."""
    workdir = EXAMPLES / "job_submit"
    assert (workdir / "elastic_script.py").is_file()
    storage = tmp_path / "results"
    cmd = [str(VENV_BIN / "ray"), "job", "submit", "--address", ray_head.dashboard_url,
           "--working-dir", str(workdir), "--",
           "python", "elastic_script.py", "--steps", "30", "--storage-path", str(storage),
           "--name", "job"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=ray_head.env(), capture_output=True, text=True, timeout=240,
                          cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    print(out[-3000:])
    assert proc.returncode == 0, f"ray job submit exited {proc.returncode}:\n{out[-6000:]}"
    assert "succeeded" in out, out[-4000:]
    # The job ran the venv's python on this head, trained every step and printed the report.
    assert f"Python: {VENV_BIN}" in out, out[-4000:]
    assert re.search(rf"Ray GCS: [\d.]+:{ray_head.gcs_port}\b", out), out[-4000:]
    assert "ELASTIC_SCRIPT_OK steps=30" in out, out[-4000:]
    sizes = _world_sizes(out)
    assert sizes and all(1 <= w <= 2 for w in sizes), sizes
    assert "raylastic report:" in out and "World size timeline" in out, out[-4000:]
    loss = float(re.search(r"ELASTIC_SCRIPT_OK steps=30 loss=([\d.]+)", out).group(1))
    assert loss < 0.05, loss
    # The run directory is where we asked, with a committed final checkpoint.
    run_dir = storage / "job"
    assert (run_dir / "events.jsonl").is_file()
    assert list(run_dir.glob("checkpoints/checkpoint_00000030-*/.raylastic_manifest.json"))
    print(f"ray job submit: {time.monotonic() - t0:.1f} s")


def _kernelspec(root: Path, env: Dict[str, str]) -> str:
    """A kernelspec that runs this venv's python, under JUPYTER_PATH=root."""
    name = "raylastic-test-venv"
    d = root / "kernels" / name
    d.mkdir(parents=True)
    (d / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "raylastic test venv", "language": "python", "env": env,
    }))
    return name


def _cell_text(cell) -> str:
    parts = []
    for o in cell.get("outputs", []):
        if o.get("output_type") == "stream":
            parts.append(o.get("text", ""))
        elif o.get("output_type") in ("execute_result", "display_data"):
            parts.append(o.get("data", {}).get("text/plain", ""))
        elif o.get("output_type") == "error":
            parts.append("\n".join(o.get("traceback", [])))
    return "".join(parts)


def test_notebook(ray_head, tmp_path, monkeypatch):
    """(3): the notebook, executed by nbclient on the venv's python, connected to the head."""
    import nbformat
    from nbclient import NotebookClient

    path = EXAMPLES / "notebook" / "elastic_training.ipynb"
    nb = nbformat.read(str(path), as_version=4)
    # The committed notebook carries no outputs.
    assert all(not c.get("outputs") and not c.get("execution_count")
               for c in nb.cells if c.cell_type == "code")
    storage = tmp_path / "results"
    jupyter = tmp_path / "jupyter"
    kernel = _kernelspec(jupyter, {"RAY_ADDRESS": ray_head.gcs_address,
                                   "RAYLASTIC_STORAGE_PATH": str(storage),
                                   MARKER_ENV: ray_head.temp_dir, **ray_head.auth_env})
    monkeypatch.setenv("JUPYTER_PATH", str(jupyter))
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    for var in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    t0 = time.monotonic()
    client = NotebookClient(nb, kernel_name=kernel, timeout=180, startup_timeout=60,
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    text = "\n".join(_cell_text(c) for c in nb.cells if c.cell_type == "code")
    print(text[-3000:])
    print(f"notebook: {time.monotonic() - t0:.1f} s")
    # The kernel was the venv's python, connected to our head (not a new local Ray).
    assert f"python: {sys.executable}" in text, text[-4000:]
    assert f"connected to {ray_head.gcs_address}" in text, text[-4000:]
    sizes = _world_sizes(text)
    assert sizes and all(1 <= w <= 2 for w in sizes), sizes
    m = re.search(r"final step (\d+), loss ([\d.]+)", text)
    assert m, text[-4000:]
    assert int(m.group(1)) == 20 and float(m.group(2)) < 0.05, m.group(0)
    assert "error: None" in text, text[-4000:]
    assert list(storage.glob("*/events.jsonl")), list(storage.rglob("*"))
