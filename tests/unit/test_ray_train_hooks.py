"""Ray Train's Backend hooks and UserCallbacks under raylastic's controller, without Ray.

The controller is stepped against the fake worker group of ``test_controller.py``
(``fake_group.py``) with a real ``RayTrainHooks``: which hook runs at which moment of
which group, what ``after_report`` / ``after_exception`` get, and how an exception raised
by the user's hook or callback ends the run (``ray.train.ControllerError``, as in Ray
Train 2.60). The translation cases check what ``TorchTrainer(...)`` accepts and refuses.
tests/integration/test_ray_train_dropin.py runs the same on a real cluster.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any, List

import pytest
import ray
import ray.train
from ray.train.backend import Backend, BackendConfig
from ray.train.torch import TorchConfig
from ray.train.v2._internal.execution.callback import ControllerCallback

from raylastic import ConfigError, TorchTrainer
from raylastic._internal.controller.controller import Controller
from raylastic._internal.controller.states import Errored, Finished
from raylastic._internal.ray_train_errors import RankError
from raylastic._internal.ray_train_hooks import RayTrainHooks
from raylastic.checkpoint.storage import Storage
from raylastic.config import FailureConfig, RunConfig, ScalingConfig
from raylastic.errors import TrainingFailedError
from raylastic.policies.scaling import ElasticScalingPolicy

from fake_group import FakeGroup

RUN = "run"


@pytest.fixture(autouse=True)
def no_ray():
    assert not ray.is_initialized()
    yield
    assert not ray.is_initialized()


def _backend_config(calls: List[Any], fail: str = ""):
    """A BackendConfig whose Backend (a fresh class: Backend is a per-class singleton)
    records each hook as (name, len(worker_group)) and raises in the one named ``fail``."""

    class RecordingBackend(Backend):
        def _hook(self, name, worker_group):
            calls.append((name, len(worker_group)))
            if name == fail:
                raise ValueError(f"{name} failed")

        def on_start(self, worker_group, backend_config):
            self._hook("on_start", worker_group)

        def on_training_start(self, worker_group, backend_config):
            self._hook("on_training_start", worker_group)

        def on_shutdown(self, worker_group, backend_config):
            self._hook("on_shutdown", worker_group)

    class RecordingConfig(BackendConfig):
        @property
        def backend_cls(self):
            return RecordingBackend

    return RecordingConfig()


class Recorder(ray.train.UserCallback):
    def __init__(self, fail_in: str = ""):
        self.reports: List[Any] = []
        self.exceptions: List[Any] = []
        self.fail_in = fail_in

    def after_report(self, run_context, metrics, checkpoint):
        self.reports.append((run_context.get_run_config().name, [m["step"] for m in metrics],
                             checkpoint.path.rsplit("/", 1)[-1] if checkpoint else None))
        if self.fail_in == "after_report":
            raise KeyError("callback bug")

    def after_exception(self, run_context, worker_exceptions):
        self.exceptions.append(worker_exceptions)


def _controller(tmp_path, backend=None, callbacks=(), total=1000, checkpoint_every=None):
    storage = Storage(str(tmp_path))
    group = FakeGroup(storage, RUN, total=total, checkpoint_every=checkpoint_every)
    run = RunConfig(name=RUN, storage_path=str(tmp_path), verbose=False, poll_interval_s=0.001,
                    failure_config=FailureConfig(max_failures=0))
    context = type("Ctx", (), {"get_run_config": lambda self: ray.train.RunConfig(name=RUN)})()
    hooks = RayTrainHooks(backend, list(callbacks), context, str(tmp_path), {"CPU": 1})
    ctrl = Controller(
        lambda: None, None, ScalingConfig(min_workers=2, max_workers=3), run, storage, RUN, RUN,
        scaling_policy=ElasticScalingPolicy(min_workers=2, max_workers=3, settle_s=0.0), group=group, hooks=hooks)
    return ctrl, group


def test_backend_hooks_run_around_every_group_formed(tmp_path):
    calls: List[Any] = []
    ctrl, group = _controller(tmp_path, backend=_backend_config(calls), total=30)
    a, b, c = (group.add_worker(n) for n in ("na", "nb", "nc"))
    group.on_report = lambda rank, index: group.lose_node("nc") if index == 10 and rank == 2 else None

    outcome = ctrl.run()

    assert outcome["error"] is None and outcome["world_sizes"] == [3, 2]
    # Ray Train restarts its group on a resize: shutdown of the old, start of the new.
    assert calls == [("on_start", 3), ("on_training_start", 3), ("on_shutdown", 3),
                     ("on_start", 2), ("on_training_start", 2), ("on_shutdown", 2)]


def test_after_report_gets_every_rank_once_per_index_with_the_committed_checkpoint(tmp_path):
    cb = Recorder()
    ctrl, group = _controller(tmp_path, callbacks=[cb], total=6, checkpoint_every=3)
    for n in ("na", "nb"):
        group.add_worker(n)

    assert ctrl.run()["error"] is None
    assert cb.reports == [(RUN, [i, i], f"checkpoint_{i:08d}-e1" if i % 3 == 0 else None) for i in range(1, 7)]
    assert cb.exceptions == []


def test_after_exception_gets_the_failed_ranks(tmp_path):
    cb = Recorder()
    ctrl, group = _controller(tmp_path, callbacks=[cb])
    handles = [group.add_worker(n) for n in ("na", "nb")]
    ctrl.tick()  # the group forms
    group.worker(handles[1]).raise_at = 3

    outcome = ctrl.run()

    assert isinstance(outcome["error"], TrainingFailedError) and "rank 1" in str(outcome["error"])
    assert [r[1] for r in cb.reports] == [[1, 1], [2, 2]]  # the reports before the error
    assert len(cb.exceptions) == 1
    errors = cb.exceptions[0]
    assert list(errors) == [1] and isinstance(errors[1], RankError)
    assert str(errors[1]) == "ValueError: rank 1 failed at 3"


def test_a_raising_callback_ends_the_run_with_ray_trains_controller_error(tmp_path):
    calls: List[Any] = []
    cb = Recorder(fail_in="after_report")
    ctrl, group = _controller(tmp_path, backend=_backend_config(calls), callbacks=[cb], total=5)
    for n in ("na", "nb"):
        group.add_worker(n)

    outcome = ctrl.run()

    err = outcome["error"]
    assert isinstance(err, ray.train.ControllerError) and isinstance(err.controller_failure, KeyError)
    assert "Recorder.after_report raised KeyError" in str(err)
    assert isinstance(ctrl._state, Errored) and len(cb.reports) == 1
    assert calls[-1] == ("on_shutdown", 2)  # the group still gets its shutdown hook
    assert isinstance(pickle.loads(pickle.dumps(err)).controller_failure, KeyError)  # travels to the driver


@pytest.mark.parametrize("fail", ["on_start", "on_training_start", "on_shutdown"])
def test_a_raising_backend_hook_ends_the_run(tmp_path, fail):
    calls: List[Any] = []
    ctrl, group = _controller(tmp_path, backend=_backend_config(calls, fail=fail), total=5)
    for n in ("na", "nb"):
        group.add_worker(n)

    outcome = ctrl.run()

    err = outcome["error"]
    assert isinstance(err, ray.train.ControllerError), err
    assert f"RecordingBackend.{fail} raised ValueError: {fail} failed" in str(err)
    assert calls[-1] == ("on_shutdown", 2) and calls.count(("on_shutdown", 2)) == 1
    if fail == "on_shutdown":  # training itself finished
        assert [c for c, _ in calls] == ["on_start", "on_training_start", "on_shutdown"]
        assert not isinstance(ctrl._state, Finished)


# -- what TorchTrainer(...) accepts ---------------------------------------------------------

def _trainer(tmp_path, **kw):
    kw.setdefault("run_config", ray.train.RunConfig(name="t", storage_path=str(tmp_path)))
    return TorchTrainer(lambda: None, **kw)


def test_any_backend_config_is_accepted_and_torch_config_keeps_raylastics_path(tmp_path):
    bc = _backend_config([])
    t = _trainer(tmp_path, torch_config=bc)
    assert t.translation.backend is bc and isinstance(t._trainer._hooks, RayTrainHooks)
    assert _trainer(tmp_path, torch_config=TorchConfig()).translation.backend is None
    assert _trainer(tmp_path)._trainer._hooks is None  # nothing to call: no hooks at all

    class OwnTorchBackend(Backend):
        pass

    class OwnTorchConfig(TorchConfig):  # a TorchConfig with its own backend: its hooks run
        @property
        def backend_cls(self):
            return OwnTorchBackend

    assert isinstance(_trainer(tmp_path, torch_config=OwnTorchConfig()).translation.backend, OwnTorchConfig)


def test_user_callbacks_are_accepted_with_ray_trains_run_context(tmp_path):
    cb = Recorder()
    t = _trainer(tmp_path, run_config=ray.train.RunConfig(name="t", storage_path=str(tmp_path), callbacks=[cb]))
    assert t.translation.callbacks == (cb,)
    ctx = t._trainer._hooks._run_context
    assert ctx.get_run_config().name == "t" and isinstance(ctx.backend_config, TorchConfig)
    assert ctx.scaling_config.num_workers == 1  # Ray Train's default ScalingConfig


class _NotPicklable(BackendConfig):
    def __init__(self):
        self.lock = threading.Lock()


class _BadBackendCls(BackendConfig):
    @property
    def backend_cls(self):
        return dict


class _ReplicaBackend(Backend):
    has_replica_groups = True


class _ReplicaConfig(BackendConfig):
    @property
    def backend_cls(self):
        return _ReplicaBackend


@pytest.mark.parametrize("torch_config, needles", [
    ({"backend": "gloo"}, ["torch_config must be a ray.train.backend.BackendConfig", "builtins.dict"]),
    (_NotPicklable(), ["torch_config=_NotPicklable() cannot be pickled", "controller actor"]),
    (_BadBackendCls(), ["backend_cls must be a ray.train.backend.Backend subclass"]),
    (_ReplicaConfig(), ["has_replica_groups", "replica groups"]),
])
def test_backend_configs_refused(tmp_path, torch_config, needles):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, torch_config=torch_config)
    for needle in needles:
        assert needle in str(e.value)


class _Unpicklable(ray.train.UserCallback):
    def __init__(self):
        self.lock = threading.Lock()


@pytest.mark.parametrize("callbacks, needles", [
    ([Recorder(), object()], ["RunConfig.callbacks[1]='object'", "subclass ray.train.UserCallback"]),
    ([ControllerCallback()], ["RunConfig.callbacks[0]='ControllerCallback'", "Ray Train's own controller"]),
    ([_Unpicklable()], ["RunConfig.callbacks[0] (_Unpicklable) cannot be pickled"]),
    (Recorder(), ["RunConfig.callbacks must be a list"]),
])
def test_callbacks_refused(tmp_path, callbacks, needles):
    rc = ray.train.RunConfig(name="t", storage_path=str(tmp_path))
    rc.callbacks = callbacks  # after construction: Ray's own check refuses some of these
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, run_config=rc)
    for needle in needles:
        assert needle in str(e.value)
