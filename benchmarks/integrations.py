"""Integrations benchmark: an elastic Hugging Face ``Trainer`` and an elastic Lightning
``Trainer`` through a node loss, raylastic vs Ray Train 2.60, in one run, on the same local
cluster (head without CPUs + 3 one-CPU worker nodes, the same fast GCS failure detection for
both; min 2 / max 3 workers).

Train functions: ``benchmarks/workloads/integrations.py`` (shipped to the workers by value).
The same script per framework, run two ways:

- raylastic: ``ElasticTrainer`` + ``raylastic.integrations.{transformers,lightning}.prepare_trainer``
  (state from the survivors' memory; ``persist_every = --checkpoint-every`` to storage);
- Ray Train: ``ray.train.torch.TorchTrainer(num_workers=(2, 3))`` with Ray's documented
  integration (HF: ``RayTrainReportCallback`` + ``prepare_trainer``, ``save_steps =
  --checkpoint-every``, ``trainer.train(resume_from_checkpoint=...)``; Lightning:
  ``RayDDPStrategy``, ``RayLightningEnvironment``, ``RayTrainReportCallback`` (a checkpoint
  per epoch; an epoch is ``--checkpoint-every`` steps), ``prepare_trainer``,
  ``trainer.fit(ckpt_path=...)``), restarted from the last checkpoint.

Schedule per (framework, system): ``--max-steps`` optimizer steps at a fixed global batch;
when rank 0 logs step ``--kill-at`` a worker node is removed without notice; the run goes on
with 2 workers to the end. Measured from rank 0's per-step log and the driver's clock:

- loss_to_next_step_s: node removed -> next optimizer step completed by the group of 2
- steps_redone: steps completed before that group's first step that it trained again
- training_gap_s: last step before the loss -> the group of 2's first step
- goodput: productive step time / wall time, where productive step time = for every step of
  the final trajectory, the median steady step time at the world size it ran at; wall time =
  ``fit()`` called -> last step (``goodput``) and first step -> last step
  (``goodput_after_first_step``, which leaves out cluster/worker start-up); the targets also
  give ``goodput_common_step_time``: both systems' steps counted at the faster system's
  steady step time, so a slower step is charged to the system that has it

Writes benchmarks/results/integrations.json (``--out``).
Usage: python benchmarks/integrations.py [--quick] [--frameworks hf,lightning] [--systems raylastic,ray_train]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _driver import (  # noqa: E402  (this folder's shared benchmark driver)
    RESULTS, Terminated, cut_short, elastic_or_ray_train_fit, fresh_cluster, gap, lose_node, on_sigterm, read_log,
    redone, restored, run_events, run_header, runs, start_fit, timed,
)

MODELS = {
    # HF: GPT-2 built from a config (no download); Lightning: a wide MLP LightningModule
    "hf": {"full": dict(vocab=8192, seq=64, n_embd=640, n_layer=9, n_head=10, global_batch=6, micro_batch=1),
           "quick": dict(vocab=1024, seq=32, n_embd=128, n_layer=2, n_head=4, global_batch=6, micro_batch=1)},
    "lightning": {"full": dict(d_in=64, hidden=3584, layers=5, global_batch=12, micro_batch=2),
                  "quick": dict(d_in=64, hidden=512, layers=3, global_batch=12, micro_batch=2)},
}


def make_fit(system: str, framework: str, cfg: Dict[str, Any], storage: str, name: str,
             checkpoint_every: int) -> Callable[[], Any]:
    from workloads import by_value
    import workloads.integrations as wl

    by_value(wl)
    fn = wl.hf_bench if framework == "hf" else wl.lightning_bench
    return elastic_or_ray_train_fit(system, fn, cfg, storage, name, checkpoint_every)


def _steady(rows: List[Dict[str, Any]], world: int) -> List[float]:
    """Step times at ``world`` between consecutive steps of one group (the first 2 of each
    group left out: they carry start-up and warm-up)."""
    out: List[float] = []
    run: List[Dict[str, Any]] = []
    for r in rows + [None]:  # type: ignore[list-item]
        if r is not None and run and r["world"] == run[-1]["world"] and r["step"] == run[-1]["step"] + 1:
            run.append(r)
            continue
        if run and run[0]["world"] == world:
            out += [b["t"] - a["t"] for a, b in zip(run, run[1:])][1:]
        run = [r] if r is not None else []
    return out


def summarize(rows: List[Dict[str, Any]], resumes: List[Dict[str, Any]], marks: Dict[str, Any],
              box: Dict[str, Any]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"world_sizes_seen": runs([r["world"] for r in rows]), "total_steps_logged": len(rows)}
    if "timeout" in marks:
        out["incomplete"] = marks["timeout"]
    if "error" in box:
        out["fit_error"] = f"{type(box['error']).__name__}: {box['error']}"[:2000]
    if not rows:
        return out
    out["fit_to_first_step_s"] = round(rows[0]["t"] - marks["t_fit"], 3)
    steady = {w: _steady(rows, w) for w in (3, 2)}
    med = {w: statistics.median(v) for w, v in steady.items() if v}
    out["steady_step_s"] = {str(w): round(v, 4) for w, v in med.items()}
    if "first_small" in marks:
        f = marks["first_small"]
        out["loss_to_next_step_s"] = round(f["t"] - marks["t_kill"], 3)
        out["steps_redone"] = redone(rows, f)
        out["training_gap_s"] = gap(rows, f)
        out["resumed_at_step"] = f["step"]
        out["killed_after_step"] = marks["killed_after_step"]
        later = [r for r in resumes if r["t"] > marks["t_kill"]]
        if later:
            r = later[0]
            out["restart"] = {"source": r.get("source"), "start": r.get("start"), "world": r.get("world"),
                              "loss_to_train_fn_s": round(r["t_fn"] - marks["t_kill"], 3) if r.get("t_fn") else None,
                              "loss_to_train_begin_s": round(r["t"] - marks["t_kill"], 3)}
    # goodput: the final trajectory's steps at their world's steady step time / wall time
    final: Dict[int, int] = {}
    for r in rows:
        final[r["step"]] = r["world"]  # the last time a step was trained is the one kept
    fallback = med.get(3) or med.get(2)
    if fallback:
        productive = sum(med.get(w, fallback) for w in final.values())
        t_last = rows[-1]["t"]
        out["productive_step_time_s"] = round(productive, 2)
        out["wall_s_fit_to_last_step"] = round(t_last - marks["t_fit"], 2)
        out["goodput"] = round(productive / (t_last - marks["t_fit"]), 4)
        first_w = rows[0]["world"]
        if t_last > rows[0]["t"]:
            out["goodput_after_first_step"] = round(
                (productive - med.get(first_w, fallback)) / (t_last - rows[0]["t"]), 4)
    out["steps"] = [{"t": round(r["t"] - marks["t_fit"], 3), "step": r["step"], "world": r["world"]} for r in rows]
    out["resumes"] = [dict(r, t=round(r["t"] - marks["t_fit"], 3),
                           t_fn=round(r["t_fn"] - marks["t_fit"], 3) if r.get("t_fn") else None) for r in resumes]
    if "t_kill" in marks:
        out["t_kill"] = round(marks["t_kill"] - marks["t_fit"], 3)
    events = run_events(box.get("result"))
    if events is not None:
        out["checkpoint_restored"] = restored(events, ("index", "source", "broadcast"))
    return out


def run_one(cluster, fit: Callable[[], Any], log_dir: str, kill_at: int, max_steps: int,
            timeout_s: float) -> Dict[str, Any]:
    steps_path = os.path.join(log_dir, "steps.jsonl")
    log = lambda: read_log(steps_path)  # noqa: E731
    marks: Dict[str, Any] = {"t_fit": time.time()}
    th, box = start_fit(fit)
    try:
        lose_node(cluster, log, marks, timeout_s, after_step=kill_at, fit_thread=th)
        th.join(timeout_s)
        if th.is_alive():
            marks["timeout"] = f"fit() did not return within {timeout_s} s after the recovery"
    except TimeoutError as e:
        marks["timeout"] = str(e)
    except Terminated:
        marks["timeout"] = "terminated (SIGTERM)"
        marks["terminated"] = True
    res = summarize(log(), read_log(os.path.join(log_dir, "resumes.jsonl")), marks, box)
    if marks.get("terminated"):
        res["terminated"] = True
    last = max((r["step"] for r in log()), default=0)
    res["completed_all_steps"] = last >= max_steps
    return res


def common_goodput(runs: Dict[str, Any], fw: str) -> Dict[str, Optional[float]]:
    """Goodput with one yardstick for both systems: every step of a run's final trajectory
    counted at the *faster* system's median steady step time at that world size (each run's
    own ``goodput`` counts its own step time as productive, so a slower step would not show)."""
    a, b = runs.get(f"raylastic/{fw}", {}), runs.get(f"ray_train/{fw}", {})
    ref: Dict[str, float] = {}
    for w in ("3", "2"):
        vals = [r.get("steady_step_s", {}).get(w) for r in (a, b) if r.get("steady_step_s", {}).get(w)]
        if vals:
            ref[w] = min(vals)
    out: Dict[str, Optional[float]] = {}
    for name, r in (("raylastic", a), ("ray_train", b)):
        steps, wall = r.get("steps"), r.get("wall_s_fit_to_last_step")
        if not steps or not wall or not ref:
            out[name] = None
            continue
        final: Dict[int, int] = {}
        for row in steps:
            final[row["step"]] = row["world"]
        fallback = ref.get("3") or ref.get("2")
        out[name] = round(sum(ref.get(str(w), fallback) for w in final.values()) / wall, 4)
    return out


def targets(runs: Dict[str, Any], fw: str) -> Dict[str, Any]:
    a, b = runs.get(f"raylastic/{fw}", {}), runs.get(f"ray_train/{fw}", {})
    common = common_goodput(runs, fw)
    rec, ref = a.get("loss_to_next_step_s"), b.get("loss_to_next_step_s")

    def ratio(x, y):
        return round(x / y, 4) if isinstance(x, (int, float)) and isinstance(y, (int, float)) and y > 0 else None

    return {
        "recovery_s": rec, "ray_train_recovery_s": ref, "recovery_ratio": ratio(rec, ref),
        "steps_redone": a.get("steps_redone"), "ray_train_steps_redone": b.get("steps_redone"),
        "goodput": a.get("goodput"), "ray_train_goodput": b.get("goodput"), "goodput_ratio": ratio(
            a.get("goodput"), b.get("goodput")),
        "goodput_after_first_step": a.get("goodput_after_first_step"),
        "ray_train_goodput_after_first_step": b.get("goodput_after_first_step"),
        "goodput_after_first_step_ratio": ratio(a.get("goodput_after_first_step"),
                                                b.get("goodput_after_first_step")),
        "goodput_common_step_time": common["raylastic"], "ray_train_goodput_common_step_time": common["ray_train"],
        "goodput_common_step_time_ratio": ratio(common["raylastic"], common["ray_train"]),
        "training_gap_ratio": ratio(a.get("training_gap_s"), b.get("training_gap_s")),
        "target_recovery_le_5s": rec is not None and rec <= 5,
        "target_steps_redone_le_1": a.get("steps_redone") is not None and a["steps_redone"] <= 1,
        "target_recovery_le_tenth_of_ray_train": rec is not None and bool(ref) and rec <= ref / 10,
    }


def table(results: Dict[str, Any]) -> str:
    fws = [fw for fw in ("hf", "lightning") if any(k.endswith("/" + fw) for k in results["runs"])]
    lines = [f"`{results['command']}`, {results['date']}", "",
             "| | " + " | ".join(f"raylastic {n} | Ray Train {n} | ratio" for n in
                                 ("HF" if fw == "hf" else "Lightning" for fw in fws)) + " |",
             "|---|" + "---|---|---|" * len(fws)]

    def fmt(v: Any, f: str = "{}") -> str:
        return "-" if v is None else f.format(v)

    rows = [
        ("model parameters (M)", lambda r, fw: fmt(results["models"][fw]["params"] / 1e6, "{:.1f}"), None),
        ("steady step at 3 / 2 workers (s)",
         lambda r, fw: f"{fmt(r.get('steady_step_s', {}).get('3'), '{:.2f}')} / "
                       f"{fmt(r.get('steady_step_s', {}).get('2'), '{:.2f}')}", None),
        ("node loss -> next step (s)", lambda r, fw: fmt(r.get("loss_to_next_step_s"), "{:.1f}"), "recovery_ratio"),
        ("training paused (s)", lambda r, fw: fmt(r.get("training_gap_s"), "{:.1f}"), "training_gap_ratio"),
        ("steps redone", lambda r, fw: fmt(r.get("steps_redone")), None),
        ("state came from", lambda r, fw: fmt(r.get("restart", {}).get("source")), None),
        ("goodput (fit() -> last step)", lambda r, fw: fmt(r.get("goodput"), "{:.2f}"), "goodput_ratio"),
        ("goodput, steps at the faster system's step time",
         lambda r, fw: fmt(results["targets"].get(fw, {}).get(
             "goodput_common_step_time" if r is results["runs"].get(f"raylastic/{fw}")
             else "ray_train_goodput_common_step_time"), "{:.2f}"), "goodput_common_step_time_ratio"),
        ("goodput (first -> last step)", lambda r, fw: fmt(r.get("goodput_after_first_step"), "{:.2f}"),
         "goodput_after_first_step_ratio"),
    ]
    for label, f, rkey in rows:
        cells = []
        for fw in fws:
            a, b = results["runs"].get(f"raylastic/{fw}", {}), results["runs"].get(f"ray_train/{fw}", {})
            t = results["targets"].get(fw, {})
            cells += [f(a, fw) if a else "not run", f(b, fw) if b else "not run",
                      fmt(t.get(rkey), "{:.3f}") if rkey else ""]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> Optional[int]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small models (smoke run)")
    ap.add_argument("--frameworks", default="hf,lightning")
    ap.add_argument("--systems", default="raylastic,ray_train")
    ap.add_argument("--max-steps", type=int, default=None, help="default 15 (quick: 12)")
    ap.add_argument("--kill-at", type=int, default=7, help="remove a worker node when rank 0 logs this step")
    ap.add_argument("--checkpoint-every", type=int, default=5,
                    help="Ray Train's checkpoint cadence and raylastic's persist_every")
    ap.add_argument("--timeout-s", type=float, default=300)
    ap.add_argument("--step-sleep-s", type=float, default=None,
                    help="sleep per optimizer step in the script (both systems), so the kill lands mid-run; "
                         "default 0 (quick: 0.3)")
    ap.add_argument("--snapshot-every", type=int, default=1,
                    help="raylastic: keep every N-th step's state in memory (prepare_trainer(snapshot_every=N))")
    ap.add_argument("--out", default=None, help="default benchmarks/results/integrations.json (quick: *_quick.json)")
    ap.add_argument("--table", metavar="JSON", help="print the markdown table of a results file and exit")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as fh:
            print(table(json.load(fh)))
        return None
    out_path = args.out or os.path.join(RESULTS, "integrations_quick.json" if args.quick else "integrations.json")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.1")  # as in recovery.py
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray
    import torch

    from raylastic.testing.cluster import FAST_FAILURE_DETECTION
    from workloads.integrations import hf_params, mlp_params

    import lightning
    import transformers

    max_steps = args.max_steps or (12 if args.quick else 15)
    if args.step_sleep_s is None:
        args.step_sleep_s = 0.3 if args.quick else 0.0
    size = "quick" if args.quick else "full"
    frameworks = [f for f in args.frameworks.split(",") if f]
    systems = [s for s in args.systems.split(",") if s]
    models = {}
    for fw in frameworks:
        m = dict(MODELS[fw][size])
        m["params"] = hf_params(m) if fw == "hf" else mlp_params(m)
        m["state_mb"] = round(3 * 4 * m["params"] / 2**20, 1)
        m["kind"] = "GPT2LMHeadModel from GPT2Config, AdamW" if fw == "hf" else "MLP LightningModule, Adam"
        models[fw] = m
    results: Dict[str, Any] = {
        **run_header("integrations"),
        "quick": args.quick,
        "models": models,
        "schedule": {"workers": "min 2, max 3", "max_steps": max_steps, "step_sleep_s": args.step_sleep_s, "kill_at_step": args.kill_at,
                     "ray_train_checkpoint_every": args.checkpoint_every,
                     "raylastic_persist_every": args.checkpoint_every, "raylastic_snapshot_every": args.snapshot_every,
                     "event": "one worker node removed without notice when rank 0 logged kill_at_step"},
        "cluster": "raylastic.testing.cluster.LocalCluster: head (0 CPU) + 3 x 1-CPU worker nodes on one machine",
        "failure_detection": FAST_FAILURE_DETECTION,
        "ray_train_env": {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "note": "CPU only, gloo, fp32; 3 workers share the CPUs"},
        "versions": {"ray": ray.__version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     "lightning": lightning.__version__},
        "runs": {}, "targets": {},
    }
    for fw in frameworks:
        print(f"{fw}: {models[fw]['params'] / 1e6:.1f} M parameters", flush=True)
    signal.signal(signal.SIGTERM, on_sigterm)
    for fw in frameworks:
        for system in systems:
            key = f"{system}/{fw}"
            with fresh_cluster() as (tmp, log_dir, cluster):
                cfg = dict(models[fw], log_dir=log_dir, work_dir=tmp, max_steps=max_steps,
                           checkpoint_every=args.checkpoint_every, step_sleep_s=args.step_sleep_s,
                           snapshot_every=args.snapshot_every)
                fit = make_fit(system, fw, cfg, os.path.join(tmp, "storage"), f"integrations_{system}_{fw}",
                               args.checkpoint_every)
                print(f"== {key}", flush=True)
                res = timed(run_one, cluster, fit, log_dir, args.kill_at, max_steps, args.timeout_s)
            results["runs"][key] = res
            results["targets"] = {f: targets(results["runs"], f) for f in frameworks}
            print(json.dumps({k: v for k, v in res.items() if k not in ("steps", "resumes")}, indent=1), flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
            with open(out_path, "w") as fh:
                json.dump(results, fh, indent=1)
            if cut_short(res, out_path):
                return 1
    print(json.dumps(results["targets"], indent=1))
    print(table(results))
    print(f"wrote {out_path}")
    return None


if __name__ == "__main__":
    sys.exit(main())
