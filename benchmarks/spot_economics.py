"""Spot economics: what one fixed workload costs per trained sample, how long it takes and
how much of the wall time is useful, for raylastic spot-first, raylastic on on-demand only
and Ray Train 2.60 on the same simulated spot capacity, over the shipped spot traces.

The cloud is ``raylastic.sim.SpotCloud``: Ray's real autoscaler launching local one-CPU
raylets of two node types, ``spot`` ($0.30/h) and ``on_demand`` ($1.00/h: spot at 0.3x),
with capacity and preemptions replayed from a trace (``calm``, ``busy``, ``drought`` and
``long``, nine preemptions with 0-20 s notices; docs/traces.md). Each run gets a fresh cloud.

The workload (``WORK``): the chaos benchmark's MLP and data (``raylastic.testing.chaos_train``),
``epochs`` x 1,200 samples at a fixed global batch of 48, the same train function logic for
both frameworks, a storage checkpoint every 25 steps on local disk. Each rank sleeps
``sample_sleep_s`` per sample it trains (a stand-in for accelerator time: with a fixed
global batch, 3 workers train a step ~3x faster than 1, as on real hardware; without it a
tiny CPU model would train as fast on one worker and elasticity would buy nothing).

The cloud runs at a stated time scale (``--time-scale``, default 10: one benchmark second
stands for 10 real seconds): node boots (90 s real), the idle timeout of a released node
(the shipped cluster configs' 3 s) derive from real-world values
(``raylastic.sim.timescale``); trace times and notices are benchmark seconds. Costs and
times are reported in both units (``*_real_*`` keys). Every raylastic policy duration is
its real-world default divided by the scale.

Systems, min 2 / max 3 workers each:

- ``raylastic_spot``: ``ElasticTrainer`` + ``ElasticState`` + ``ElasticDataLoader`` with
  ``CapacityPolicy(prices=...)`` and nothing else set: the default objective (``cost``).
- ``raylastic_cost`` / ``raylastic_time``: ``objective="cost"`` / ``objective="time"``
  (the latter fills a spot shortfall with on-demand up to max_workers: the policy before
  objectives existed).
- ``raylastic_deadline``: ``deadline_s=--deadline-s`` (default 1.3x the on-demand-only
  wall time of the same workload, measured first in the same invocation).
- ``raylastic_on_demand``: the same on on-demand nodes only
  (``CapacityPolicy(prefer="on_demand", max_on_demand_workers=3)``); nothing preempts
  on-demand nodes, so it is run once and is the baseline of every trace.
- ``ray_train_spot``: ``ray.train.torch.TorchTrainer(scaling_config=ScalingConfig(
  num_workers=(2, 3), resources_per_worker={"CPU": 1, "node_type:spot": 1}))``: Ray Train's
  elastic mode; its autoscaling coordinator asks Ray's autoscaler for the spot nodes. Ray
  Train has no on-demand fallback. ``FailureConfig(max_failures=-1)``,
  ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S=0.1`` as in the other benchmarks.

The trace starts at each run's first training step (so every system meets the same
preemptions at the same point of training, whatever its start-up time).

What is measured, per run (all from files, none assumed):

- ``cost_usd``: the cloud's bill, from ``cloud.history``: every worker node from its
  ``launch`` to its ``preempted`` / ``terminated`` / shutdown, clipped to [``fit()`` called,
  last sample trained], times its node type's price. The head node (no CPUs, the same for
  all) is not billed. ``cost_per_1k_samples_usd`` = cost / (samples of the workload / 1000).
- ``wall_s``: ``fit()`` called -> the last step of the workload logged by rank 0.
- ``goodput``: ``raylastic report``'s definition (docs/report.md), computed the same way
  for every system from rank 0's per-step log (``raylastic.testing.chaos_checks``).
- ``samples_trained_again``: steps logged more than once (rolled back by a restore) x 48.
- ``below_min_workers_s``: wall time not spent training in a group of >= ``min_workers``
  (start-up, recoveries, and time training with fewer workers or none).

Writes benchmarks/results/spot_economics.json, spot_economics.png (curves) and
spot_economics_pareto.png (cost per sample against wall time, a panel per trace). Usage:
  python benchmarks/spot_economics.py                       # the shipped traces, default systems
  python benchmarks/spot_economics.py --trace-file my.csv --out /tmp/mine.json  # any trace
  python benchmarks/spot_economics.py --traces busy --systems raylastic_spot ray_train_spot
  python benchmarks/spot_economics.py --quick               # 2 epochs, calm + busy (smoke run)
  python benchmarks/spot_economics.py --traces long --merge # into the existing JSON
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recovery import _runs  # noqa: E402  (this folder's recovery benchmark)

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
TRACES = ("calm", "busy", "drought", "long")
SYSTEMS = ("raylastic_spot", "raylastic_cost", "raylastic_time", "raylastic_deadline", "raylastic_on_demand",
           "ray_train_spot")
DEFAULT_SYSTEMS = ("raylastic_on_demand", "raylastic_spot", "raylastic_deadline", "ray_train_spot")
OBJECTIVE = {"raylastic_spot": "default", "raylastic_cost": "cost", "raylastic_time": "time",
             "raylastic_deadline": "deadline", "raylastic_on_demand": "on_demand", "ray_train_spot": "ray_train"}
TIME_SCALE = 10.0
DEADLINE_FACTOR = 1.3
WORK = {"n": 1200, "global_batch": 48, "micro_batch": 8, "seed": 0, "hidden": 64, "lr": 0.05,
        "epochs": 10, "sample_sleep_s": 0.03, "checkpoint_every": 25, "dtype": "float32"}
MIN_WORKERS, MAX_WORKERS = 2, 3
RESIZE_S = 2.0  # a resize onto a booted node, benchmark seconds (measured 1.5-2 s here)


# -- the cloud's bill ------------------------------------------------------------------------
def bill(history: List[Dict[str, Any]], prices: Dict[str, float], t0: float, t1: float) -> Dict[str, Any]:
    """Node-seconds and dollars per node type, each worker node billed from its ``launch``
    (or ``node_up``) to its end (``preempted``, ``terminated``, ``provider_shutdown``),
    clipped to ``[t0, t1]``. Also the cumulative cost at each billing change, for the plot."""
    start: Dict[str, float] = {}
    end: Dict[str, float] = {}
    kind: Dict[str, str] = {}
    shutdown = None
    for e in history:
        nid, ev = e.get("node_id"), e["event"]
        if ev == "provider_shutdown":
            shutdown = e["ts"]
        if not nid:
            continue
        if ev in ("preempted", "terminated"):  # some records lack the node type: match by id
            end.setdefault(nid, e["ts"])
        elif ev in ("launch", "node_up") and e.get("node_type") in prices:
            start.setdefault(nid, e["ts"])
            kind[nid] = e["node_type"]
    seconds = {t: 0.0 for t in prices}
    spans, nodes = [], []
    for nid, s in start.items():
        e = end.get(nid, shutdown if shutdown is not None else t1)
        a, b = max(s, t0), min(e, t1)
        nodes.append([nid, kind[nid], round(a - t0, 2), round(b - t0, 2)])
        if b > a:
            seconds[kind[nid]] += b - a
            spans.append((a, b, prices[kind[nid]] / 3600.0))
    usd = {t: seconds[t] * prices[t] / 3600.0 for t in prices}
    return {"node_s": {t: round(v, 1) for t, v in seconds.items()},
            "usd": {t: round(v, 6) for t, v in usd.items()}, "total_usd": round(sum(usd.values()), 6),
            "nodes": nodes, "curve": _cost_curve(spans, t0, t1)}


def _cost_curve(spans, t0: float, t1: float, points: int = 120) -> List[List[float]]:
    """Cumulative cost at ``points`` times in [t0, t1]: [seconds since t0, usd]."""
    out = []
    for i in range(points + 1):
        t = t0 + (t1 - t0) * i / points
        out.append([round(t - t0, 2), round(sum(rate * max(0.0, min(b, t) - a) for a, b, rate in spans), 7)])
    return out


# -- what a step log says --------------------------------------------------------------------
def below_min_s(steps: List[Dict[str, Any]], t_start: float, t_end: float, min_workers: int) -> float:
    """Wall time in [t_start, t_end] not covered by consecutive steps of one group of at
    least ``min_workers`` (a step's time is the time since the previous step of its group)."""
    covered, prev = 0.0, {}
    for r in sorted(steps, key=lambda r: r["t"]):
        if r["group"] in prev and r["world"] >= min_workers:
            covered += r["t"] - prev[r["group"]]
        prev[r["group"]] = r["t"]
    return round(max(0.0, (t_end - t_start) - covered), 2)


def samples_curve(steps: List[Dict[str, Any]], t0: float, global_batch: int) -> List[List[float]]:
    """[seconds since t0, samples in the model as restored] for every step row."""
    return [[round(r["t"] - t0, 2), r["step"] * global_batch] for r in sorted(steps, key=lambda r: r["t"])]


# -- one run -----------------------------------------------------------------------------------
def run_one(system: str, trace, trace_name: Optional[str], work: Dict[str, Any], root: str,
            fit_timeout_s: float, scale, deadline_s: Optional[float]) -> Dict[str, Any]:
    from raylastic.sim import SpotCloud
    from raylastic.testing.chaos import read_jsonl
    from raylastic.testing.chaos_checks import goodput_from_steps, group_starts
    from raylastic.testing.faults import FitThread

    name = f"{system}-{trace_name or 'none'}"
    log_dir = os.path.join(root, name, "log")
    os.makedirs(log_dir)
    stop = os.path.join(root, name, "stop")
    cfg = dict(work, log_dir=log_dir, stop_path=stop)
    total_steps = _total_steps(work)
    samples = total_steps * work["global_batch"]
    capacity = {"spot": 0, "on_demand": MAX_WORKERS} if system == "raylastic_on_demand" else None
    out: Dict[str, Any] = {"system": system, "trace": trace_name, "samples": samples,
                           "objective": OBJECTIVE[system], "deadline_s": deadline_s}
    with SpotCloud(capacity=capacity, time_scale=scale) as cloud:
        prices = {n: t.price_usd_per_hour for n, t in cloud.node_types.items()}
        th = FitThread(_trainer(system, cfg, cloud, os.path.join(root, name, "runs"), total_steps, scale,
                                deadline_s))
        t_start = time.time()
        th.start()
        steps_path = os.path.join(log_dir, "steps.jsonl")
        deadline = time.monotonic() + 300
        while not read_jsonl(steps_path) and th.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        t_first = time.time()
        if trace is not None and th.is_alive():
            cloud.start_trace(trace)
        th.join(fit_timeout_s)
        finished = not th.is_alive()
        if not finished:  # the stop flag: rank 0 logs the step it is on and the group returns
            open(stop, "w").close()
            th.join(120)
        steps = read_jsonl(steps_path)
        done = [r for r in steps if r["step"] >= total_steps]
        t_end = min(r["t"] for r in done) if done else (steps[-1]["t"] if steps else time.time())
        history = cloud.history
        out["bill"] = bill(history, prices, t_start, t_end)
    out["finished"] = finished and bool(done)
    out["error"] = repr(th.error) if th.error is not None else None
    final_step = max((r["step"] for r in steps), default=0)
    trained = min(final_step, total_steps) * work["global_batch"]
    out["samples_trained"] = trained
    out["wall_s"] = round(t_end - t_start, 2)
    out["deadline_met"] = bool(out["finished"] and deadline_s is not None and out["wall_s"] <= deadline_s)
    out["first_step_after_s"] = round(t_first - t_start, 2)
    out["cost_usd"] = out["bill"]["total_usd"]
    out["cost_per_1k_samples_usd"] = round(out["cost_usd"] / (trained / 1000.0), 6) if trained else None
    _real_units(out, scale.real_s_per_sim_s)
    kept = [r for r in steps if r["t"] <= t_end]
    out["goodput"] = goodput_from_steps(kept, t_start, t_end, group_starts(log_dir))["goodput"]
    out["samples_trained_again"] = (len(kept) - len({r["step"] for r in kept})) * work["global_batch"]
    out["below_min_workers_s"] = below_min_s(kept, t_start, t_end, MIN_WORKERS)
    out["world_sizes"] = _runs([r["world"] for r in kept])
    out["groups"] = len({r["group"] for r in kept})
    out["samples_curve"] = samples_curve(kept, t_start, work["global_batch"])[::2]
    out["cloud_events"] = _cloud_summary(history)
    if system.startswith("raylastic") and th.result is not None:
        out.update(_from_run_dir(th.result.path, scale.real_s_per_sim_s))
    return out


def _total_steps(work: Dict[str, Any]) -> int:
    return work["epochs"] * -(-work["n"] // work["global_batch"])


def _real_units(out: Dict[str, Any], k: float) -> None:
    """Benchmark seconds stand for ``k`` real seconds: node-seconds and so dollars scale by k."""
    out["wall_real_s"] = round(out["wall_s"] * k, 1)
    out["cost_real_usd"] = round(out["cost_usd"] * k, 6)
    cps = out.get("cost_per_1k_samples_usd")
    out["cost_per_1k_samples_real_usd"] = round(cps * k, 6) if cps is not None else None
    if out.get("deadline_s") is not None:
        out["deadline_real_s"] = round(out["deadline_s"] * k, 1)


def _from_run_dir(path: str, k: float) -> Dict[str, Any]:
    """What raylastic's own event log says: report numbers, capacity decisions with their
    numbers, and how long released nodes stayed billed."""
    from raylastic.reporting import build_report, load_run

    data = load_run(path)
    rep = build_report(data.events, data.metrics, None)
    out: Dict[str, Any] = {"raylastic_report": {
        "goodput": rep.goodput, "cost_usd": rep.cost_usd, "on_demand_cost_usd": rep.on_demand_cost_usd,
        "recoveries": len(rep.recoveries), "resizes": len(rep.resizes),
        "bill": rep.to_json().get("bill")}}
    out["restores"] = [[e["source"], e["index"]] for e in data.events if e["kind"] == "checkpoint_restored"]
    out["capacity_decisions"] = [
        {"t": round(e["ts"] - data.events[0]["ts"], 2), "decision": e.get("decision"), "counts": e.get("counts"),
         "target": e.get("target"), "reason": e.get("message"), "numbers": e.get("numbers")}
        for e in data.events if e["kind"] == "decision" and str(e.get("decision", "")).startswith("capacity.")]
    gone, let_go = [], {}
    for e in data.events:  # released (not lost) nodes: release -> node_gone, as the report counts it
        if e["kind"] == "worker_released" or (e["kind"] == "worker_lost" and e.get("cause") == "released"):
            let_go[e.get("node_id")] = e["ts"]
        elif e["kind"] in ("worker_lost", "worker_ready"):
            let_go.pop(e.get("node_id"), None)
        elif e["kind"] == "node_gone" and e.get("node_id") in let_go:
            gone.append(round(e["ts"] - let_go.pop(e["node_id"]), 2))
    out["release_to_gone_s"] = {"n": len(gone), "min": min(gone, default=None), "max": max(gone, default=None),
                                "max_real_s": round(max(gone) * k, 1) if gone else None}
    return out


def _trainer(system: str, cfg: Dict[str, Any], cloud, storage: str, total_steps: int, scale,
             deadline_s: Optional[float]):
    if system.startswith("raylastic"):
        from raylastic import CheckpointConfig, ElasticTrainer, FailureConfig, RunConfig, ScalingConfig
        from raylastic.policies.capacity import CapacityPolicy
        from raylastic.testing.chaos_train import chaos_elastic

        # Real-world defaults at the cloud's time scale (a user's policy on a real cloud).
        real = dict(fallback_after_s=scale.sim(120.0), max_wait_s=scale.sim(1800.0),
                    on_demand_boot_s=scale.sim(scale.world.boot_s) + RESIZE_S, prices=cloud.prices())
        if system == "raylastic_on_demand":
            policy = CapacityPolicy(prefer="on_demand", max_on_demand_workers=MAX_WORKERS, **real)
        elif system == "raylastic_deadline":
            policy = CapacityPolicy(deadline_s=deadline_s, **real)
        elif system in ("raylastic_cost", "raylastic_time"):
            policy = CapacityPolicy(objective=system.split("_")[1], **real)
        else:
            policy = CapacityPolicy(**real)
        return ElasticTrainer(
            chaos_elastic, train_loop_config=cfg,
            scaling_config=ScalingConfig(min_workers=MIN_WORKERS, max_workers=MAX_WORKERS, capacity=policy,
                                         validate_resources=False),
            run_config=RunConfig(name="spot", storage_path=storage, verbose=False, progress=False,
                                 tensorboard=False, failure_config=FailureConfig(max_failures=20),
                                 total_steps=total_steps,
                                 checkpoint_config=CheckpointConfig(persist_every=cfg["checkpoint_every"],
                                                                    num_to_keep=2)))
    import ray.train
    from ray.train.torch import TorchTrainer

    from raylastic.testing.chaos_train import chaos_ray_train

    return TorchTrainer(
        chaos_ray_train, train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=(MIN_WORKERS, MAX_WORKERS),
                                               resources_per_worker={"CPU": 1, "node_type:spot": 1}),
        run_config=ray.train.RunConfig(name="spot_ray_train", storage_path=storage,
                                       failure_config=ray.train.FailureConfig(max_failures=-1)))


def _cloud_summary(history: List[Dict[str, Any]]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for e in history:
        if e["event"] in ("launch", "preempted", "terminated", "notice", "launch_refused"):
            key = f"{e['event']}:{e.get('node_type')}"
            out[key] = out.get(key, 0) + 1
    return out


# -- summary and plots -----------------------------------------------------------------------
ROW_KEYS = ("cost_per_1k_samples_usd", "cost_per_1k_samples_real_usd", "wall_s", "wall_real_s", "goodput",
            "samples_trained_again", "below_min_workers_s", "finished", "objective", "deadline_s", "deadline_met")


def summarize(results: Dict[str, Any]) -> Dict[str, Any]:
    """Per trace: each system's headline numbers (the on-demand baseline included, its
    deadline judged against the trace's deadline) and the ratios the targets are about."""
    od = results.get("baseline_on_demand")
    table = {}
    for trace, runs in results.get("traces", {}).items():
        rows = dict(runs)
        if od:
            rows["raylastic_on_demand"] = od
        deadline = results.get("deadline_s", {}).get(trace)
        row: Dict[str, Any] = {}
        for system, r in rows.items():
            row[system] = {k: r.get(k) for k in ROW_KEYS}
            row[system]["deadline_s"] = deadline
            row[system]["deadline_met"] = bool(r.get("finished") and deadline is not None
                                               and r.get("wall_s") is not None and r["wall_s"] <= deadline)
        base = od.get("cost_per_1k_samples_usd") if od else None
        rt = runs.get("ray_train_spot", {})
        for system, r in runs.items():
            c = r.get("cost_per_1k_samples_usd")
            if system.startswith("raylastic") and c:
                if base:
                    row[f"{system}_vs_on_demand"] = round(c / base, 3)
                if rt.get("cost_per_1k_samples_usd"):
                    row[f"{system}_vs_ray_train"] = round(c / rt["cost_per_1k_samples_usd"], 3)
                    row[f"{system}_wall_vs_ray_train"] = round(r["wall_s"] / rt["wall_s"], 3)
        met = [(v["cost_per_1k_samples_usd"], s) for s, v in row.items()
               if isinstance(v, dict) and v.get("deadline_met") and v.get("cost_per_1k_samples_usd")]
        row["cheapest_meeting_deadline"] = min(met)[1] if met else None
        table[trace] = row
    return table


COLORS = {"raylastic_spot": "tab:blue", "raylastic_cost": "tab:cyan", "raylastic_time": "tab:purple",
          "raylastic_deadline": "tab:red", "raylastic_on_demand": "tab:green", "ray_train_spot": "tab:orange"}


def plot(results: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(results.get("traces", {}))
    if not traces:
        return
    fig, axes = plt.subplots(2, len(traces), figsize=(4.2 * len(traces), 7.5), squeeze=False)
    for j, trace in enumerate(traces):
        runs = dict(results["traces"][trace])
        if results.get("baseline_on_demand"):
            runs["raylastic_on_demand"] = results["baseline_on_demand"]
        for system, r in runs.items():
            c = COLORS.get(system, "grey")
            if r.get("samples_curve"):
                t, s = zip(*r["samples_curve"])
                axes[0][j].plot(t, s, color=c, lw=1.2, label=system)
            curve = r.get("bill", {}).get("curve")
            if curve and r.get("samples_curve"):
                # cumulative cost against the samples in the model at the same time
                import bisect
                ts = [p[0] for p in r["samples_curve"]]
                xs = [r["samples_curve"][max(0, bisect.bisect_right(ts, t) - 1)][1] if ts and t >= ts[0] else 0
                      for t, _usd in curve]
                axes[1][j].plot(xs, [usd for _t, usd in curve], color=c, lw=1.2, label=system)
        axes[0][j].set_title(f"trace: {trace}")
        axes[0][j].set_xlabel("seconds since fit()")
        axes[0][j].set_ylabel("samples in the model")
        axes[1][j].set_xlabel("samples in the model")
        axes[1][j].set_ylabel("cumulative cost (USD, benchmark units)")
        axes[0][j].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_pareto(results: Dict[str, Any], path: str) -> None:
    """Cost per 1k samples against wall time: one point per system, one panel per trace
    (real-world units on the axes; lower-left is better; the dashed line is the deadline)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results.get("summary", {})
    if not summary:
        return
    k = results.get("time_scale", {}).get("real_s_per_sim_s", 1.0)
    fig, axes = plt.subplots(1, len(summary), figsize=(4.0 * len(summary), 3.8), squeeze=False)
    for j, (trace, row) in enumerate(summary.items()):
        ax = axes[0][j]
        for system, v in row.items():
            if not isinstance(v, dict) or v.get("cost_per_1k_samples_usd") is None:
                continue
            x, y = v["wall_s"] * k / 60.0, v["cost_per_1k_samples_usd"] * k
            ax.scatter([x], [y], color=COLORS.get(system, "grey"), s=40,
                       marker="o" if v.get("finished") else "x", label=system)
            ax.annotate(system.replace("raylastic_", "rl_"), (x, y), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        deadline = results.get("deadline_s", {}).get(trace)
        if deadline:
            ax.axvline(deadline * k / 60.0, color="grey", ls="--", lw=0.8)
        ax.set_title(f"trace: {trace}")
        ax.set_xlabel("wall time (real minutes)")
        ax.set_ylabel("USD per 1k samples (real)")
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown_table(results: Dict[str, Any]) -> str:
    """The README's table: per trace and system, cost per 1k samples and wall time in both
    units, goodput, samples trained again, deadline met, and the ratios to on-demand-only
    and Ray Train."""
    k = results.get("time_scale", {}).get("real_s_per_sim_s", 1.0)
    lines = [f"| trace | system | $ / 1k samples (real, x{k:g}) | wall s (real min) | vs on-demand | "
             "vs Ray Train: cost / wall | goodput | samples redone | deadline met |",
             "|---|---|---|---|---|---|---|---|---|"]
    for trace, row in results.get("summary", {}).items():
        for system in SYSTEMS:
            v = row.get(system)
            if not isinstance(v, dict) or v.get("cost_per_1k_samples_usd") is None:
                continue
            vs_od = row.get(f"{system}_vs_on_demand", 1.0 if system == "raylastic_on_demand" else None)
            rt = (f"{row[f'{system}_vs_ray_train']:.2f}x / {row[f'{system}_wall_vs_ray_train']:.2f}x"
                  if f"{system}_vs_ray_train" in row else "")
            lines.append(
                f"| {trace} | {system} | {v['cost_per_1k_samples_usd']:.5f} ({v['cost_per_1k_samples_real_usd']:.4f}) | "
                f"{v['wall_s']:.0f} ({v['wall_real_s'] / 60:.0f}) | {'' if vs_od is None else f'{vs_od:.2f}x'} | {rt} | "
                f"{v['goodput']:.2f} | {v['samples_trained_again']} | "
                f"{'yes' if v['deadline_met'] else 'no'}{'' if v.get('finished') else ' (unfinished)'} |")
    return "\n".join(lines)


def main() -> None:
    from raylastic.sim import TimeScale, load_trace, shipped_trace

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--traces", nargs="+", choices=TRACES, default=None,
                   help=f"shipped traces (default: all of {', '.join(TRACES)}, or none with --trace-file)")
    p.add_argument("--trace-file", action="append", default=[], metavar="PATH",
                   help="a trace in the docs/traces.md format, named by its file stem (repeatable)")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(DEFAULT_SYSTEMS))
    p.add_argument("--deadline-s", type=float, default=None,
                   help=f"raylastic_deadline's deadline in benchmark seconds (default {DEADLINE_FACTOR}x "
                        "the on-demand-only wall time, measured first)")
    p.add_argument("--time-scale", type=float, default=TIME_SCALE,
                   help="real seconds per benchmark second (raylastic.sim.timescale)")
    p.add_argument("--epochs", type=int, default=WORK["epochs"])
    p.add_argument("--quick", action="store_true", help="2 epochs, calm and busy only")
    p.add_argument("--fit-timeout-s", type=float, default=900.0)
    p.add_argument("--merge", action="store_true", help="update the existing JSON instead of replacing it")
    p.add_argument("--out", default=os.path.join(RESULTS, "spot_economics.json"))
    p.add_argument("--table", action="store_true", help="print the markdown table of --out and exit")
    args = p.parse_args()
    if args.table:
        with open(args.out, encoding="utf-8") as fh:
            print(markdown_table(json.load(fh)))
        return
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")
    scale = TimeScale(args.time_scale)
    work = dict(WORK, epochs=2 if args.quick else args.epochs)
    traces: Dict[str, Any] = {}
    for name in (["calm", "busy"] if args.quick else (args.traces or ([] if args.trace_file else TRACES))):
        traces[name] = shipped_trace(name)
    for path in args.trace_file:
        trace = load_trace(path)
        trace.check_node_types(("spot", "on_demand"))
        traces[os.path.splitext(os.path.basename(path))[0]] = trace
    results: Dict[str, Any] = {}
    if args.merge and os.path.exists(args.out):
        with open(args.out, encoding="utf-8") as fh:
            results = json.load(fh)
        if results.get("work") != work or results.get("time_scale", {}).get("real_s_per_sim_s") != scale.real_s_per_sim_s:
            sys.exit(f"--merge: {args.out} was measured with another workload or time scale")
    results.update({
        "benchmark": "spot_economics", "work": work, "min_workers": MIN_WORKERS, "max_workers": MAX_WORKERS,
        "prices_usd_per_hour": {"spot": 0.30, "on_demand": 1.00}, "time_scale": scale.to_record(),
        "units": "benchmark seconds and the dollars they bill; *_real_* keys: times x real_s_per_sim_s, "
                 "node-seconds and dollars likewise",
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
        "ray_train_env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]},
        "command": " ".join(["python", "benchmarks/spot_economics.py"] + sys.argv[1:]),
    })
    results.setdefault("commands", []).append({"command": results["command"], "started": time.strftime(
        "%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "traces": list(traces), "systems": list(args.systems),
        "commit": _commit()})
    results.setdefault("traces", {})
    results.setdefault("deadline_s", {})
    root = tempfile.mkdtemp(prefix="raylastic-spot-econ-")

    def save():
        results["summary"] = summarize(results)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(results, fh, indent=1)
        base = os.path.splitext(args.out)[0]
        plot(results, base + ".png")
        plot_pareto(results, base + "_pareto.png")

    need_od = "raylastic_on_demand" in args.systems or (
        "raylastic_deadline" in args.systems and args.deadline_s is None and not results.get("baseline_on_demand"))
    if need_od:
        print("== raylastic_on_demand (no trace: nothing preempts on-demand nodes)", flush=True)
        results["baseline_on_demand"] = run_one("raylastic_on_demand", None, None, work, root, args.fit_timeout_s,
                                                scale, None)
        _print(results["baseline_on_demand"])
        save()
    od_wall = (results.get("baseline_on_demand") or {}).get("wall_s")
    deadline_s = args.deadline_s if args.deadline_s is not None else (
        round(DEADLINE_FACTOR * od_wall, 1) if od_wall else None)
    for name, trace in traces.items():
        results["deadline_s"][name] = deadline_s
        for system in (s for s in args.systems if s != "raylastic_on_demand"):
            print(f"== {system} on trace {name}", flush=True)
            r = run_one(system, trace, name, work, root, args.fit_timeout_s, scale,
                        deadline_s if system == "raylastic_deadline" else None)
            results["traces"].setdefault(name, {})[system] = r
            _print(r)
            save()
    save()
    print(json.dumps(results["summary"], indent=1))


def _commit() -> Optional[str]:
    """The raylastic commit this ran (None outside a git checkout)."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _print(r: Dict[str, Any]) -> None:
    keys = ("system", "trace", "finished", "wall_s", "cost_usd", "cost_per_1k_samples_usd", "goodput",
            "samples_trained_again", "below_min_workers_s", "world_sizes", "deadline_s", "deadline_met",
            "release_to_gone_s", "error")
    print(json.dumps({k: r.get(k) for k in keys}), flush=True)


if __name__ == "__main__":
    main()
