"""The Lightning integration's pure parts, without Ray: accumulation, resume points, and
Lightning's real fit loop driven from a resumed position (counters, data, epoch ends)."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from raylastic import session as _session
from raylastic._internal.protocol import RestoreInfo
from raylastic.data import ElasticDataLoader, global_batch_indices, steps_per_epoch
from raylastic.integrations.lightning import (
    ElasticBatches,
    accumulation,
    prepare_trainer,
    resume_point,
    set_loop_counters,
)
from raylastic.session import StopTraining
from raylastic.state import STORE
from trainer_session import session_for

N, G, MICRO, SEED = 40, 8, 2, 3  # 5 steps per epoch, 4 micro-batches per step at world size 1


class Ids(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(i)


class Recorder(pl.LightningModule):
    """Records the sample ids each optimizer step trained; an epoch-interval scheduler."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(1, 1)
        self.steps, self.pending = [], []

    def training_step(self, batch, batch_idx):
        x, ids = batch
        self.pending += ids.tolist()
        return self.net(x).pow(2).mean()

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if len(self.steps) < self.trainer.global_step - self.start_step:
            self.steps.append((self.trainer.current_epoch, sorted(self.pending)))
            self.pending = []

    def on_fit_start(self):
        self.start_step = self.trainer.global_step

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1),
                                                   "interval": "epoch"}}


class Resume(pl.Callback):
    """What the elastic callback does around a restore: counters before the loops start,
    the trained position after each optimizer step."""

    def __init__(self, batches, resume):
        self.batches, self.resume, self.stepped = batches, resume, 0

    def on_fit_start(self, trainer, pl_module):
        trainer.accumulate_grad_batches = self.batches.accumulate
        if self.resume is not None:
            set_loop_counters(trainer, accumulate=self.batches.accumulate, **self.resume)
        self.stepped = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != self.stepped:
            self.stepped = trainer.global_step
            self.batches.trained(batch_idx)


def _fit(max_steps, resume=None, position=None, max_epochs=-1):
    loader = ElasticDataLoader(Ids(), global_batch_size=G, micro_batch_size=MICRO, seed=SEED, world_size=1, rank=0)
    trainer = pl.Trainer(max_steps=max_steps, max_epochs=max_epochs, accelerator="cpu", devices=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    batches = ElasticBatches(loader, accumulation(G, 1, MICRO), lambda: trainer.current_epoch)
    batches.position = position
    trainer.callbacks.append(Resume(batches, resume))
    model = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, train_dataloaders=batches)
    return trainer, model, batches


def _expected(epoch, step):
    return sorted(global_batch_indices(N, SEED, epoch, step, G, True))


def test_accumulation_keeps_the_global_batch_and_names_the_field():
    assert [accumulation(12, w, 2) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ValueError, match=r"global_batch_size \(12\).*world_size \(4\).*batch_size"):
        accumulation(12, 4, 2)
    with pytest.raises(ValueError, match="global_batch_size"):
        accumulation(0, 1, 2)


def test_resume_point_moves_a_finished_epoch_to_the_next():
    assert resume_point(None, 5) == (0, 0)
    assert resume_point({"epoch": 1, "step": 3}, 5) == (1, 3)
    assert resume_point({"epoch": 1, "step": 5}, 5) == (2, 0)


def test_fresh_run_trains_every_sample_once_per_epoch_with_accumulation():
    trainer, model, _ = _fit(max_steps=-1, max_epochs=2)
    spe = steps_per_epoch(N, G)
    assert trainer.global_step == 2 * spe and trainer.current_epoch == 2
    assert model.steps == [(e, _expected(e, s)) for e in range(2) for s in range(spe)]
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2


def test_resumed_mid_epoch_goes_on_where_the_position_says():
    spe = steps_per_epoch(N, G)
    # A first run stops after 1 epoch + 2 steps; its position is what a snapshot holds.
    first, _, batches = _fit(max_steps=spe + 2)
    position = batches.position
    assert (position["epoch"], position["step"]) == (1, 2)
    epoch, step = resume_point(position, spe)
    trainer, model, _ = _fit(max_steps=2 * spe + 1, position=position,
                             resume={"epoch": epoch, "step_in_epoch": step, "global_step": spe + 2})
    # The rest of epoch 1 (steps 2..4), then one step of epoch 2; max_steps lines up.
    assert model.steps == [(1, _expected(1, s)) for s in range(2, spe)] + [(2, _expected(2, 0))]
    whole, whole_model, _ = _fit(max_steps=2 * spe + 1)  # the same run without the stop
    assert whole_model.steps[spe + 2:] == model.steps
    assert trainer.global_step == whole.global_step == 2 * spe + 1
    assert trainer.current_epoch == whole.current_epoch
    # Epoch 1's end was seen where its data ended: the epoch scheduler stepped once.
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 1


