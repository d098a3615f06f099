"""Control-plane benchmark: how the controller's cost grows with the worker group.

Why: the controller is one Python process polling every worker. Its cost per worker
decides how large a group one controller can drive, and whether it still reacts to a
node loss in time. This measures the real thing: the shipped ``Controller`` (in a
zero-CPU actor on the head node, as ``ElasticTrainer.fit`` places it) with the shipped
``WorkerGroup`` and ``TrainWorker`` actors (each one imports torch and joins a real gloo
process group at every membership epoch). Two thin subclasses only *measure*:
``TimedGroup`` times ``poll()`` and ``setup()``; ``BenchController`` times ``tick()``
on its loop thread and answers ``bench_stats()``.

Per group size N (workers take 0 CPUs and one ``bench_slot`` each, on 4 fake nodes of a
``raylastic.testing.LocalCluster``; the train function sleeps ``--step-s`` and reports):

- steady state, over ``--window-s`` seconds once the group of N trains:
  controller process CPU / wall (every thread of that process: the loop, Ray's core
  worker threads that send the calls and receive the answers), the loop thread's CPU /
  wall, poll round-trip (median, p90), ticks per second, bytes appended to the event
  log (events.jsonl + metrics.jsonl) per minute;
- a node loss (one of the 4 nodes, N/4 workers, killed without notice): seconds from
  the kill to the controller's decision (its ``failure`` event), to the resize
  (``resize``), to the new group formed (``group_formed``; the gloo process group of
  3N/4 ranks included), to the train function running on every rank
  (``training_started``) and to its first report (``first_step``), all read from the
  run's event log; and how long ``setup`` (rendezvous + gloo init) took.

Writes benchmarks/results/control_plane.json (runs are merged into it per design and N,
so sizes can be run in separate invocations) and control_plane.png.

Usage:
    python benchmarks/control_plane.py                      # N = 4..64, 2 repeats each
    python benchmarks/control_plane.py --sizes 4 8 --repeats 1 --label after
    python benchmarks/control_plane.py --report             # refit + replot from the JSON
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

import ray

import raylastic
from raylastic._internal.controller.controller import Controller
from raylastic._internal.worker_group.group import WorkerGroup
from raylastic.checkpoint.storage import Storage
from raylastic.config import RunConfig, ScalingConfig
from raylastic.events import EVENTS_FILE, METRICS_FILE, load_events
from raylastic.testing.cluster import LocalCluster
from raylastic.testing.machine import cpu_seconds
from raylastic.trainer import HEAD_RESOURCE

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
JSON_PATH = os.path.join(RESULTS, "control_plane.json")
PNG_PATH = os.path.join(RESULTS, "control_plane.png")
NUM_NODES = 4
SLOT = "bench_slot"
SIZES = [4, 8, 16, 32, 64]
EXTRAPOLATE = [256, 1024]


# -- what runs in the cluster ------------------------------------------------------------
def cheap_train(config: Dict[str, Any]) -> None:
    """A train function that costs nothing but its reports: the controller's work per
    report is what is measured. Runs until the controller stops it. With
    ``checkpoint_every`` every rank reports a checkpoint that often (rank 0 writes a
    file), so a checkpoint commits only once every rank's report has been polled."""
    step_s = float(config["step_s"])
    every = int(config.get("checkpoint_every") or 0)
    rank = raylastic.get_context().get_world_rank()
    i = 0
    while True:
        time.sleep(step_s)
        i += 1
        if every and i % every == 0:
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    with open(os.path.join(d, "step.txt"), "w") as fh:
                        fh.write(str(i))
                raylastic.report({"step": i}, checkpoint=raylastic.Checkpoint.from_directory(d))
        else:
            raylastic.report({"step": i})


