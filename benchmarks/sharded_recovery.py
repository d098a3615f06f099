"""Sharded-state recovery benchmark: raylastic vs Ray Train 2.60's elastic TorchTrainer,
FSDP2 and DeepSpeed ZeRO-3, on the same local multi-node cluster (head without CPUs +
3 one-CPU worker nodes, the same fast GCS failure detection for both).

Train functions: ``benchmarks/workloads/sharded.py`` (one wide MLP, shipped to the workers
by value; raylastic keeps
its state in ``ElasticState``, Ray Train checkpoints it the documented way: every rank
saves its shard with ``torch.distributed.checkpoint`` (FSDP2) or
``engine.save_checkpoint`` (DeepSpeed) every ``--checkpoint-every`` steps and at once on a
preemption notice, and loads it on a restart).

One run per (system, framework), 3 workers (min 2, max 3), this schedule:

  at step K remove a worker node without notice -> M steps on the smaller group ->
  add a node back -> M steps at world size 3 -> drain a worker node with a
  ``--notice-s`` deadline (a spot termination notice, Ray's DrainNode API), remove it at
  the deadline -> M steps on the smaller group -> stop.

Rank 0 appends (wall time, step, world size) at the end of every optimizer step to one
file; every rank appends its step time, RSS, snapshot bytes and snapshot stall. Measured
per event:

- loss_to_next_step_s: node removed -> next step completed on the smaller group
  (announced: negative when the group shrank before the node died)
- notice_to_next_step_s (announced): notice -> next step on the smaller group
- steps_redone: steps completed before the new group's first step that it trained again
- training_gap_s: the old group's last step -> the new group's first (it holds one step)
- pause_s: the gap less one steady step of the new group: how long no step ran
- source: where the new group's state came from (raylastic: the ``checkpoint_restored``
  events' ``source``; Ray Train: what its train function loaded, or the load error)
- snapshot stall: ``ElasticState._half.blocked_s`` per step / the steady step time
- host memory per rank: ``ElasticState.snapshot_bytes()`` and the process RSS

Writes benchmarks/results/sharded_recovery.json.
Usage: python benchmarks/sharded_recovery.py [--quick] [--systems ...] [--frameworks ...]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _driver import (  # noqa: E402  (this folder's shared benchmark driver)
    RESULTS, Terminated, cut_short, elastic_or_ray_train_fit, fresh_cluster, gap, lose_node, on_sigterm, read_log,
    redone, restored, run_events, run_header, runs, start_fit, timed, wait,
)


def run_schedule(cluster, fit: Callable[[], Any], log_dir: str, stop_path: str, kill_at: int, between: int,
                 notice_s: float, timeout_s: float, kill_delay_s: float = 0.0) -> Dict[str, Any]:
    steps_path = os.path.join(log_dir, "steps.jsonl")
    log = lambda: read_log(steps_path)  # noqa: E731
    t_fit = time.time()
    th, box = start_fit(fit)
    marks: Dict[str, Any] = {"t_fit": t_fit}
    try:
        # 1. a node removed without notice
        small = lose_node(cluster, log, marks, timeout_s, after_step=kill_at, delay_s=kill_delay_s,
                          what="a step on the smaller group (after the loss)")
        wait(lambda: len([r for r in log() if r["t"] > small["t"]]) >= between, timeout_s, "steps at world 2")
        # 2. a node added back
        marks["t_add"] = time.time()
        cluster.add_node()
        grown = wait(lambda: [r for r in log() if r["t"] > marks["t_add"] and r["world"] == 3], timeout_s,
                     "a step at world size 3")[0]
        marks["first_grown"] = grown
        wait(lambda: len([r for r in log() if r["t"] > grown["t"]]) >= between, timeout_s, "steps at world 3")
        # 3. a node drained with a notice, removed at the deadline
        small2 = lose_node(cluster, log, marks, timeout_s, notice_s=notice_s, suffix="2",
                           what="a step on the smaller group (after the notice)")
        wait(lambda: len([r for r in log() if r["t"] > max(small2["t"], marks["t_kill2"])]) >= max(2, between // 2),
             timeout_s, "steps after the drained node left")
    except TimeoutError as e:
        marks["timeout"] = str(e)
    except Terminated:
        marks["timeout"] = "terminated (SIGTERM) before the schedule finished"
        marks["terminated"] = True
    open(stop_path, "w").close()
    # SIGTERM: summarize at once: `timeout -k` SIGKILLs soon after it (gpu_session.sh). A
    # Ray Train run's numbers were lost that way (2026-11-28): Ray's own SIGTERM handler
    # (drain 30 s) had replaced ours, which LocalCluster now keeps, and this waited 15 s.
    th.join(2 if marks.get("terminated") else timeout_s)
    if th.is_alive():
        marks.setdefault("timeout", "fit() did not return after the stop flag")
    return summarize(log_dir, marks, box)


def _steady(rows: List[Dict[str, Any]], until: float, world: int = 3) -> List[float]:
    seg = [r for r in rows if r["t"] <= until and r["world"] == world]
    return [b["t"] - a["t"] for a, b in zip(seg, seg[1:]) if b["step"] == a["step"] + 1][2:]


def _stats(log_dir: str, until: float) -> Dict[str, Any]:
    """Per rank, at world size 3 before the first loss: snapshot stall per step, memory."""
    per_rank = {}
    for path in sorted(glob.glob(os.path.join(log_dir, "stats-*.jsonl"))):
        rows = [r for r in read_log(path) if r["t"] <= until and r["world"] == 3]
        if not rows:
            continue
        rank = rows[0]["rank"]
        stall = [b["blocked_s"] - a["blocked_s"] for a, b in zip(rows, rows[1:])
                 if "blocked_s" in a and "blocked_s" in b and b["step"] == a["step"] + 1
                 and b["blocked_s"] >= a["blocked_s"]][2:]
        ckpt = [r["ckpt_s"] for r in rows if r.get("ckpt_s") is not None]
        plain = [r["step_s"] for r in rows if r.get("ckpt_s") is None][2:]
        per_rank[rank] = {
            "rss_max_mb": round(max(r["rss"] for r in rows) / 2**20, 1),
            "snapshot_bytes_max_mb": round(max(r.get("snapshot_bytes", 0) for r in rows) / 2**20, 1) or None,
            "stall_per_step_s_median": round(statistics.median(stall), 5) if stall else None,
            "step_s_median_in_fn": round(statistics.median(plain), 4) if plain else None,
            "checkpoint_save_s_median": round(statistics.median(ckpt), 3) if ckpt else None,
        }
    return per_rank


def summarize(log_dir: str, marks: Dict[str, Any], box: Dict[str, Any]) -> Dict[str, Any]:
    rows = read_log(os.path.join(log_dir, "steps.jsonl"))
    resumes = read_log(os.path.join(log_dir, "resumes.jsonl"))
    out: Dict[str, Any] = {"world_sizes_seen": runs([r["world"] for r in rows]), "total_steps_logged": len(rows)}
    if rows:
        out["fit_to_first_step_s"] = round(rows[0]["t"] - marks["t_fit"], 3)
    if "timeout" in marks:
        out["incomplete"] = marks["timeout"]
    if "error" in box:
        out["fit_error"] = f"{type(box['error']).__name__}: {box['error']}"[:2000]
    t_kill = marks.get("t_kill", float("inf"))
    dts = _steady(rows, t_kill)
    out["steady_step_s"] = round(statistics.median(dts), 4) if dts else None
    per_rank = _stats(log_dir, t_kill)
    out["per_rank"] = per_rank

    def source_after(t: float) -> Optional[Dict[str, Any]]:
        later = [r for r in resumes if r["t"] > t]
        if not later:
            return None
        r = later[0]
        return {k: r[k] for k in ("source", "start", "world", "error", "load_s") if r.get(k) is not None}

    if "first_small" in marks:
        f = marks["first_small"]
        out["unannounced"] = {
            "loss_to_next_step_s": round(f["t"] - marks["t_kill"], 3),
            "steps_redone": redone(rows, f),
            "training_gap_s": gap(rows, f),
            "pause_s": pause(rows, f),
            "resumed_at_step": f["step"],
            "train_fn_resume": source_after(marks["t_kill"]),
        }
    if "first_grown" in marks:
        f = marks["first_grown"]
        out["scale_up"] = {"added_to_first_step_s": round(f["t"] - marks["t_add"], 3),
                           "steps_redone": redone(rows, f), "training_gap_s": gap(rows, f),
                           "pause_s": pause(rows, f), "train_fn_resume": source_after(marks["t_add"])}
    if "first_small2" in marks:
        f = marks["first_small2"]
        out["announced"] = {
            "notice_s": round(marks["t_kill2"] - marks["t_notice2"], 2),
            "notice_to_next_step_s": round(f["t"] - marks["t_notice2"], 3),
            "loss_to_next_step_s": round(f["t"] - marks["t_kill2"], 3),
            "steps_redone": redone(rows, f),
            "training_gap_s": gap(rows, f),
            "pause_s": pause(rows, f),
            "train_fn_resume": source_after(marks["t_notice2"]),
        }
    stalls = [v["stall_per_step_s_median"] for v in per_rank.values() if v.get("stall_per_step_s_median") is not None]
    if stalls and out["steady_step_s"]:
        out["snapshot_stall_share_of_step"] = round(max(stalls) / out["steady_step_s"], 4)
    events = run_events(box.get("result"))
    if events is not None:
        out["checkpoint_restored"] = restored(events, ("ts", "index", "source", "broadcast"))
        out["checkpoint_invalid"] = [{k: e.get(k) for k in ("source", "reason")}
                                     for e in events if e["kind"] == "checkpoint_invalid"]
        for key, t in (("unannounced", marks.get("t_kill")), ("scale_up", marks.get("t_add")),
                       ("announced", marks.get("t_notice2"))):
            if key in out and t is not None:
                nxt = [e for e in out["checkpoint_restored"] if e.get("ts", 0) > t]
                out[key]["source"] = nxt[0]["source"] if nxt else None
        for e in out["checkpoint_restored"]:
            e.pop("ts", None)
    else:  # Ray Train: what its train function loaded
        for key in ("unannounced", "scale_up", "announced"):
            if key in out and out[key].get("train_fn_resume"):
                out[key]["source"] = out[key]["train_fn_resume"]["source"]
    out["resumes"] = resumes
    if marks.get("terminated"):
        out["terminated"] = True
    return out


def pause(rows: List[Dict[str, Any]], first: Dict[str, Any]) -> Optional[float]:
    """How long no step ran: the training gap (the old group's last step -> the new
    group's first) less one steady step of the new group (its first -> its second), the
    part of the gap a step at that size takes anyway. None without a second step."""
    g = gap(rows, first)
    after = [r for r in rows if r["t"] > first["t"] and r["world"] == first["world"]]
    if g is None or not after or after[0]["step"] != first["step"] + 1:
        return None
    return round(g - (after[0]["t"] - first["t"]), 3)


def make_fit(system: str, framework: str, cfg: Dict[str, Any], storage: str, name: str,
             checkpoint_every: int, cpus_per_worker: int = 1) -> Callable[[], Any]:
    from workloads import by_value
    import workloads.sharded as sharded

    by_value(sharded)
    fn = sharded.fsdp2_bench if framework == "fsdp2" else sharded.deepspeed_bench
    return elastic_or_ray_train_fit(system, fn, cfg, storage, name, checkpoint_every,
                                    ray_train_cfg={"checkpoint_every": checkpoint_every},
                                    cpus_per_worker=cpus_per_worker)


def _range(vals: List[Any]) -> Any:
    vals = [v for v in vals if isinstance(v, (int, float))]
    if not vals:
        return None
    return [min(vals), max(vals)] if len(vals) > 1 else vals[0]


def targets(res: Dict[str, Any], fw: str) -> Dict[str, Any]:
    """The issue's targets for raylastic on ``fw``, from the first repeat of each system."""
    mine, ray = res.get(f"raylastic/{fw}", [{}])[0], res.get(f"ray_train/{fw}", [{}])[0]
    out: Dict[str, Any] = {}
    for ev in ("unannounced", "announced"):
        a, b = mine.get(ev, {}), ray.get(ev, {})
        # node loss -> next completed step; 0 when the group had moved off before the node died
        rec = None if a.get("loss_to_next_step_s") is None else max(0.0, a["loss_to_next_step_s"])
        ref = None if b.get("loss_to_next_step_s") is None else max(0.0, b["loss_to_next_step_s"])
        out[ev] = {
            "recovery_s": rec, "ray_train_recovery_s": ref,
            "ratio_to_ray_train": round(rec / ref, 4) if rec is not None and ref and ref > 0 else None,
            "recovery_le_5s": rec is not None and rec <= 5,
            "recovery_le_tenth_of_ray_train": rec is not None and bool(ref) and rec <= ref / 10,
            "training_gap_s": a.get("training_gap_s"), "ray_train_training_gap_s": b.get("training_gap_s"),
            "pause_s": a.get("pause_s"), "ray_train_pause_s": b.get("pause_s"),
            "pause_le_1s": a.get("pause_s") is not None and a["pause_s"] <= 1.0,
            "steps_redone": a.get("steps_redone"), "ray_train_steps_redone": b.get("steps_redone"),
            "steps_redone_ok": a.get("steps_redone") is not None
            and a["steps_redone"] <= (1 if ev == "unannounced" else 0),
        }
    share = mine.get("snapshot_stall_share_of_step")
    out["snapshot_stall_share"] = share
    out["snapshot_stall_le_5pct"] = share is not None and share <= 0.05
    return out


def finish(results: Dict[str, Any], frameworks: List[str], out: str) -> None:
    """Ranges over repeats and the targets; (re)written after every run, so a run cut
    short by a time limit still leaves the numbers measured so far."""
    ranges: Dict[str, Any] = {}
    for key, reps in results["runs"].items():
        ranges[key] = {
            f"{ev}.{m}": _range([r.get(ev, {}).get(m) for r in reps])
            for ev in ("unannounced", "announced", "scale_up")
            for m in ("loss_to_next_step_s", "notice_to_next_step_s", "training_gap_s", "pause_s", "steps_redone",
                      "added_to_first_step_s")
            if any(m in r.get(ev, {}) for r in reps)
        }
        ranges[key]["steady_step_s"] = _range([r.get("steady_step_s") for r in reps])
        ranges[key]["snapshot_stall_share_of_step"] = _range([r.get("snapshot_stall_share_of_step") for r in reps])
    results["ranges"] = ranges
    results["targets"] = {fw: targets(results["runs"], fw) for fw in frameworks}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as fh:
        json.dump(results, fh, indent=1)


def table(results: Dict[str, Any]) -> str:
    """The README table (markdown) from a results JSON."""
    m = results["model"]
    lines = [f"{m['params'] / 1e6:.1f} M parameters ({m['state_mb_total']:.0f} MB fp32 params + Adam), 3 CPU workers, "
             f"`{results['command']}`, {results['date']}",
             "",
             "| | raylastic FSDP2 | Ray Train FSDP2 | raylastic ZeRO-3 | Ray Train ZeRO-3 |",
             "|---|---|---|---|---|"]
    cols = [results["runs"].get(k, [{}])[0] for k in
            ("raylastic/fsdp2", "ray_train/fsdp2", "raylastic/zero3", "ray_train/zero3")]

    def cell(r: Dict[str, Any], ev: str, key: str, fmt: str = "{}") -> str:
        v = r.get(ev, {}).get(key)
        return "-" if v is None else fmt.format(v)

    def mem(r: Dict[str, Any]) -> str:
        pr = r.get("per_rank", {})
        if not pr:
            return "-"
        rss = max(v["rss_max_mb"] for v in pr.values())
        snap = max((v.get("snapshot_bytes_max_mb") or 0) for v in pr.values())
        return f"{rss:.0f} MB RSS" + (f", {snap:.0f} MB snapshots" if snap else "")

    rows = [
        ("steady step (s)", lambda r: "-" if r.get("steady_step_s") is None else f"{r['steady_step_s']:.3f}"),
        ("node lost without notice -> next step (s)", lambda r: cell(r, "unannounced", "loss_to_next_step_s", "{:.1f}")),
        ("training gap (no notice) (s)", lambda r: cell(r, "unannounced", "training_gap_s", "{:.1f}")),
        ("pause: gap less a step (no notice) (s)", lambda r: cell(r, "unannounced", "pause_s", "{:.1f}")),
        ("steps redone (no notice)", lambda r: cell(r, "unannounced", "steps_redone")),
        ("state came from (no notice)", lambda r: cell(r, "unannounced", "source")),
        ("10 s notice -> next step on 2 (s)", lambda r: cell(r, "announced", "notice_to_next_step_s", "{:.1f}")),
        ("node gone -> next step (notice) (s)", lambda r: cell(r, "announced", "loss_to_next_step_s", "{:.1f}")),
        ("training gap (notice) (s)", lambda r: cell(r, "announced", "training_gap_s", "{:.1f}")),
        ("pause: gap less a step (notice) (s)", lambda r: cell(r, "announced", "pause_s", "{:.1f}")),
        ("steps redone (notice)", lambda r: cell(r, "announced", "steps_redone")),
        ("state came from (notice)", lambda r: cell(r, "announced", "source")),
        ("node added -> first step on 3 (s)", lambda r: cell(r, "scale_up", "added_to_first_step_s", "{:.1f}")),
        ("snapshot stall / step", lambda r: "-" if r.get("snapshot_stall_share_of_step") is None
         else f"{100 * r['snapshot_stall_share_of_step']:.1f}%"),
        ("host memory per rank (max)", mem),
    ]
    for label, f in rows:
        lines.append(f"| {label} | " + " | ".join(f(c) if c else "not run" for c in cols) + " |")
    return "\n".join(lines)


def main() -> Optional[int]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few-M-parameter model, few steps (smoke run)")
    ap.add_argument("--hidden", type=int, default=None, help="default 3584 (quick: 768)")
    ap.add_argument("--layers", type=int, default=None, help="default 5 (quick: 4)")
    ap.add_argument("--d-in", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--systems", default="raylastic,ray_train")
    ap.add_argument("--frameworks", default="fsdp2,zero3")
    ap.add_argument("--kill-at", type=int, default=None, help="default 8 (quick: 6)")
    ap.add_argument("--between", type=int, default=None, help="steps between events; default 4 (quick: 3)")
    ap.add_argument("--checkpoint-every", type=int, default=5,
                    help="Ray Train's checkpoint cadence and raylastic's persist_every")
    ap.add_argument("--notice-s", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--cpus-per-worker", type=int, default=1,
                    help="CPUs per worker node and worker (its torch threads); default 1")
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--kill-delay-s", type=float, default=0.0,
                    help="remove the node this long after step --kill-at is logged (default 0: at its commit, "
                         "while the snapshot's peer copy runs)")
    ap.add_argument("--events-dir", help="copy each raylastic run's event log here (<system>_<framework>_<repeat>.jsonl)")
    ap.add_argument("--lean", nargs="?", const=True, default=False, choices=[True, "in_place"],
                    help="raylastic with ElasticState(lean_snapshots=True): one snapshot kept, 2x the own shard "
                         "(3x during a commit's peer copy, which the next optimizer step waits for); "
                         "'--lean in_place': 2x throughout (a loss during a peer copy restores from storage)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "sharded_recovery.json"))
    ap.add_argument("--table", metavar="JSON", help="print the README table of a results file and exit")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as fh:
            print(table(json.load(fh)))
        return
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")  # as in recovery.py

    from raylastic.testing.cluster import FAST_FAILURE_DETECTION
    from workloads.sharded import n_params

    hidden = args.hidden or (768 if args.quick else 3584)
    layers = args.layers or (4 if args.quick else 5)
    kill_at = args.kill_at or (6 if args.quick else 8)
    between = args.between or 3 if args.quick else (args.between or 4)
    model = {"d_in": args.d_in, "hidden": hidden, "layers": layers, "global_batch": args.global_batch,
             "lr": 1e-4, "seed": 0, "zero_stage": 3}
    nparams = n_params(model)
    import ray
    import torch

    try:
        import deepspeed
        ds_version = deepspeed.__version__
    except Exception:  # noqa: BLE001
        ds_version = None
    results: Dict[str, Any] = {
        **run_header("sharded_recovery"),
        "quick": args.quick,
        "model": dict(model, params=nparams, state_mb_total=round(3 * 4 * nparams / 2**20, 1),
                      state_mb_per_rank_at_3=round(4 * nparams / 2**20, 1),
                      note="fp32 params + 2 Adam moments; MLP d_in -> hidden x layers -> 1"),
        "schedule": {"workers": "min 2, max 3", "kill_at_step": kill_at, "kill_delay_s": args.kill_delay_s,
                     "steps_between_events": between,
                     "notice_s": args.notice_s, "ray_train_checkpoint_every": args.checkpoint_every,
                     "raylastic_persist_every": args.checkpoint_every, "raylastic_snapshot_every": 1,
                     "raylastic_lean_snapshots": args.lean,
                     "events": ["node removed without notice", "node added", "node drained with notice, "
                                "removed at the deadline"]},
        "cluster": f"ray.cluster_utils.Cluster: head (0 CPU) + 3 x {args.cpus_per_worker}-CPU worker nodes "
                   "on one machine, one worker per node",
        "failure_detection": FAST_FAILURE_DETECTION,
        "ray_train_env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "note": "CPU only, gloo; other jobs may share the CPUs"},
        "versions": {"ray": ray.__version__, "torch": torch.__version__, "deepspeed": ds_version},
        "runs": {},
    }
    systems = [s for s in args.systems.split(",") if s]
    frameworks = [f for f in args.frameworks.split(",") if f]
    print(f"model: {nparams / 1e6:.1f} M parameters", flush=True)
    import signal

    signal.signal(signal.SIGTERM, on_sigterm)
    for rep in range(args.repeats):
        for fw in frameworks:
            for system in systems:
                key = f"{system}/{fw}"
                with fresh_cluster(cpus_per_node=args.cpus_per_worker) as (tmp, log_dir, cluster):
                    cfg = dict(model, zero_stage=3, log_dir=log_dir, stop_path=os.path.join(tmp, "stop"),
                               lean_snapshots=args.lean)
                    name = f"sharded_{system}_{fw}_{rep}"
                    fit = make_fit(system, "fsdp2" if fw == "fsdp2" else "zero3", cfg,
                                   os.path.join(tmp, "storage"), name, args.checkpoint_every,
                                   args.cpus_per_worker)
                    print(f"== {key} (repeat {rep})", flush=True)
                    res = timed(run_schedule, cluster, fit, log_dir, cfg["stop_path"], kill_at, between,
                                args.notice_s, args.timeout_s, args.kill_delay_s)
                    results["runs"].setdefault(key, []).append(res)
                    events = os.path.join(tmp, "storage", name, "events.jsonl")
                    if args.events_dir and os.path.exists(events):
                        os.makedirs(args.events_dir, exist_ok=True)
                        shutil.copy(events, os.path.join(args.events_dir, f"{system}_{fw}_{rep}.jsonl"))
                    print(json.dumps({k: v for k, v in res.items() if k != "resumes"}, indent=1), flush=True)
                    finish(results, frameworks, args.out)
                    if cut_short(res, args.out):
                        return 1
    print(json.dumps(results["targets"], indent=1))
    print(table(results))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