def test_resumed_at_an_epoch_boundary_starts_the_next_epoch():
    spe = steps_per_epoch(N, G)
    _, _, batches = _fit(max_steps=spe)
    epoch, step = resume_point(batches.position, spe)
    assert (epoch, step) == (1, 0)
    trainer, model, _ = _fit(max_steps=spe + 2, position=batches.position,
                             resume={"epoch": epoch, "step_in_epoch": step, "global_step": spe})
    assert model.steps == [(1, _expected(1, s)) for s in range(2)]
    whole, _, _ = _fit(max_steps=spe + 2)
    assert trainer.global_step == whole.global_step == spe + 2
    assert trainer.current_epoch == whole.current_epoch


def test_trained_refuses_a_batch_the_iterator_did_not_yield():
    loader = ElasticDataLoader(Ids(), global_batch_size=G, micro_batch_size=MICRO, world_size=1, rank=0)
    batches = ElasticBatches(loader, accumulation(G, 1, MICRO), lambda: 0)
    it = iter(batches)
    for _ in range(4):
        next(it)
    assert batches.trained(3)["step"] == 1
    with pytest.raises(RuntimeError, match="batch 9 was not yielded"):
        batches.trained(9)


def test_prepare_trainer_needs_a_raylastic_train_function():
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    with pytest.raises(RuntimeError, match="inside a train function"):
        prepare_trainer(trainer)


# -- the whole path in one process: a real raylastic session at world size 1 ----------------

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(1, 1)
        self.seen, self.val_seen = [], []

    def training_step(self, batch, batch_idx):
        x, ids = batch
        self.seen += ids.tolist()
        return (self.lin(x / N) - 1).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        self.val_seen += batch[1].tolist()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)}


@pytest.fixture
def group():
    """A one-rank gloo group, as raylastic's worker has before calling the train function."""
    from ray.train.v2._internal.execution import train_fn_utils

    import torch.distributed as dist

    previous = train_fn_utils._train_fn_utils
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    _session._set_session(None)
    train_fn_utils.set_train_fn_utils(previous)
    dist.destroy_process_group()


def _attempt(seed, global_batch_size=None, via_ray=False, nets=None):
    torch.manual_seed(seed)
    net = Net()
    if nets is not None:
        nets.append(net)
    extra = {"devices": 1}
    if via_ray:
        from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment
        extra = {"strategy": RayDDPStrategy(), "plugins": [RayLightningEnvironment()]}
    trainer = pl.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, **extra)
    if via_ray:  # Ray's checks, ours (as Ray's prepare_trainer routed to it does), then ours again
        from ray.train.lightning import prepare_trainer as ray_prepare_trainer
        trainer = prepare_trainer(ray_prepare_trainer(trainer))
    trainer = prepare_trainer(trainer, global_batch_size, seed=SEED)
    loader = torch.utils.data.DataLoader(Ids(), batch_size=MICRO, shuffle=True)
    val = torch.utils.data.DataLoader(Ids(), batch_size=4)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(net, train_dataloaders=loader, val_dataloaders=val)
    finally:
        STORE.wait_pending()
    return net, trainer


