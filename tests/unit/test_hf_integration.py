"""The elastic Hugging Face Trainer without Ray: the batch arithmetic, the refusals, Ray's
``prepare_trainer`` routing, and a stop + in-process restore at world size 1 through a real
``Session`` (what a survivor does after a resize: same process, the train function called
again, the state back from its in-memory snapshot)."""

import subprocess
import sys

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from raylastic import session as _session  # noqa: E402
from raylastic._internal import ray_train_routes  # noqa: E402
from raylastic._internal.protocol import RestoreInfo  # noqa: E402
from raylastic.integrations.transformers import (  # noqa: E402
    elastic_state,
    gradient_accumulation_steps,
    planned_max_steps,
    prepare_trainer,
)
from raylastic.session import StopTraining  # noqa: E402
from raylastic.state import STORE  # noqa: E402
from trainer_session import session_for  # noqa: E402

pytestmark = pytest.mark.no_ray


class Samples(torch.utils.data.Dataset):
    def __init__(self, n=40):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i], "sample_id": torch.tensor(i)}


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield from Samples()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 1)
        self.seen = []

    def forward(self, x, labels, sample_id):
        self.seen += sample_id.tolist()
        return {"loss": nn.functional.mse_loss(self.lin(x), labels)}


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=2,
                learning_rate=0.1, lr_scheduler_type="linear", save_strategy="no", report_to="none",
                use_cpu=True, disable_tqdm=True)
    return TrainingArguments(**{**base, **kw})


@pytest.fixture(autouse=True)
def _no_session_left():
    """Leave the process as found: no raylastic session, no Ray Train API routed to one."""
    from ray.train.v2._internal.execution import train_fn_utils

    previous = train_fn_utils._train_fn_utils
    yield
    _session._set_session(None)
    train_fn_utils.set_train_fn_utils(previous)


def test_gradient_accumulation_keeps_the_global_batch():
    assert gradient_accumulation_steps(12, 2, 2) == 3
    assert gradient_accumulation_steps(12, 3, 2) == 2
    assert gradient_accumulation_steps(12, 6, 2) == 1
    with pytest.raises(ValueError, match=r"global_batch_size \(12\) is not a multiple of world_size \(5\)"):
        gradient_accumulation_steps(12, 5, 2)
    with pytest.raises(ValueError, match="per_device_train_batch_size"):
        gradient_accumulation_steps(12, 2, 0)
    with pytest.raises(ValueError, match="global_batch_size"):
        gradient_accumulation_steps(True, 1, 1)


def test_max_steps_depend_on_the_global_batch_only():
    assert planned_max_steps(96, 12, 5, -1) == (8, 40)
    assert planned_max_steps(100, 12, 2.5, -1) == (8, 20)  # the partial tail is dropped
    assert planned_max_steps(96, 12, 5, 7) == (8, 7)  # an explicit max_steps wins
    with pytest.raises(ValueError, match=r"global_batch_size \(200\) > len\(train_dataset\) \(96\)"):
        planned_max_steps(96, 200, 1, -1)
    with pytest.raises(ValueError, match="num_train_epochs"):
        planned_max_steps(96, 12, 0, -1)


def test_refusals_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="train_dataset .Stream. must be a map-style"):
        prepare_trainer(Trainer(model=Net(), args=_args(tmp_path, max_steps=4), train_dataset=Stream()))
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        prepare_trainer(Trainer(model=Net(), args=_args(tmp_path, auto_find_batch_size=True),
                                train_dataset=Samples()))
    with pytest.raises(ValueError, match="must be a transformers.Trainer"):
        prepare_trainer(object())  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="inside a train function"):
        prepare_trainer(Trainer(model=Net(), args=_args(tmp_path), train_dataset=Samples()))
    session_for("refuse")
    with pytest.raises(ValueError, match=r"global_batch_size \(10\) is not a multiple"):
        prepare_trainer(Trainer(model=Net(), args=_args(tmp_path), train_dataset=Samples()), global_batch_size=10)
    with pytest.raises(ValueError, match=r"prepare_trainer\(snapshot_evry=...\) is not an ElasticState argument"):
        prepare_trainer(Trainer(model=Net(), args=_args(tmp_path), train_dataset=Samples()), snapshot_evry=2)
    with pytest.raises(ValueError, match=r"ElasticState\(snapshot_every=0\) must be an int >= 1"):
        prepare_trainer(Trainer(model=Net(), args=_args(tmp_path), train_dataset=Samples()), snapshot_every=0)


