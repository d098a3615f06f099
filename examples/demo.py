"""raylastic demo: spot-first elastic training on a local simulated spot cloud.

No cloud account, no download. About 3 minutes here:
1. A local spot cloud starts: a Ray head plus Ray's real autoscaler launching local
   raylets of two node types, "spot" ($0.30/h) and "on_demand" ($1.00/h), with capacity
   and preemptions replayed from the shipped trace `demo` (raylastic/sim/traces/demo.csv).
2. An MLP learns the handwritten digits that ship with scikit-learn on up to 3 workers
   (torch DDP over gloo), with a constant global batch whatever the world size, and its
   state in raylastic.ElasticState (an in-memory snapshot every step).
3. The trace preempts a spot node with a 10 s notice (the group shrinks before the node
   dies), then spot capacity dries up: the state is evacuated to storage, raylastic falls
   back to on-demand after `fallback_after_s`, and moves back to spot when it returns.
4. `raylastic report` prints the timeline, recoveries, node-hours and cost against an
   on-demand-only run, and writes three PNGs.

Run: make demo   (or: .venv/bin/python examples/demo.py)
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn

import raylastic
from raylastic import CheckpointConfig, ElasticTrainer, RunConfig, ScalingConfig
from raylastic.data import ElasticDataLoader
from raylastic.testing.datasets import digits  # scikit-learn's handwritten digits, shipped

GLOBAL_BATCH, MICRO_BATCH = 96, 16


def train_func(config):
    train_set, (x_test, y_test) = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # The loader decides which samples form each GLOBAL step, whatever the world size.
    loader = ElasticDataLoader(train_set, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                               shuffle=True, seed=0)
    # Restores the newest state: peers' memory after a resize, storage after evacuation.
    state = raylastic.ElasticState(model=model, optimizer=opt, loader=loader, step=0)
    ctx = raylastic.get_context()
    ddp = nn.parallel.DistributedDataParallel(model) if ctx.get_world_size() > 1 else model
    while True:
        for batch in loader:
            opt.zero_grad()
            loss = 0.0
            # Sync point: DDP all-reduces on the last micro-batch only; each micro-batch's
            # loss is weighted so the gradients add up to the GLOBAL batch mean.
            for (x, y), weight in batch.accumulate(ddp):
                micro = nn.functional.cross_entropy(ddp(x), y) * weight
                micro.backward()
                loss += float(micro.detach())
            opt.step()
            state.step += 1
            metrics = {"step": state.step, "epoch": batch.epoch, "loss": loss * ctx.get_world_size()}
            if state.step % 20 == 0:
                with torch.no_grad():
                    metrics["test_acc"] = float((model(x_test).argmax(1) == y_test).float().mean())
            # Every rank agrees on stopping (no rank left in a collective).
            stop = torch.tensor([float(os.path.exists(config["stop_file"]))])
            if dist.is_initialized():
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)
            state.commit(metrics)  # snapshot + report; persisted every 100 steps
            time.sleep(config["step_sleep_s"])  # a slower "GPU" so the demo is watchable
            if stop.item():
                return


def main() -> None:
    from raylastic.events import EventKind
    from raylastic.policies.capacity import CapacityPolicy
    from raylastic.reporting.cli import main as report_cli
    from raylastic.sim import SpotCloud, shipped_trace
    from raylastic.testing.faults import FitThread, RunWatcher

    storage = os.path.join(tempfile.gettempdir(), "raylastic_demo")
    name = f"digits-spot-{int(time.time())}"
    stop_file = os.path.join(storage, name + ".stop")
    with SpotCloud(capacity={"spot": 3, "on_demand": 2}) as cloud:
        # objective="time" fills the drought with on-demand (what the demo shows); the default,
        # "cost", would wait for spot here: docs/spot.md
        policy = CapacityPolicy(prefer="spot", objective="time", fallback_after_s=10,
                                max_on_demand_workers=2, max_wait_s=180, prices=cloud.prices())
        trainer = ElasticTrainer(
            train_func,
            train_loop_config={"stop_file": stop_file, "step_sleep_s": 0.05},
            scaling_config=ScalingConfig(min_workers=1, max_workers=3, capacity=policy,
                                         validate_resources=False),
            run_config=RunConfig(name=name, storage_path=storage, verbose=True, progress=False,
                                 checkpoint_config=CheckpointConfig(persist_every=100, num_to_keep=2)),
        )
        fit = FitThread(trainer)
        fit.start()
        watcher = RunWatcher(os.path.join(storage, name))
        watcher.wait_for_event(EventKind.FIRST_STEP, timeout_s=180)
        print("\n>>> demo: replaying the 'demo' trace: a preemption at 20 s, a spot drought at 45 s, "
              "spot back at 85 s\n", flush=True)
        cloud.start_trace(shipped_trace("demo"))
        cloud.wait_for_trace(timeout_s=240)
        back = watcher.wait_for_event(EventKind.DECISION, timeout_s=120,
                                      where=lambda e: e.get("decision") == "capacity.migrate_to_spot")
        watcher.wait_for_event(EventKind.FIRST_STEP, timeout_s=120, where=lambda e: e["ts"] > back["ts"])
        time.sleep(3)  # a few steps on spot again
        open(stop_file, "w").close()
        result = fit.wait(timeout_s=180)

    plots = os.path.join(result.path, "plots")
    print()
    report_cli([result.path, "--plots", plots])  # the same as `raylastic report RUN --plots DIR`
    print(f"\nWorld sizes: {' -> '.join(map(str, result.world_sizes))}")
    print(f"Final metrics: {result.metrics}")
    print(f"Plots: {', '.join(sorted(os.path.join(plots, f) for f in os.listdir(plots)))}")
    print(f"Run directory: {result.path}   (raylastic report {result.path} --json)")


if __name__ == "__main__":
    main()
