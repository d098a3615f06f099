"""A Ray Train + PyTorch Lightning script with one import changed: Ray's own Lightning
utilities (``RayDDPStrategy``, ``RayLightningEnvironment``, ``RayTrainReportCallback``,
``prepare_trainer``) under ``raylastic.TorchTrainer``.

What this gives: raylastic's start at ``min_workers``, growth to ``max_workers``, warm
survivors and failure handling around an unchanged Lightning script. What it does not
(yet): an in-place resize of Lightning's own loop. On a resize Lightning's ``fit`` starts
again in each worker, from the last checkpoint ``RayTrainReportCallback`` reported (as
under Ray Train). Needs ``pip install "raylastic[lightning]"``.

Run: ``python examples/lightning_ray_train.py`` (starts a local Ray instance).
"""

import tempfile

import lightning.pytorch as pl
import ray
import ray.train
import torch
from ray.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    prepare_trainer,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from raylastic import TorchTrainer  # was: from ray.train.torch import TorchTrainer


class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 1)

    def training_step(self, batch, _idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def train_func(config):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
    trainer = pl.Trainer(
        max_epochs=config["epochs"], accelerator="cpu", devices="auto",
        strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
        callbacks=[RayTrainReportCallback()], enable_progress_bar=False, logger=False,
        enable_checkpointing=False,
    )
    trainer = prepare_trainer(trainer)
    trainer.fit(Regression(), train_dataloaders=loader)


if __name__ == "__main__":
    ray.init(num_cpus=2)
    trainer = TorchTrainer(
        train_func, train_loop_config={"epochs": 5},
        scaling_config=ray.train.ScalingConfig(num_workers=(1, 2)),  # (min, max): elastic
        run_config=ray.train.RunConfig(name="lightning", storage_path=tempfile.mkdtemp()),
    )
    result = trainer.fit()
    print(f"loss {result.metrics['loss']:.4f}, epoch {result.metrics['epoch']}, world sizes {result.world_sizes}")
