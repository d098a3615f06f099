"""Node-loss demo: an elastic run on a local multi-node Ray cluster, no cloud account.

What happens (about 1-2 minutes on a laptop):
1. A local Ray cluster starts: a head node without CPUs and 3 one-CPU worker nodes.
   Every node is its own raylet, so removing one is a real node loss.
2. An MLP learns the handwritten digits that ship with scikit-learn, on 2-3 workers
   (torch DDP over gloo), with a constant global batch of 96 whatever the world size.
3. At step 40 a worker node is killed. The two survivors keep their processes, form a
   new process group and resume from the last committed checkpoint.
4. A node is added back; the group grows to 3 at the next checkpoint boundary.
5. The world-size timeline and the final accuracy are printed.

Run: .venv/bin/python examples/node_loss_demo.py   (`make demo` runs the spot demo, examples/demo.py)
"""

from __future__ import annotations

import os
import tempfile
import time

import torch
from torch import nn

import raylastic
from raylastic import CheckpointConfig, ElasticTrainer, RunConfig, ScalingConfig
from raylastic.data import ElasticDataLoader
from raylastic.testing.datasets import digits  # scikit-learn's handwritten digits, shipped
from raylastic.events import EventKind, load_events

EPOCHS = 15
GLOBAL_BATCH = 96
MICRO_BATCH = 16


def train_func(config):
    train_set, (x_test, y_test) = digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    # The loader decides which samples make up each GLOBAL step, independent of the
    # world size; each rank takes its slice in micro-batches (gradient accumulation).
    loader = ElasticDataLoader(train_set, global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH,
                               shuffle=True, seed=0)
    step = 0
    ckpt = raylastic.get_checkpoint()
    if ckpt is not None:  # resume: weights, optimizer, and the data position
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        loader.load_state_dict(state["loader"])
        step = state["step"]
    ctx = raylastic.get_context()
    ddp = nn.parallel.DistributedDataParallel(model) if ctx.get_world_size() > 1 else model
    while loader.epoch < config["epochs"]:
        for batch in loader:
            opt.zero_grad()
            loss = 0.0
            # Sync point: DDP all-reduces only on the last micro-batch (no_sync before);
            # each micro-batch loss is weighted so the sum is the mean over the GLOBAL batch.
            for (x, y), weight in batch.accumulate(ddp):
                micro_loss = nn.functional.cross_entropy(ddp(x), y) * weight
                micro_loss.backward()
                loss += float(micro_loss)
            opt.step()
            step += 1
            # `loss` is this rank's share of the global-batch mean loss.
            metrics = {"step": step, "epoch": batch.epoch, "world_size": ctx.get_world_size(),
                       "loss_share": loss}
            if step % config["checkpoint_every"] == 0:
                with torch.no_grad():
                    metrics["test_acc"] = float((model(x_test).argmax(1) == y_test).float().mean())
                with tempfile.TemporaryDirectory() as d:
                    if ctx.get_world_rank() == 0:
                        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                                    "loader": loader.state_dict(), "step": step},
                                   os.path.join(d, "state.pt"))
                    raylastic.report(metrics, checkpoint=raylastic.Checkpoint.from_directory(d)
                                     if ctx.get_world_rank() == 0 else None)
            else:
                raylastic.report(metrics)
            time.sleep(config["step_sleep_s"])  # a slower "GPU" so the demo is watchable


def main() -> None:
    from raylastic.testing.cluster import LocalCluster
    from raylastic.testing.faults import FitThread, RunWatcher, kill_node_at

    storage = os.path.join(tempfile.gettempdir(), "raylastic_demo")
    name = f"digits-{int(time.time())}"
    with LocalCluster(num_nodes=3) as cluster:
        trainer = ElasticTrainer(
            train_func,
            train_loop_config={"epochs": EPOCHS, "checkpoint_every": 5, "step_sleep_s": 0.1},
            scaling_config=ScalingConfig(min_workers=2, max_workers=3),
            run_config=RunConfig(name=name, storage_path=storage,
                                 checkpoint_config=CheckpointConfig(num_to_keep=3)),
        )
        fit = FitThread(trainer)
        fit.start()
        watcher = RunWatcher(os.path.join(storage, name))
        node = kill_node_at(cluster, watcher, index=40, timeout_s=180)
        print(f"\n>>> demo: killed worker node {node[:8]} at step 40\n", flush=True)
        watcher.wait_for_event(EventKind.FIRST_STEP, timeout_s=120, count=2)
        cluster.add_node()
        print("\n>>> demo: added a worker node back\n", flush=True)
        result = fit.wait(timeout_s=300)

    events = load_events(result.path)
    t0 = events[0]["ts"]
    print("\nWorld-size timeline")
    for e in events:
        if e["kind"] in ("group_formed", "worker_lost", "resize"):
            print(f"  {e['ts'] - t0:6.1f} s  {e['message']}")
    print(f"\nWorld sizes: {' -> '.join(map(str, result.world_sizes))}")
    print(f"Final metrics: {result.metrics}")
    print(f"Run directory: {result.path}  (events.jsonl, metrics.jsonl, checkpoints/)")


if __name__ == "__main__":
    main()
