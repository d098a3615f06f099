"""Sharded-model demo: FSDP2 (or DeepSpeed ZeRO) keeps training through a node loss and a
scale-up, restored from peer memory at each new world size. No cloud account.

What happens (about 1-2 minutes here):
1. A local Ray cluster starts: a head node without CPUs and 3 one-CPU worker nodes
   (every node its own raylet, so removing one is a real node loss).
2. An MLP whose parameters and Adam moments are sharded over 3 workers (FSDP2
   ``fully_shard``, or ``--deepspeed-stage 1|2|3``) trains with a constant global batch.
   ``ElasticState`` snapshots each rank's shard every step; a peer on another node
   keeps a copy.
3. At step 8 a worker node is killed. The 2 survivors re-partition the 3 old shards
   into 2 from their memory (no storage read) and go on.
4. A node is added back; the group grows to 3 and the state is re-partitioned again.
5. The world sizes, where each restore came from and the final loss are printed.

Run: .venv/bin/python examples/sharded_fsdp2.py [--deepspeed-stage 3]
(``examples/sharded_deepspeed.py`` is the same demo with ``--deepspeed-stage 3``.)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from raylastic import CheckpointConfig, ElasticTrainer, RunConfig, ScalingConfig
from raylastic.events import EventKind, load_events
from raylastic.testing.sharded_funcs import deepspeed_mlp, fsdp2_mlp


def main(argv=None) -> None:
    from raylastic.testing.cluster import LocalCluster
    from raylastic.testing.faults import FitThread, RunWatcher, kill_node_at

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--deepspeed-stage", type=int, choices=(1, 2, 3), default=None,
                   help="DeepSpeed ZeRO stage instead of FSDP2")
    args = p.parse_args(argv)
    stage = args.deepspeed_stage
    train_func = deepspeed_mlp if stage else fsdp2_mlp
    what = f"DeepSpeed ZeRO-{stage}" if stage else "FSDP2"
    storage = os.path.join(tempfile.gettempdir(), "raylastic_demo")
    name = f"sharded-{'zero' + str(stage) if stage else 'fsdp2'}-{int(time.time())}"
    config = {"n": 960, "global_batch": 48, "micro_batch": 16, "epochs": 2, "hidden": 256, "layers": 3,
              "lr": 0.005, "step_sleep_s": 0.2, "persist_every": 10, "zero_stage": stage}
    with LocalCluster(num_nodes=3) as cluster:
        trainer = ElasticTrainer(
            train_func, train_loop_config=config,
            scaling_config=ScalingConfig(min_workers=2, max_workers=3),
            run_config=RunConfig(name=name, storage_path=storage,
                                 checkpoint_config=CheckpointConfig(persist_every=10, num_to_keep=2)))
        fit = FitThread(trainer)
        fit.start()
        watcher = RunWatcher(os.path.join(storage, name))
        node = kill_node_at(cluster, watcher, index=8, timeout_s=240)
        print(f"\n>>> demo: killed worker node {node[:8]} at step 8 ({what}, 3 shards)\n", flush=True)
        watcher.wait_for_event(EventKind.FIRST_STEP, timeout_s=180, count=2)
        cluster.add_node()
        print("\n>>> demo: added a worker node back\n", flush=True)
        result = fit.wait(timeout_s=400)

    events = load_events(result.path)
    print(f"\n{what}: world sizes {' -> '.join(map(str, result.world_sizes))}")
    for e in events:
        if e["kind"] == "checkpoint_restored":
            print(f"  group {e['epoch']}: restored step {e['index']} from {e['source']}")
    print(f"Final metrics: {result.metrics}")
    mem = result.return_value or {}
    if mem.get("shard_bytes"):
        print(f"Rank 0: own shard {mem['shard_bytes'] / 1e6:.2f} MB, snapshots {mem['snapshot_bytes'] / 1e6:.2f} MB")
    print(f"Run directory: {result.path}")


if __name__ == "__main__":
    main()