@pytest.mark.parametrize("stop_at", [5, 7])  # 5: the last step of epoch 0; 7: mid-epoch 1
def test_stop_and_in_process_restore_continue_the_same_run(group, stop_at):
    session_for(f"lt-full-{stop_at}")
    full, whole = _attempt(0, global_batch_size=G)
    spe = steps_per_epoch(N, G)
    assert (whole.global_step, whole.current_epoch, whole.accumulate_grad_batches) == (3 * spe, 3, G // MICRO)
    assert sorted(full.seen) == sorted(i for e in range(3) for s in range(spe) for i in _expected(e, s))
    assert sorted(full.val_seen) == sorted(list(range(N)) * 3)  # every rank's share of each validation

    session_for(f"lt-resized-{stop_at}").request_stop_at(stop_at)  # the controller asks for a resize
    nets = []
    with pytest.raises(StopTraining):
        _attempt(0, global_batch_size=G, nets=nets)
    first = nets[0]
    # Attempt 2 in the same process: another initial model (it must not matter) and no
    # global_batch_size (it comes back from the snapshot, 8, not the default 2 * 1 * 1).
    session_for(f"lt-resized-{stop_at}", RestoreInfo(index=stop_at, memory_index=stop_at), epoch=2)
    second, trainer = _attempt(5, via_ray=stop_at == 7)  # also Ray's Lightning API, prepared by Ray then us
    assert trainer.callbacks[-1].restored_from == "memory"
    assert (trainer.global_step, trainer.current_epoch, trainer.accumulate_grad_batches) == (3 * spe, 3, G // MICRO)
    assert sorted(second.seen) == sorted(i for k in range(stop_at, 3 * spe) for i in _expected(k // spe, k % spe))
    assert sorted(first.seen + second.seen) == sorted(full.seen)
    # Each epoch validated once: an epoch's last step is committed after its validation.
    assert sorted(first.val_seen + second.val_seen) == sorted(full.val_seen)
    assert trainer.optimizers[0].param_groups[0]["lr"] == whole.optimizers[0].param_groups[0]["lr"]
    for k, v in full.state_dict().items():
        assert torch.equal(v, second.state_dict()[k]), k


def test_refusals_name_the_field(group):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    session_for("lt-refuse")
    with pytest.raises(ValueError, match="GradientAccumulationScheduler"):
        prepare_trainer(pl.Trainer(accelerator="cpu", devices=1, logger=False,
                                   callbacks=[GradientAccumulationScheduler({0: 2})]))
    with pytest.raises(ValueError, match=r"global_batch_size \(7\) is not a multiple of world_size \(1\)"):
        _attempt(0, global_batch_size=7)
    with pytest.raises(ValueError, match=r"prepare_trainer\(persist_evry=...\) is not an ElasticState argument"):
        prepare_trainer(pl.Trainer(accelerator="cpu", devices=1, logger=False), persist_evry=2)
    with pytest.raises(ValueError, match=r"ElasticState\(async_snapshot=1\) must be True or False"):
        prepare_trainer(pl.Trainer(accelerator="cpu", devices=1, logger=False), async_snapshot=1)


def test_ray_lightning_prepare_trainer_is_routed_to_raylastic():
    """Ray's ``ray.train.lightning.prepare_trainer``, bound at import in a worker (the worker
    actor was created first), becomes Ray's followed by raylastic's inside a
    session, and stays Ray's alone outside one (a fresh interpreter)."""
    import subprocess
    import sys

    code = ("import tempfile\n"
            "from raylastic.checkpoint.storage import Storage\n"
            "from raylastic._internal.worker_group.worker import TrainWorker\n"
            "TrainWorker(Storage(tempfile.mkdtemp()), 'run', 'run')\n"  # as a worker actor is created
            "from ray.train.lightning import prepare_trainer\n"
            "import ray.train.lightning._lightning_utils as u\n"
            "assert prepare_trainer is u.prepare_trainer and hasattr(prepare_trainer, '__wrapped__')\n"
            "assert prepare_trainer.__module__ == 'ray.train.lightning._lightning_utils'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=400)


def test_unsupported_fits_fall_back_to_restarts_when_asked(caplog):
    """``fallback_to_restart=True`` (what Ray's routed ``prepare_trainer`` passes): a train
    loader that is not a map-style torch DataLoader (Ray Data's ``iter_torch_batches``) is
    left as it is, with a warning, and nothing is committed; without it, a ValueError."""
    from raylastic.integrations.lightning import _ElasticRun

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            yield from range(8)

    loader = torch.utils.data.DataLoader(Stream(), batch_size=2)
    strict = _ElasticRun(None, 1, 0, None, {}, distributed_sampler=True)
    with pytest.raises(ValueError, match="map-style"):
        strict.attach(None, loader)
    lenient = _ElasticRun(None, 1, 0, None, {}, distributed_sampler=True, fallback=True)
    with caplog.at_level("WARNING", logger="raylastic.integrations.lightning"):
        assert lenient.attach(None, loader) is loader
        assert lenient.attach(None, loader) is loader
    assert caplog.text.count("not resized in place") == 1
    assert lenient.state is None  # after_batch and flush commit nothing
