"""Lightning demo: an ordinary ``LightningModule`` + ``Trainer`` resized in place, 3 -> 2 -> 3
workers through a real node loss and a scale-up, restored from peer memory each time.

What happens (about a minute here):
1. A local Ray cluster starts: a head node without CPUs and 3 one-CPU worker nodes (every
   node its own raylet, so removing one is a real node loss).
2. ``train_func`` builds a Lightning ``Trainer`` as usual and adds one line,
   ``prepare_trainer(trainer)``. The global batch (24) stays constant: 4 samples per
   micro-batch, gradient accumulation 2 at 3 workers and 3 at 2 workers.
3. At step 10 a worker node is killed. The two survivors keep their processes and their
   model; the process group is rebuilt, ``trainer.fit`` is called again in the same
   process and the state (weights, optimizer, LR scheduler, data position, global step)
   comes back from the survivors' memory, not from storage.
4. A node is added back; the group grows to 3 and the newcomer gets the state over the
   new process group.
5. The world sizes, the restores and the final loss are printed.

Run: .venv/bin/python examples/lightning_elastic.py
"""

from __future__ import annotations

import os
import tempfile
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import raylastic
from raylastic import ElasticTrainer, RunConfig, ScalingConfig
from raylastic.events import EventKind, load_events
from raylastic.integrations.lightning import prepare_trainer


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)}


class SlowDown(pl.Callback):
    """Stretches each step so the demo can kill a node mid-run; says what each start saw."""

    def __init__(self, step_sleep_s: float):
        self.step_sleep_s = step_sleep_s

    def on_train_start(self, trainer, pl_module):
        ctx = raylastic.get_context()
        if ctx.get_world_rank() == 0:
            print(f">>> rank 0: fit() starts at global_step {trainer.global_step}, epoch {trainer.current_epoch}, "
                  f"world {trainer.world_size}, accumulate_grad_batches {trainer.accumulate_grad_batches}",
                  flush=True)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.step_sleep_s)


def train_func(config):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(960, 8, generator=g)
    data = TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))
    loader = DataLoader(data, batch_size=4, shuffle=True)  # batch_size = the micro batch
    torch.manual_seed(0)
    trainer = pl.Trainer(max_epochs=config["epochs"], accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[SlowDown(config["step_sleep_s"])])
    # The one added line: elastic strategy, elastic data, ElasticState commits per step.
    trainer = prepare_trainer(trainer, global_batch_size=24)
    trainer.fit(Regression(), train_dataloaders=loader)
    return {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch}


def main() -> None:
    from raylastic.testing.cluster import LocalCluster
    from raylastic.testing.faults import FitThread, RunWatcher, kill_node_at

    storage = os.path.join(tempfile.gettempdir(), "raylastic_demo")
    name = f"lightning-{int(time.time())}"
    with LocalCluster(num_nodes=3) as cluster:
        trainer = ElasticTrainer(
            train_func, train_loop_config={"epochs": 2, "step_sleep_s": 0.1},
            scaling_config=ScalingConfig(min_workers=2, max_workers=3),
            run_config=RunConfig(name=name, storage_path=storage, verbose=False))
        fit = FitThread(trainer)
        fit.start()
        watcher = RunWatcher(os.path.join(storage, name))
        node = kill_node_at(cluster, watcher, index=10, timeout_s=240)
        print(f"\n>>> demo: killed worker node {node[:8]} at step 10\n", flush=True)
        watcher.wait_for_event(EventKind.FIRST_STEP, timeout_s=180, count=2)
        cluster.add_node()
        print("\n>>> demo: added a worker node back\n", flush=True)
        result = fit.wait(timeout_s=400)

    print(f"\nLightning: world sizes {' -> '.join(map(str, result.world_sizes))}")
    for e in load_events(result.path):
        if e["kind"] == "checkpoint_restored":
            print(f"  group {e['epoch']}: restored step {e['index']} from {e['source']}")
    m = result.metrics
    print(f"Final: global_step {result.return_value['global_step']}, epoch {result.return_value['current_epoch']}, "
          f"loss {m['loss']:.4f} (last reported step {m['step']}, world {m['world_size']})")
    print(f"Run directory: {result.path}")


if __name__ == "__main__":
    main()