class TimedGroup(WorkerGroup):
    """The shipped group; records how long each ``poll`` and ``setup`` took."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.polls: List[tuple] = []  # (monotonic end, seconds, members polled)
        self.setups: List[tuple] = []  # (epoch, world size, seconds)

    def poll(self, members):
        t0 = time.perf_counter()
        batch = super().poll(members)
        t1 = time.perf_counter()
        self.polls.append((time.monotonic(), t1 - t0, len(members)))
        if len(self.polls) > 20000:
            del self.polls[:10000]
        return batch

    def setup(self, members, epoch, backend):
        t0 = time.perf_counter()
        try:
            return super().setup(members, epoch, backend)
        finally:
            self.setups.append((epoch, len(members), time.perf_counter() - t0))


class BenchController(Controller):
    """The shipped controller with a ``TimedGroup``; ``tick()`` timed on its thread."""

    def __init__(self, train_func, config, scaling, run, storage, run_rel, run_name,
                 max_polls_per_s: Optional[float] = None):
        group = TimedGroup.for_run(scaling, run, storage, run_rel, run_name)
        if max_polls_per_s is not None:  # only in a tree that watches (see --max-polls-per-s)
            group.max_polls_per_s = max_polls_per_s
        super().__init__(train_func, config, scaling, run, storage, run_rel, run_name, group=group)
        self._loop_cpu = 0.0
        self._ticks = 0

    def tick(self) -> None:
        t0 = time.thread_time()
        try:
            super().tick()
        finally:
            self._loop_cpu += time.thread_time() - t0
            self._ticks += 1

    def bench_stats(self) -> Dict[str, Any]:
        import psutil

        cpu = psutil.Process().cpu_times()
        return {"wall": time.monotonic(), "process_cpu": cpu.user + cpu.system, "loop_cpu": self._loop_cpu,
                "ticks": self._ticks, "polls": list(self._group.polls), "setups": list(self._group.setups),
                "pid": os.getpid(), "raylastic": os.path.dirname(raylastic.__file__)}


# -- the driver ---------------------------------------------------------------------------
def _wait(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.1)


def _ended(run_ref) -> None:
    """Raise at once if the run ended (or its controller died) while we wait on it."""
    if ray.wait([run_ref], timeout=0)[0]:
        outcome = ray.get(run_ref)  # a dead controller raises here
        raise RuntimeError(f"the run ended early: {outcome.get('error')!r}")


def _events(run_dir: str, kind: str, **match: Any) -> List[Dict[str, Any]]:
    return [e for e in load_events(run_dir) if e.get("kind") == kind
            and all(e.get(k) == v for k, v in match.items())]


def _log_bytes(run_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(run_dir, f)) for f in (EVENTS_FILE, METRICS_FILE)
               if os.path.exists(os.path.join(run_dir, f)))


def _workers_cpu() -> float:
    """CPU seconds used so far by this machine's worker actor processes (``ray::TrainWorker``):
    the load the controller competes with on this box."""
    import psutil

    total = 0.0
    for p in psutil.process_iter(["cmdline"]):
        try:
            if (p.info["cmdline"] or [""])[0].startswith("ray::TrainWorker"):
                t = p.cpu_times()
                total += t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def measure(n: int, *, window_s: float, step_s: float, poll_interval_s: float,
            timeout_s: float = 400.0, loss: bool = True, max_polls_per_s: Optional[float] = None,
            checkpoint_every: int = 0) -> Dict[str, Any]:
    """One run at group size ``n`` on a fresh local cluster; returns its numbers."""
    if n % NUM_NODES:
        raise ValueError(f"--sizes: {n} is not a multiple of {NUM_NODES} (the workers are spread over "
                         f"{NUM_NODES} nodes so one node loss takes N/{NUM_NODES} of them)")
    out: Dict[str, Any] = {"n": n}
    with tempfile.TemporaryDirectory(prefix="raylastic-cp-") as root, \
            LocalCluster(num_nodes=NUM_NODES, cpus_per_node=0, node_resources={SLOT: n // NUM_NODES}) as cluster:
        storage = Storage(root)
        name = f"cp{n}"
        run_dir = os.path.join(root, name)
        scaling = ScalingConfig(min_workers=1, max_workers=n, resources_per_worker={"CPU": 0, SLOT: 1})
        run = RunConfig(name=name, storage_path=root, verbose=False, progress=False,
                        poll_interval_s=poll_interval_s)
        cls = ray.remote(BenchController).options(num_cpus=0, max_concurrency=4, max_restarts=0,
                                                  resources={HEAD_RESOURCE: 0.001})
        t_start = time.time()
        ctrl = cls.remote(cheap_train, {"step_s": step_s, "checkpoint_every": checkpoint_every}, scaling, run, storage, name, name, max_polls_per_s)
        run_ref = ctrl.run.remote()
        try:
            _wait(lambda: _ended(run_ref) or _events(run_dir, "first_step", world_size=n), timeout_s,
                  f"a group of {n} training")
            formed = _events(run_dir, "group_formed", world_size=n)[0]
            out["start_to_group_formed_s"] = round(formed["ts"] - t_start, 2)
            time.sleep(min(5.0, window_s / 4))  # first polls after the start settle
            box0, bytes0, w0 = cpu_seconds()[0], _log_bytes(run_dir), _workers_cpu()
            s0 = ray.get(ctrl.bench_stats.remote())
            time.sleep(window_s)
            s1 = ray.get(ctrl.bench_stats.remote())
            box1, bytes1, w1 = cpu_seconds()[0], _log_bytes(run_dir), _workers_cpu()
            out["raylastic_imported_from"] = s1["raylastic"]
            # rendezvous + gloo init of the first group (n ranks): the process group's cost
            out["initial_setup_s"] = round(max(d for (_e, k, d) in s1["setups"] if k == n), 3)
            wall = s1["wall"] - s0["wall"]
            in_window = [(d, k) for (t, d, k) in s1["polls"] if s0["wall"] < t <= s1["wall"]]
            polls = [d for d, k in in_window if k == n]
            worker_polls = sum(k for _d, k in in_window)
            out["steady"] = {
                "window_s": round(wall, 2),
                "controller_process_cpu_share": round((s1["process_cpu"] - s0["process_cpu"]) / wall, 4),
                "controller_loop_cpu_share": round((s1["loop_cpu"] - s0["loop_cpu"]) / wall, 4),
                "ticks_per_s": round((s1["ticks"] - s0["ticks"]) / wall, 2),
                "polls": len(polls),  # of every member (a watched group's full polls)
                "partial_polls": len(in_window) - len(polls),  # of rank 0 and members whose thread ended
                "worker_polls_per_s": round(worker_polls / wall, 1),  # actor calls answered per second
                "poll_rtt_ms_median": round(1000 * statistics.median(polls), 2) if polls else None,
                "poll_rtt_ms_p90": round(1000 * _pct(polls, 0.9), 2) if polls else None,
                "event_log_bytes_per_min": round((bytes1 - bytes0) / wall * 60),
                "box_cpu_busy_cores": round((box1 - box0) / wall, 2),
                "worker_processes_cpu_cores": round((w1 - w0) / wall, 2),
            }
            if checkpoint_every:
                # The node loss ends the steady state: first a checkpoint must have
                # committed on the watched path (bounded), however slow the box. Rank 0's
                # reports wait for its previous upload, and with DeepSpeed's build and the
                # unit tests beside it none committed in the ~4 s before the loss (three
                # clean-clone runs, 2026-11-27).
                t_wait = time.monotonic()
                _wait(lambda: _ended(run_ref) or _events(run_dir, "checkpoint_committed"), timeout_s,
                      "a committed checkpoint")
                out["waited_for_first_commit_s"] = round(time.monotonic() - t_wait, 2)
            if loss:
                out["loss"] = _node_loss(cluster, run_dir, ctrl, run_ref, n, timeout_s)
        finally:
            ctrl.request_stop.remote()
            try:
                ray.get(run_ref, timeout=120)
            except Exception as e:  # noqa: BLE001 - the run ends aborted; anything else is reported
                out["stop_error"] = f"{type(e).__name__}: {e}"
            out["event_log_bytes_total"] = _log_bytes(run_dir)
            # what the run logged, by kind: says why when a count is off
            out["event_counts"] = dict(collections.Counter(e.get("kind") for e in load_events(run_dir)))
            out["checkpoints_committed"] = out["event_counts"].get("checkpoint_committed", 0)
    return out


def _node_loss(cluster: LocalCluster, run_dir: str, ctrl, run_ref, n: int, timeout_s: float) -> Dict[str, Any]:
    """Kill one node (N/4 workers) without notice; time the controller's reaction."""
    left = n - n // NUM_NODES
    bytes0 = _log_bytes(run_dir)
    t_kill = time.time()
    cluster.remove_node(cluster.worker_nodes[-1])
    first = _wait(lambda: _ended(run_ref) or [e for e in _events(run_dir, "first_step", world_size=left)
                                              if e["ts"] > t_kill],
                  timeout_s, f"the first report of the re-formed group of {left}")[0]

    def after(kind: str) -> Optional[float]:
        es = [e for e in _events(run_dir, kind) if e["ts"] > t_kill]
        return round(es[0]["ts"] - t_kill, 3) if es else None

    stats = ray.get(ctrl.bench_stats.remote())
    setups = [s for s in stats["setups"] if s[1] == left]
    lost = [e for e in _events(run_dir, "worker_lost") if e["ts"] > t_kill]
    return {
        "workers_lost": len(lost),
        "to_first_worker_lost_s": after("worker_lost"),
        "to_decision_s": after("failure"),
        "to_resize_s": after("resize"),
        "to_group_formed_s": after("group_formed"),
        "to_training_started_s": after("training_started"),
        "to_first_step_s": round(first["ts"] - t_kill, 3),
        "setup_s": round(setups[-1][2], 3) if setups else None,
        "event_log_bytes": _log_bytes(run_dir) - bytes0,
    }