def test_elastic_state_arguments_are_passed_on(tmp_path):
    """``prepare_trainer(**state_kwargs)`` reaches the ``ElasticState``, as in the Lightning
    integration: with ``snapshot_every=3`` only every third step's state is kept in memory."""
    session_for("hf-every-3")
    trainer = prepare_trainer(Trainer(model=Net(), args=_args(tmp_path), train_dataset=Samples()),
                              global_batch_size=8, snapshot_every=3)
    try:
        trainer.train()
    finally:
        STORE.wait_pending()
    assert trainer.state.global_step == 10
    kept = STORE.complete_indices("hf-every-3")
    assert kept and all(i % 3 == 0 for i in kept), kept


def _train(tmp_path, sess, seed=0, global_batch_size=None, callbacks=None):
    torch.manual_seed(seed)
    net = Net()
    trainer = prepare_trainer(Trainer(model=net, args=_args(tmp_path), train_dataset=Samples(),
                                      callbacks=callbacks), global_batch_size=global_batch_size)
    try:
        trainer.train()
    finally:
        STORE.wait_pending()
    return net, trainer


def _stopped_after_step_4(tmp_path, run_rel):
    """Attempt 1: the controller asks for a resize after report (= optimizer step) 4."""
    sess = session_for(run_rel)
    sess.request_stop_at(4)
    torch.manual_seed(0)
    first = Net()
    trainer = prepare_trainer(Trainer(model=first, args=_args(tmp_path), train_dataset=Samples()),
                              global_batch_size=8)
    with pytest.raises(StopTraining):
        trainer.train()
    STORE.wait_pending()
    assert len(first.seen) == 4 * 8
    return first


