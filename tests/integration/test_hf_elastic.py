"""An unmodified Hugging Face ``Trainer`` resized in place on a real cluster: 3 workers, a node
lost (-> 2), a node added back (-> 3). Every sample is trained exactly once per epoch, every
recovery comes from peer memory, and the final weights equal a fixed 2-worker run's.

The elastic run goes through Ray's own ``ray.train.huggingface.transformers.prepare_trainer``
and ``RayTrainReportCallback`` under ``raylastic.TorchTrainer`` (routed to raylastic's
``prepare_trainer``), bound at this module's import: the train function is unpickled in the
worker with that name already bound. The reference run calls raylastic's directly."""

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

pytest.importorskip("transformers")
from ray.train.huggingface.transformers import RayTrainReportCallback  # noqa: E402
from ray.train.huggingface.transformers import prepare_trainer as ray_prepare_trainer  # noqa: E402

pytestmark = pytest.mark.timeout(300)

N, PER_DEVICE, G, EPOCHS, SEED = 96, 2, 12, 5, 0  # 8 steps per epoch, 40 steps
SPE = N // G


def _make_train_func():
    """Built in a function so cloudpickle ships it by value (workers cannot import tests)."""

    def train_func(config):
        import time

        import torch.distributed as dist
        from torch import nn
        from transformers import Trainer, TrainerCallback, TrainingArguments

        from raylastic.integrations.transformers import elastic_state
        from raylastic.integrations.transformers import prepare_trainer as raylastic_prepare

        class Samples(torch.utils.data.Dataset):
            def __init__(self, n):
                g = torch.Generator().manual_seed(1234)
                self.x = torch.randn(n, 16, generator=g)
                self.y = (self.x[:, :4].sum(dim=1, keepdim=True) > 0).float()

            def __len__(self):
                return len(self.x)

            def __getitem__(self, i):
                return {"x": self.x[i], "labels": self.y[i], "sample_id": torch.tensor(i)}

        class Net(nn.Module):  # returns its loss, as HF models do; records the ids it trained
            def __init__(self):
                super().__init__()
                self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))
                self.seen = []

            def forward(self, x, labels, sample_id):
                self.seen += sample_id.tolist()
                return {"loss": nn.functional.binary_cross_entropy_with_logits(self.body(x), labels)}

        ctx = raylastic.get_context()
        rank, world, m_epoch = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_membership_epoch()

        class LogIds(TrainerCallback):
            def __init__(self, trainer):
                self.trainer = trainer
                self.log = open(os.path.join(config["index_log_dir"], f"rank-{m_epoch}-{rank}.jsonl"), "a")

            def on_step_end(self, args, state, control, **kw):
                self.log.write(json.dumps({
                    "m_epoch": m_epoch, "rank": rank, "world": world, "step": state.global_step - 1,
                    "ga": args.gradient_accumulation_steps, "world_args": args.world_size,
                    "restored_from": elastic_state(self.trainer).restored_from, "indices": net.seen}) + "\n")
                self.log.flush()
                net.seen = []
                time.sleep(config.get("step_sleep_s", {}).get(world, 0.0))

        torch.manual_seed(SEED)
        net = Net()
        args = TrainingArguments(
            output_dir=config["output_dir"], per_device_train_batch_size=PER_DEVICE,
            gradient_accumulation_steps=config["ga"], num_train_epochs=EPOCHS, learning_rate=0.05,
            lr_scheduler_type="linear", seed=SEED, save_strategy=config.get("save_strategy", "no"),
            save_steps=4, logging_steps=4, report_to="none", use_cpu=True, disable_tqdm=True,
            dataloader_num_workers=0)
        trainer = Trainer(model=net, args=args, train_dataset=Samples(N))
        trainer.add_callback(LogIds(trainer))
        if config["via_ray"]:
            trainer.add_callback(RayTrainReportCallback())
            trainer = ray_prepare_trainer(trainer)  # routed to raylastic's under raylastic
        else:
            trainer = raylastic_prepare(trainer, global_batch_size=G)
        assert dist.get_world_size() == world == args.world_size
        trainer.train()
        if rank == 0:
            torch.save(net.body.state_dict(), config["weights_out"])

    return train_func


