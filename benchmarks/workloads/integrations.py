"""Train functions for ``benchmarks/integrations.py``: one Hugging Face ``Trainer`` script
and one Lightning ``Trainer`` script, each runnable two ways (``config["mode"]``):

* ``"raylastic"``: under raylastic's ``ElasticTrainer``, made elastic with
  ``raylastic.integrations.{transformers,lightning}.prepare_trainer(trainer,
  global_batch_size=...)`` (state from peer memory, no trainer checkpoints).
* ``"ray_train"``: under Ray Train 2.60's ``ray.train.torch.TorchTrainer`` with Ray's
  documented integration, checkpointing every ``checkpoint_every`` steps as a user would and
  resuming from ``ray.train.get_checkpoint()`` after a restart:
  - HF: ``RayTrainReportCallback`` + ``ray.train.huggingface.transformers.prepare_trainer``,
    ``save_strategy="steps"`` / ``save_steps=checkpoint_every``,
    ``trainer.train(resume_from_checkpoint=<checkpoint>/checkpoint)``;
  - Lightning: ``RayDDPStrategy``, ``RayLightningEnvironment``, ``RayTrainReportCallback``
    (which checkpoints at every epoch end: an epoch is ``checkpoint_every`` optimizer steps
    here) and ``ray.train.lightning.prepare_trainer``,
    ``trainer.fit(..., ckpt_path=<checkpoint>/checkpoint.ckpt)``.
  The script keeps the global batch constant itself (``gradient_accumulation_steps`` /
  ``accumulate_grad_batches`` = global batch / (world size * micro batch)), as raylastic's
  ``prepare_trainer`` does, so both systems train the same steps.

What the benchmark reads (JSON lines under ``config["log_dir"]``):

* ``steps.jsonl`` (rank 0, at the end of every optimizer step): ``{"t", "step", "world"}``.
* ``resumes.jsonl`` (rank 0, once per start of the trainer): the time the train function was
  entered and the trainer began, the world size, the global step it starts after, and where
  its state came from (raylastic: ``ElasticState.restored_from``; Ray Train: ``storage``
  when a checkpoint was given, ``none`` otherwise).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict

import torch
from torch import nn


def _append(path: str, row: Dict[str, Any]) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")


def _ctx() -> Any:
    import ray.train

    return ray.train.get_context()


def gpt2_config(config: Dict[str, Any]) -> Any:
    from transformers import GPT2Config

    return GPT2Config(vocab_size=int(config["vocab"]), n_positions=int(config["seq"]), n_embd=int(config["n_embd"]),
                      n_layer=int(config["n_layer"]), n_head=int(config["n_head"]), bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def hf_params(config: Dict[str, Any]) -> int:
    from transformers import GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(config))
    return sum(p.numel() for p in model.parameters())


def mlp_params(config: Dict[str, Any]) -> int:
    d_in, hidden, layers = int(config["d_in"]), int(config["hidden"]), int(config["layers"])
    return d_in * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden + 1


class _TokenData(torch.utils.data.Dataset):
    """Random token sequences (seeded): a language-model batch of the configured shape."""

    def __init__(self, n: int, seq: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def hf_bench(config: Dict[str, Any]) -> None:
    """A ``transformers.Trainer`` fine-tuning script: GPT-2 from a config, AdamW, fixed ``max_steps``."""
    t_fn = time.time()
    torch.set_num_threads(1)
    from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    mode, log_dir = config["mode"], config["log_dir"]
    ctx = _ctx()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    gb, micro = int(config["global_batch"]), int(config["micro_batch"])
    pace = float(config.get("step_sleep_s", 0.0))  # --quick only: so the kill lands mid-run
    ray_ckpt = None
    if mode == "ray_train":
        import ray.train

        ray_ckpt = ray.train.get_checkpoint()

    class StepLog(TrainerCallback):
        def __init__(self) -> None:
            self.trainer: Any = None

        def on_train_begin(self, args, state, control, **kwargs):
            if rank == 0:
                source = "storage" if ray_ckpt is not None else "none"
                if mode == "raylastic":
                    from raylastic.integrations.transformers import elastic_state

                    es = elastic_state(self.trainer)
                    source = es.restored_from if es is not None else "?"
                _append(os.path.join(log_dir, "resumes.jsonl"),
                        {"t": time.time(), "t_fn": t_fn, "world": world, "start": state.global_step,
                         "source": source, "gradient_accumulation_steps": args.gradient_accumulation_steps})

        def on_step_end(self, args, state, control, **kwargs):
            if pace:
                time.sleep(pace)
            if rank == 0:
                _append(os.path.join(log_dir, "steps.jsonl"),
                        {"t": time.time(), "step": state.global_step, "world": world})

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(config))
    common = dict(output_dir=os.path.join(config["work_dir"], "hf_output"), per_device_train_batch_size=micro,
                  max_steps=int(config["max_steps"]), learning_rate=1e-4, lr_scheduler_type="linear",
                  warmup_steps=2, logging_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                  seed=0, dataloader_num_workers=0)
    data = _TokenData(int(config["max_steps"]) * gb, int(config["seq"]), int(config["vocab"]))
    log = StepLog()
    if mode == "raylastic":
        from raylastic.integrations.transformers import prepare_trainer

        args = TrainingArguments(save_strategy="no", **common)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[log])
        trainer = prepare_trainer(trainer, global_batch_size=gb, snapshot_every=int(config.get("snapshot_every", 1)))
        log.trainer = trainer
        trainer.train()
        return
    from ray.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

    args = TrainingArguments(save_strategy="steps", save_steps=int(config["checkpoint_every"]),
                             gradient_accumulation_steps=gb // (world * micro), **common)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[log])
    trainer.add_callback(RayTrainReportCallback())
    trainer = prepare_trainer(trainer)
    log.trainer = trainer
    if ray_ckpt is not None:
        with ray_ckpt.as_directory() as d:
            trainer.train(resume_from_checkpoint=os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
    else:
        trainer.train()


def lightning_bench(config: Dict[str, Any]) -> None:
    """A Lightning script: a wide MLP ``LightningModule``, Adam, fixed ``max_steps``."""
    t_fn = time.time()
    torch.set_num_threads(1)
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    mode, log_dir = config["mode"], config["log_dir"]
    ctx = _ctx()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    gb, micro, every = int(config["global_batch"]), int(config["micro_batch"]), int(config["checkpoint_every"])
    pace = float(config.get("step_sleep_s", 0.0))  # --quick only: so the kill lands mid-run
    ray_ckpt = None
    if mode == "ray_train":
        import ray.train

        ray_ckpt = ray.train.get_checkpoint()

    class MLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            d_in, hidden, layers = int(config["d_in"]), int(config["hidden"]), int(config["layers"])
            mods: list = [nn.Linear(d_in, hidden), nn.ReLU()]
            for _ in range(layers - 1):
                mods += [nn.Linear(hidden, hidden), nn.ReLU()]
            self.net = nn.Sequential(*mods, nn.Linear(hidden, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class StepLog(pl.Callback):
        def __init__(self) -> None:
            self.last = -1

        def on_train_start(self, trainer, pl_module):
            self.last = trainer.global_step
            if rank == 0:
                source = "storage" if ray_ckpt is not None else "none"
                if mode == "raylastic":
                    source = next((c.restored_from for c in trainer.callbacks if hasattr(c, "restored_from")), "?")
                _append(os.path.join(log_dir, "resumes.jsonl"),
                        {"t": time.time(), "t_fn": t_fn, "world": world, "start": trainer.global_step,
                         "source": source, "accumulate_grad_batches": trainer.accumulate_grad_batches})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step != self.last:  # an optimizer step (not an accumulating micro-batch)
                self.last = trainer.global_step
                if pace:
                    time.sleep(pace)
                if rank == 0:
                    _append(os.path.join(log_dir, "steps.jsonl"),
                            {"t": time.time(), "step": trainer.global_step, "world": world})

    g = torch.Generator().manual_seed(0)
    # one epoch = `every` optimizer steps at any world size (Ray's callback checkpoints per epoch)
    x = torch.randn(every * gb, int(config["d_in"]), generator=g)
    data = TensorDataset(x, x[:, :4].sum(dim=1, keepdim=True).sin())
    loader = DataLoader(data, batch_size=micro, shuffle=True)  # batch_size = the micro batch
    torch.manual_seed(0)
    module = MLP()
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                 max_steps=int(config["max_steps"]), max_epochs=-1, accelerator="cpu")
    if mode == "raylastic":
        from raylastic.integrations.lightning import prepare_trainer

        trainer = pl.Trainer(devices=1, callbacks=[StepLog()], **quiet)
        trainer = prepare_trainer(trainer, global_batch_size=gb, snapshot_every=int(config.get("snapshot_every", 1)))
        trainer.fit(module, train_dataloaders=loader)
        return
    from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback, prepare_trainer

    trainer = pl.Trainer(devices="auto", strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
                         callbacks=[StepLog(), RayTrainReportCallback()],
                         accumulate_grad_batches=gb // (world * micro), **quiet)
    trainer = prepare_trainer(trainer)
    if ray_ckpt is not None:
        with ray_ckpt.as_directory() as d:
            trainer.fit(module, train_dataloaders=loader,
                        ckpt_path=os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME))
    else:
        trainer.fit(module, train_dataloaders=loader)


__all__ = ["hf_bench", "lightning_bench", "hf_params", "mlp_params", "gpt2_config"]
