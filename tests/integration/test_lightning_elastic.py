"""An unmodified Lightning ``Trainer`` resized in place on a real cluster: 3 workers, a node
lost (-> 2), a node added back (-> 3). Every sample is trained exactly once per epoch, every
recovery comes from peer memory, Lightning's step counter lines up with ``max_steps``, and
the final weights equal a fixed 2-worker run's."""

import json
import os

import pytest
import ray.train
import torch

import raylastic
from raylastic import ElasticTrainer, RunConfig, ScalingConfig
from raylastic.data import global_batch_indices
from raylastic.events import EventKind
from raylastic.testing.chaos_checks import weight_difference
from raylastic.testing.faults import FitThread, RunWatcher, kill_node_at

from integration.trainer_rows import effective_rows

pytest.importorskip("lightning")
pytestmark = pytest.mark.timeout(300)

N, MICRO, G, EPOCHS, SEED = 96, 2, 12, 5, 0  # 8 steps per epoch, 40 steps
SPE = N // G


def _make_train_func():
    """Built in a function so cloudpickle ships it by value (workers cannot import tests)."""

    def train_func(config):
        import time

        import lightning.pytorch as pl
        from torch import nn

        from raylastic.integrations.lightning import prepare_trainer

        class Samples(torch.utils.data.Dataset):
            def __init__(self, n):
                g = torch.Generator().manual_seed(1234)
                self.x = torch.randn(n, 16, generator=g)
                self.y = (self.x[:, :4].sum(dim=1, keepdim=True) > 0).float()

            def __len__(self):
                return len(self.x)

            def __getitem__(self, i):
                return self.x[i], self.y[i], torch.tensor(i)

        class Classifier(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
                self.seen = []

            def training_step(self, batch, batch_idx):
                x, y, ids = batch
                self.seen += ids.tolist()
                loss = nn.functional.binary_cross_entropy_with_logits(self.net(x), y)
                self.log("loss", loss)
                return loss

            def configure_optimizers(self):
                opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
                return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)}

        class LogIds(pl.Callback):
            """Per optimizer step, the ids this rank trained (runs before raylastic's commit)."""

            def __init__(self, path):
                self.path, self.stepped = path, None

            def on_train_start(self, trainer, module):
                self.stepped = trainer.global_step  # restored by then

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                if trainer.global_step == self.stepped:
                    return
                self.stepped = trainer.global_step
                ctx = raylastic.get_context()
                with open(self.path, "a") as f:
                    f.write(json.dumps({
                        "m_epoch": ctx.get_membership_epoch(), "rank": ctx.get_world_rank(),
                        "world": ctx.get_world_size(), "step": trainer.global_step - 1,
                        "epoch": trainer.current_epoch, "ga": trainer.accumulate_grad_batches,
                        "indices": module.seen}) + "\n")
                module.seen = []
                if config.get("step_sleep_s"):
                    time.sleep(config["step_sleep_s"])

        ctx = raylastic.get_context()
        log = os.path.join(config["index_log_dir"], f"rank-{ctx.get_membership_epoch()}-{ctx.get_world_rank()}.jsonl")
        torch.manual_seed(SEED)
        model = Classifier()
        loader = torch.utils.data.DataLoader(Samples(N), batch_size=MICRO, shuffle=True)
        callbacks = [LogIds(log)]
        if config.get("via_ray"):  # Ray Train's Lightning API, as a Ray Train script has it
            from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback
            from ray.train.lightning import prepare_trainer as ray_prepare_trainer

            extra = {"strategy": RayDDPStrategy(), "plugins": [RayLightningEnvironment()]}
            callbacks.append(RayTrainReportCallback())
        else:
            extra = {"devices": 1}
        trainer = pl.Trainer(max_epochs=EPOCHS, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             accumulate_grad_batches=config["ga"], callbacks=callbacks, **extra)
        if config.get("via_ray"):
            trainer = ray_prepare_trainer(trainer)
        trainer = prepare_trainer(trainer, G, seed=SEED)  # G at any first world size
        trainer.fit(model, train_dataloaders=loader)
        if ctx.get_world_rank() == 0:
            torch.save(model.state_dict(), config["weights_out"])
        return {"global_step": trainer.global_step, "current_epoch": trainer.current_epoch}

    return train_func


def _cfg(tmp_path, tag, **extra):
    log_dir = tmp_path / f"idx-{tag}"
    log_dir.mkdir()
    return {"index_log_dir": str(log_dir), "weights_out": str(tmp_path / f"w-{tag}.pt"), **extra}