def _pct(xs: List[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# -- fitting and reporting -------------------------------------------------------------------
METRICS = {  # name -> (path in a run, unit)
    "controller_process_cpu_share": (("steady", "controller_process_cpu_share"), "share of one core"),
    "controller_loop_cpu_share": (("steady", "controller_loop_cpu_share"), "share of one core"),
    "poll_rtt_ms_median": (("steady", "poll_rtt_ms_median"), "ms"),
    "worker_polls_per_s": (("steady", "worker_polls_per_s"), "actor calls/s"),
    "controller_cpu_ms_per_worker_poll": (("steady", "controller_cpu_ms_per_worker_poll"), "ms CPU"),
    "event_log_bytes_per_min": (("steady", "event_log_bytes_per_min"), "bytes/min"),
    "loss_to_decision_s": (("loss", "to_decision_s"), "s"),
    "loss_to_group_formed_s": (("loss", "to_group_formed_s"), "s"),
    "loss_to_training_started_s": (("loss", "to_training_started_s"), "s"),
    "setup_s": (("loss", "setup_s"), "s"),
    "initial_setup_s": (("initial_setup_s",), "s"),
}


def _get(run: Dict[str, Any], path) -> Optional[float]:
    v: Any = run
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v


def fit(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per metric: the range at each N, a least-squares line a + b*N over every run,
    and its extrapolation to 256 and 1,024 workers."""
    out: Dict[str, Any] = {}
    for name, (path, unit) in METRICS.items():
        pts = [(r["n"], _get(r, path)) for r in runs if _get(r, path) is not None]
        if len(pts) < 2:
            continue
        by_n: Dict[int, List[float]] = {}
        for n, v in pts:
            by_n.setdefault(n, []).append(v)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        sxx = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else 0.0
        a = my - b * mx
        out[name] = {
            "unit": unit,
            "range_by_n": {str(n): [min(v), max(v)] for n, v in sorted(by_n.items())},
            "intercept": a, "per_worker": b,
            "extrapolated": {str(n): a + b * n for n in EXTRAPOLATE},
        }
    return out


def cpu_model(doc: Dict[str, Any]) -> Dict[str, Any]:
    """Controller CPU share = fixed + per_poll * worker polls/s + per_worker * N, fitted
    over every run of every design (a poll costs the same whoever asks for it), then
    evaluated with each design's poll rate at 256 and 1,024 workers: the committed design
    polls every member every tick (10 ticks/s at poll_interval_s=0.1, if it kept up),
    the watched one rank 0 every tick plus everyone at most MAX_POLLS_PER_S (200) a second."""
    import numpy as np

    rows = [(r["steady"]["worker_polls_per_s"], r["n"], r["steady"]["controller_process_cpu_share"])
            for d in doc["designs"].values() for r in d["runs"] if r.get("steady", {}).get("worker_polls_per_s")]
    if len(rows) < 4:
        return {}
    a = np.array([[1.0, p, n] for p, n, _ in rows])
    y = np.array([c for _, _, c in rows])
    (fixed, per_poll, per_worker), *_ = np.linalg.lstsq(a, y, rcond=None)
    rates = POLL_RATES
    return {
        "fixed": round(float(fixed), 4), "per_worker_poll_ms": round(1000 * float(per_poll), 4),
        "per_worker": round(float(per_worker), 6), "runs": len(rows),
        "predicted_cpu_share": {label: {str(n): round(float(fixed + per_poll * rate(n) + per_worker * n), 3)
                                        for n in [64] + EXTRAPOLATE} for label, rate in rates.items()},
        "note": "the committed design's 1,024-worker number is a demand: its loop cannot go past one "
                "core, so it would poll slower instead (each full poll ~1.2 s) and see losses later",
    }


POLL_RATES = {"before": lambda n: 10.0 * n, "after": lambda n: min(10.0 * n, 200.0 + 10.0)}


def _model_curve(doc: Dict[str, Any], label: str, name: str):
    """CPU and poll rate past 64 follow each design's poll rule, not a line through N."""
    m, rate = doc.get("cpu_model"), POLL_RATES.get(label)
    if not m or rate is None or name not in ("controller_process_cpu_share", "worker_polls_per_s"):
        return None
    xs = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
    if name == "worker_polls_per_s":
        return xs, [rate(x) for x in xs]
    return xs, [m["fixed"] + m["per_worker_poll_ms"] / 1000 * rate(x) + m["per_worker"] * x for x in xs]


def plot(doc: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("controller_process_cpu_share", True), ("poll_rtt_ms_median", True), ("worker_polls_per_s", True),
              ("loss_to_decision_s", False), ("loss_to_training_started_s", False), ("event_log_bytes_per_min", False)]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, logy) in zip(axes.flat, panels):
        for label, design in doc["designs"].items():
            runs = design["runs"]
            f = design.get("fit", {}).get(name)
            pts = [(r["n"], _get(r, METRICS[name][0])) for r in runs if _get(r, METRICS[name][0]) is not None]
            if not pts:
                continue
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], "o", label=f"{label} (measured)")[0]
            model = _model_curve(doc, label, name)
            if model:
                what = "poll rule at 10 ticks/s" if name == "worker_polls_per_s" else "cpu_model at 10 ticks/s"
                ax.plot(*model, "--", color=line.get_color(), label=f"{label}: {what}, extrapolated")
            elif f:
                xs = [4, 8, 16, 32, 64, 128, 256, 512, 1024]
                ys = [f["intercept"] + f["per_worker"] * x for x in xs]
                ax.plot(*zip(*[(x, y) for x, y in zip(xs, ys) if not logy or y > 0]), "--",
                        color=line.get_color(), label=f"{label}: a + b*N, extrapolated")
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
        ax.set_xlabel("workers (N)")
        ax.set_title(f"{name} ({METRICS[name][1]})", fontsize=9)
        if name == "controller_process_cpu_share":
            ax.axhline(0.25, color="grey", lw=0.8, ls=":", label="target at 64: 0.25")
            ax.axhline(1.0, color="red", lw=0.8, ls=":", label="one core")
        if name == "loss_to_training_started_s":
            ax.axhline(2.0, color="grey", lw=0.8, ls=":", label="target at 64: 2 s")
        ax.legend(fontsize=7)
    fig.suptitle("raylastic control plane vs group size (benchmarks/control_plane.py; 2 shared cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown(doc: Dict[str, Any]) -> str:
    """The tables docs/scaling.md quotes: measured ranges per N, the fit, 256 and 1,024."""
    lines = []
    for label, design in doc["designs"].items():
        fits = design.get("fit", {})
        sizes = sorted({r["n"] for r in design["runs"]})
        lines += [f"### {label}: {design.get('note', '')}", "",
                  "| metric | " + " | ".join(f"N={n}" for n in sizes) + " | per worker | 256 (fit) | 1,024 (fit) |",
                  "|---" * (len(sizes) + 4) + "|"]
        for name, f in fits.items():
            rng = f["range_by_n"]
            cells = [_fmt_range(rng.get(str(n))) for n in sizes]
            ext = f["extrapolated"]
            lines.append(f"| {name} ({f['unit']}) | " + " | ".join(cells)
                         + f" | {_fmt(f['per_worker'])} | {_fmt(ext['256'])} | {_fmt(ext['1024'])} |")
        lines.append("")
    return "\n".join(lines)


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _fmt_range(r: Optional[List[float]]) -> str:
    if not r:
        return "-"
    return _fmt(r[0]) if r[0] == r[1] else f"{_fmt(r[0])}-{_fmt(r[1])}"


def _git_commit() -> str:
    if os.environ.get("RAYLASTIC_BENCH_COMMIT"):  # a copy of an earlier tree (the "before" curve)
        return os.environ["RAYLASTIC_BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def load(path: str = JSON_PATH) -> Dict[str, Any]:
    if os.path.exists(path):
        with open(path) as fh:
            return json.load(fh)
    return {"designs": {}}


def _derive(run: Dict[str, Any]) -> None:
    """Per-run numbers computed from the measured ones (also for runs recorded before
    ``worker_polls_per_s`` was: every poll then asked every member)."""
    st = run.get("steady")
    if not st:
        return
    if "worker_polls_per_s" not in st:
        st["worker_polls_per_s"] = round(st["polls"] * run["n"] / st["window_s"], 1)
    if st["worker_polls_per_s"]:
        st["controller_cpu_ms_per_worker_poll"] = round(
            1000 * st["controller_process_cpu_share"] / st["worker_polls_per_s"], 4)


def save(doc: Dict[str, Any], path: str = JSON_PATH) -> None:
    for design in doc["designs"].values():
        for run in design["runs"]:
            _derive(run)
        design["fit"] = fit(design["runs"])
    doc["cpu_model"] = cpu_model(doc)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(doc, fh, indent=1)
    plot(doc, os.path.splitext(path)[0] + ".png")


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=SIZES)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--window-s", type=float, default=20.0, help="steady-state window per run")
    p.add_argument("--step-s", type=float, default=0.1, help="train function: seconds between reports")
    p.add_argument("--poll-interval-s", type=float, default=RunConfig().poll_interval_s)
    p.add_argument("--max-polls-per-s", type=float, default=None,
                   help="override WorkerGroup.max_polls_per_s (the watched group's full-poll budget)")
    p.add_argument("--label", default="current", help="design name the runs are filed under")
    p.add_argument("--note", default="", help="what this design is (kept in the JSON)")
    p.add_argument("--replace", action="store_true", help="drop this label's earlier runs at these sizes")
    p.add_argument("--report", action="store_true", help="only refit and replot the JSON")
    p.add_argument("--out", default=JSON_PATH)
    a = p.parse_args(argv)
    for n in a.sizes:
        if n < NUM_NODES or n % NUM_NODES:
            p.error(f"--sizes: {n} must be a positive multiple of {NUM_NODES} (one node loss takes N/{NUM_NODES})")
    doc = load(a.out)
    if a.report:
        save(doc, a.out)
        print(markdown(doc))
        print(json.dumps(doc["cpu_model"], indent=1))
        return
    design = doc["designs"].setdefault(a.label, {"runs": []})
    if a.note:
        design["note"] = a.note
    if a.replace:
        design["runs"] = [r for r in design["runs"] if r["n"] not in a.sizes]
    doc["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": ray.__version__}
    t0 = time.time()
    for rep in range(a.repeats):
        for n in a.sizes:
            t_run = time.time()
            r = measure(n, window_s=a.window_s, step_s=a.step_s, poll_interval_s=a.poll_interval_s,
                        max_polls_per_s=a.max_polls_per_s)
            r.update(repeat=rep, commit=_git_commit(), when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     step_s=a.step_s, poll_interval_s=a.poll_interval_s, max_polls_per_s=a.max_polls_per_s,
                     run_wall_s=round(time.time() - t_run, 1))
            design["runs"].append(r)
            save(doc, a.out)  # after every run: a later failure keeps what was measured
            print(json.dumps(r), flush=True)
    print(f"{len(a.sizes) * a.repeats} run(s) in {time.time() - t0:.0f} s; wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