def _cfg(tmp_path, tag, **extra):
    log_dir = tmp_path / f"idx-{tag}"
    log_dir.mkdir()
    return {"index_log_dir": str(log_dir), "weights_out": str(tmp_path / f"w-{tag}.pt"),
            "output_dir": str(tmp_path / f"hf-{tag}"), **extra}


def test_hf_trainer_resizes_in_place_exactly_once_and_same_weights(local_cluster, restore_nodes, run_dir, tmp_path):
    train_func = _make_train_func()
    # Elastic: Ray's API under raylastic.TorchTrainer; the default global batch is
    # per_device (2) * ga (2) * max_workers (3) = 12, as in the reference.
    # Paced by world size: lightly at 3 workers (the kill must land), more at 2 while the
    # node added back starts its worker (~5 s).
    cfg = _cfg(tmp_path, "elastic", ga=2, via_ray=True, step_sleep_s={3: 0.1, 2: 0.25}, save_strategy="steps")
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

    # The fixed-size reference after the elastic run: it takes 2 of the 3 workers the
    # elastic run keeps (keep_workers_s, the local_cluster modules' 30 s) instead of
    # starting its own.
    ref_cfg = _cfg(tmp_path, "ref", ga=1, via_ray=False)  # ga is recomputed: 12 / (2 * 2) = 3
    ref = ElasticTrainer(train_func, train_loop_config=ref_cfg,
                         scaling_config=ScalingConfig(min_workers=2, max_workers=2),
                         run_config=RunConfig(name="ref", storage_path=run_dir, verbose=False)).fit()
    assert ref.world_sizes == [2]

    restores = w.events(EventKind.CHECKPOINT_RESTORED)
    # Survivors stuck where the abort does not reach (a collective inside the framework's
    # step) are replaced: that group starts again from the newest state it can get (here
    # none: nothing persisted yet), and the steps it redoes are rolled back, not doubled.
    replaced = [e for e in w.events(EventKind.WORKER_LOST) if "did not stop in time" in e.get("message", "")]
    assert restores and all(e["source"] == "memory" for e in restores), restores
    assert replaced or len(restores) == len(sizes) - 1, restores
    effective, raw = effective_rows(cfg["index_log_dir"], N, SEED, G)
    later = [r for r in raw if r["m_epoch"] > 1]
    assert later and {r["restored_from"] for r in later} <= ({"memory", "none"} if replaced else {"memory"})
    assert {r["restored_from"] for r in raw if r["m_epoch"] == 1} == {"none"}
    assert {(r["world"], r["world_args"], r["ga"]) for r in raw} == {(3, 3, 2), (2, 2, 3)}
    assert len(raw) >= len(effective) - sum(1 for r in effective if r.get("filled"))
    for epoch in range(EPOCHS):
        seen = []
        for step in range(epoch * SPE, (epoch + 1) * SPE):
            rows = [r for r in effective if r["step"] == step]
            assert rows, f"step {step} never trained"
            assert len({r["world"] for r in rows}) == 1 and len(rows) == rows[0]["world"], rows
            union = sorted(i for r in rows for i in r["indices"])
            assert union == sorted(global_batch_indices(N, SEED, epoch, step % SPE, G, True)), step
            seen += union
        assert len(seen) == len(set(seen)) == SPE * G  # exactly once per epoch; tail dropped

    a = torch.load(ref_cfg["weights_out"], weights_only=True)
    b = torch.load(cfg["weights_out"], weights_only=True)
    diff = weight_difference(a, b)
    print(f"max relative weight difference elastic vs fixed: {diff:.2e}")
    assert diff <= 1e-5, diff
