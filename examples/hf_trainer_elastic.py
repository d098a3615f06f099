"""Hugging Face ``Trainer`` demo: a tiny GPT-2 keeps fine-tuning through a node loss and a
scale-up, resized in place, restored from peer memory. No downloads, no cloud account.

What happens (about a minute here):
1. A local Ray cluster starts: a head node without CPUs and 3 one-CPU worker nodes (every
   node its own raylet, so removing one is a real node loss).
2. Each worker runs an ordinary ``transformers.Trainer`` script: a GPT-2 built from a
   ``GPT2Config`` (2 layers, 64-dim) learns a synthetic "count up modulo 32" language. The
   only raylastic lines are the import and ``trainer = prepare_trainer(trainer, ...)``.
   The global batch is 24 sequences per optimizer step at any world size:
   ``per_device_train_batch_size=4``, gradient accumulation 2 at 3 workers, 3 at 2.
3. After step 8 a worker node is killed. The 2 survivors keep their processes and model,
   rebuild the process group, reset Accelerate's state and continue from their in-memory
   snapshot of the last step (no storage read).
4. A node is added back; the group grows to 3 again; the new worker gets the state from
   the survivors' memory.
5. World sizes, where each restore came from, and the loss per step are printed.

Run: .venv/bin/python examples/hf_trainer_elastic.py
"""

from __future__ import annotations

import os
import tempfile
import time

from raylastic import ElasticTrainer, RunConfig, ScalingConfig
from raylastic.events import EventKind, load_events

VOCAB, SEQ, N_SEQS, GLOBAL_BATCH = 32, 16, 480, 24  # 20 steps per epoch


def train_func(config):
    """An HF fine-tuning script, unchanged but for the two raylastic lines."""
    import time as _time

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from raylastic.integrations.transformers import prepare_trainer  # raylastic line 1

    class CountingLanguage(torch.utils.data.Dataset):
        """Sequences start anywhere and count up modulo VOCAB: easy to learn, so the loss falls."""

        def __init__(self, n):
            self.starts = torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.starts)

        def __getitem__(self, i):
            ids = (self.starts[i] + torch.arange(SEQ)) % VOCAB
            return {"input_ids": ids, "labels": ids.clone()}

    class Pace(TrainerCallback):  # only so the demo's node loss and scale-up land mid-run
        def on_step_end(self, args, state, control, **kwargs):
            _time.sleep(config["step_sleep_s"])

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0))
    args = TrainingArguments(output_dir=config["output_dir"], per_device_train_batch_size=4,
                             num_train_epochs=2, learning_rate=3e-3, lr_scheduler_type="cosine",
                             warmup_steps=2, save_strategy="no", logging_strategy="no",
                             report_to="none", use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=CountingLanguage(N_SEQS), callbacks=[Pace()])
    trainer = prepare_trainer(trainer, global_batch_size=GLOBAL_BATCH)  # raylastic line 2
    trainer.train()


def main() -> None:
    from raylastic.testing.cluster import LocalCluster
    from raylastic.testing.faults import FitThread, RunWatcher, kill_node_at

    storage = os.path.join(tempfile.gettempdir(), "raylastic_demo")
    name = f"hf-trainer-{int(time.time())}"
    config = {"output_dir": os.path.join(storage, name, "hf_output"), "step_sleep_s": 0.3}
    start = time.monotonic()
    with LocalCluster(num_nodes=3) as cluster:
        trainer = ElasticTrainer(train_func, train_loop_config=config,
                                 scaling_config=ScalingConfig(min_workers=2, max_workers=3),
                                 run_config=RunConfig(name=name, storage_path=storage, verbose=False))
        fit = FitThread(trainer)
        fit.start()
        watcher = RunWatcher(os.path.join(storage, name))
        node = kill_node_at(cluster, watcher, index=8, timeout_s=240)
        print(f">>> demo: killed worker node {node[:8]} after step 8", flush=True)
        watcher.wait_for_event(EventKind.FIRST_STEP, timeout_s=180, count=2)
        cluster.add_node()
        print(">>> demo: added a worker node back", flush=True)
        result = fit.wait(timeout_s=400)
        metrics = watcher.metrics()

    print(f"\nworld sizes: {' -> '.join(map(str, result.world_sizes))} "
          f"({time.monotonic() - start:.0f} s with cluster start)")
    for e in load_events(result.path):
        if e["kind"] == EventKind.CHECKPOINT_RESTORED.value:
            print(f"  group {e['epoch']}: restored step {e['index']} from {e['source']}")
    print("step  world  grad-accum  loss (rank 0)")
    for m in metrics:
        mm = m["metrics"]
        print(f"{mm['step']:4d}  {mm['world_size']:5d}  {mm['gradient_accumulation_steps']:10d}  "
              f"{mm.get('loss', float('nan')):.4f}")
    print(f"run directory: {result.path}")


if __name__ == "__main__":
    main()