def test_stop_and_in_process_restore_continue_the_same_run(tmp_path):
    full, trainer = _train(tmp_path, session_for("hf-full"), global_batch_size=8)
    assert (trainer.args.gradient_accumulation_steps, trainer.args.max_steps) == (2, 10)
    assert trainer.state.global_step == 10 and sorted(full.seen) == sorted(list(range(40)) * 2)

    first = _stopped_after_step_4(tmp_path, "hf-resized")
    # Attempt 2 in the same process: another initial model (it must not matter) and no
    # global_batch_size (it comes back from the snapshot, 8, not 4 * 1 * 1).
    again = session_for("hf-resized", RestoreInfo(index=4, memory_index=4), epoch=2)
    begun = []

    class SeesTheRestoredStep(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            begun.append(state.global_step)

    second, trainer = _train(tmp_path, again, seed=5, callbacks=[SeesTheRestoredStep()])
    assert elastic_state(trainer).restored_from == "memory" and begun == [4]
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.state.global_step == 10
    assert sorted(first.seen + second.seen) == sorted(list(range(40)) * 2)  # exactly once per epoch
    for k, v in full.state_dict().items():
        assert torch.equal(v, second.state_dict()[k]), k


def test_storage_fallback_restores_the_same_state_and_global_batch(tmp_path):
    """No snapshot in memory (a fresh process after losing every node): the committed
    checkpoint in storage gives the state and the global batch back."""
    from raylastic.checkpoint.storage import Storage

    full, _ = _train(tmp_path, session_for("hf-full-2"), global_batch_size=8)
    first = _stopped_after_step_4(tmp_path, "hf-persisted")
    storage = Storage(str(tmp_path / "storage"))
    local = tmp_path / "ckpt"
    local.mkdir()
    STORE.get("hf-persisted", 4).save(str(local))  # what rank 0's persisted snapshot holds
    storage.upload_dir(str(local), "run/checkpoints/checkpoint_00000004-e1")
    sess = session_for("hf-elsewhere", RestoreInfo(checkpoint_rel="run/checkpoints/checkpoint_00000004-e1",
                                                    index=4), epoch=2)
    sess.storage = storage
    second, trainer = _train(tmp_path, sess, seed=5)
    assert elastic_state(trainer).restored_from == "storage"
    assert trainer.args.gradient_accumulation_steps == 2 and trainer.state.global_step == 10
    assert sorted(first.seen + second.seen) == sorted(list(range(40)) * 2)
    for k, v in full.state_dict().items():
        assert torch.equal(v, second.state_dict()[k]), k


def test_ray_prepare_trainer_routes_to_raylastic_in_a_session(tmp_path):
    import ray.train.huggingface.transformers as ray_hf

    session_for("ray-routed")
    assert hasattr(ray_hf.prepare_trainer, "__wrapped__")
    trainer = ray_hf.prepare_trainer(Trainer(model=Net(), args=_args(tmp_path, gradient_accumulation_steps=3),
                                             train_dataset=Samples()))
    assert trainer.args.max_steps == 2 * (40 // 12)  # elastic: max_steps fixed from the global batch 4*3*1
    _session._set_session(None)
    plain = ray_hf.prepare_trainer(Trainer(model=Net(), args=_args(tmp_path), train_dataset=Samples()))
    assert plain.args.max_steps == -1  # outside raylastic: Ray's behaviour only
    assert type(plain).__name__ == "RayTransformersTrainer"


def test_a_name_bound_before_any_attempt_is_routed_too():
    """A train function unpickled in a worker binds Ray's ``prepare_trainer`` as the worker
    first imports it; the worker actor was created before (a fresh interpreter)."""
    code = ("import tempfile\n"
            "from raylastic.checkpoint.storage import Storage\n"
            "from raylastic._internal.worker_group.worker import TrainWorker\n"
            "TrainWorker(Storage(tempfile.mkdtemp()), 'run', 'run')\n"  # as a worker actor is created
            "from ray.train.huggingface.transformers import prepare_trainer\n"
            "import ray.train.huggingface.transformers._transformers_utils as u\n"
            "assert prepare_trainer is u.prepare_trainer and hasattr(prepare_trainer, '__wrapped__')\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=400)


def test_accelerate_state_is_reset_between_attempts():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    PartialState(cpu=True)
    GradientState()
    assert PartialState._shared_state and GradientState._shared_state
    ray_train_routes.reset_library_state()
    assert not PartialState._shared_state and not AcceleratorState._shared_state
    assert not GradientState._shared_state


def test_what_cannot_be_resized_in_place_falls_back_to_restarts_when_asked(tmp_path, caplog):
    """Ray's routed ``prepare_trainer`` passes ``fallback_to_restart=True``: a Ray Train script
    ours cannot resize in place (here an iterable dataset, as Ray Data's) keeps running as
    under Ray Train, with a warning; called directly, the same trainer is refused."""
    session_for("fallback")
    trainer = Trainer(model=Net(), args=_args(tmp_path, max_steps=4), train_dataset=Stream())
    with pytest.raises(ValueError, match="map-style"):
        prepare_trainer(trainer)
    with caplog.at_level("WARNING", logger="raylastic.integrations.transformers"):
        same = prepare_trainer(trainer, fallback_to_restart=True)
    assert same is trainer and trainer.args.max_steps == 4 and trainer.args.gradient_accumulation_steps == 1
    assert "not resized in place" in caplog.text and "map-style" in caplog.text

    import ray.train.huggingface.transformers as ray_hf

    routed = ray_hf.prepare_trainer(Trainer(model=Net(), args=_args(tmp_path, max_steps=4), train_dataset=Stream()))
    assert routed.args.max_steps == 4 and routed.args.gradient_accumulation_steps == 1  # Ray's preparation only


def test_the_default_global_batch_is_the_scripts_full_size(tmp_path):
    """A run that starts below max_workers keeps the batch the script describes at full
    size (per-device batch x accumulation x max_workers), so it can grow later."""
    session_for("full-size", max_workers=3)
    trainer = prepare_trainer(Trainer(model=Net(), args=_args(tmp_path), train_dataset=Samples()))
    assert trainer.args.gradient_accumulation_steps == 3  # 4 * 1 * 3 = 12 samples per step at world 1
    assert trainer.args.max_steps == 2 * (40 // 12)