def test_lightning_trainer_resizes_in_place_exactly_once_and_same_weights(local_cluster, restore_nodes,
                                                                          run_dir, tmp_path):
    train_func = _make_train_func()
    # Elastic: 2-3 workers, global batch 12 (given: prepare_trainer(trainer, G)), kept at 2 workers.
    # Through Ray Train's Lightning API (RayDDPStrategy, RayLightningEnvironment, Ray's
    # prepare_trainer, RayTrainReportCallback's per-epoch checkpoints) under raylastic.TorchTrainer.
    cfg = _cfg(tmp_path, "elastic", ga=2, step_sleep_s=0.25, via_ray=True)
    th = FitThread(raylastic.TorchTrainer(
        train_func, train_loop_config=cfg, scaling_config=ray.train.ScalingConfig(num_workers=(2, 3)),
        run_config=ray.train.RunConfig(name="elastic", storage_path=run_dir)))
    th.start()
    w = RunWatcher(os.path.join(run_dir, "elastic"))
    # The first group forms at 2 when the third worker comes up more than the settle
    # window (1 s) after the others; the node is lost once the group is at 3.
    w.wait_for_event(EventKind.GROUP_FORMED, 120, where=lambda e: len(e["nodes"]) == 3)
    kill_node_at(local_cluster, w, 6)
    formed = len(w.events(EventKind.GROUP_FORMED))
    w.wait_for_event(EventKind.FIRST_STEP, 120, count=formed + 1)
    local_cluster.add_node()
    result = th.wait(240)
    sizes = result.world_sizes
    assert sizes[-3:] == [3, 2, 3] and set(sizes[:-3]) <= {2}, sizes
    assert result.return_value == {"global_step": EPOCHS * SPE, "current_epoch": EPOCHS}

    # Reference: 2 workers, no faults; default global batch = 2 (micro) * 3 (ga) * 2 = 12.
    # After the elastic run: it takes 2 of the 3 workers the elastic run keeps
    # (keep_workers_s, the local_cluster modules' 30 s) instead of starting its own.
    ref_cfg = _cfg(tmp_path, "ref", ga=3)
    ref = ElasticTrainer(train_func, train_loop_config=ref_cfg,
                         scaling_config=ScalingConfig(min_workers=2, max_workers=2),
                         run_config=RunConfig(name="ref", storage_path=run_dir, verbose=False)).fit()
    assert ref.world_sizes == [2]
    assert ref.return_value == {"global_step": EPOCHS * SPE, "current_epoch": EPOCHS}

    restores = w.events(EventKind.CHECKPOINT_RESTORED)
    # Survivors stuck where the abort does not reach (a collective inside the framework's
    # step) are replaced: that group starts again from the newest state it can get (here
    # none: nothing persisted yet), and the steps it redoes are rolled back, not doubled.
    replaced = [e for e in w.events(EventKind.WORKER_LOST) if "did not stop in time" in e.get("message", "")]
    assert restores and all(e["source"] == "memory" for e in restores), restores
    assert replaced or len(restores) == len(sizes) - 1, restores
    effective, raw = effective_rows(cfg["index_log_dir"], N, SEED, G)
    assert {(r["world"], r["ga"]) for r in raw} == {(3, 2), (2, 3)}
    assert len(raw) >= len(effective) - sum(1 for r in effective if r.get("filled"))
    for epoch in range(EPOCHS):
        seen = []
        for step in range(epoch * SPE, (epoch + 1) * SPE):
            rows = [r for r in effective if r["step"] == step]
            assert rows, f"step {step} never trained"
            assert len({r["world"] for r in rows}) == 1 and len(rows) == rows[0]["world"], rows
            assert {r["epoch"] for r in rows} == {epoch}, rows  # Lightning's epoch counter lines up
            union = sorted(i for r in rows for i in r["indices"])
            assert union == sorted(global_batch_indices(N, SEED, epoch, step % SPE, G, True)), step
            seen += union
        assert len(seen) == len(set(seen)) == SPE * G  # exactly once per epoch; tail dropped

    a = torch.load(ref_cfg["weights_out"], weights_only=True)
    b = torch.load(cfg["weights_out"], weights_only=True)
    diff = weight_difference(a, b)
    print(f"max relative weight difference elastic vs fixed: {diff:.2e}")
    assert diff <= 1e-5, diff
