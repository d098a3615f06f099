"""raylastic.TorchTrainer with ``ScalingConfig(num_workers=0)``: Ray Train's local mode.

The train function runs in the test process, so these need no Ray cluster; each asserts
that Ray was never started, since local mode must not start one.
"""

import contextlib
import os

import pytest
import ray
import ray.train
import torch.distributed as dist
from ray.train.backend import BackendConfig
from ray.train.v2._internal.execution.train_fn_utils import get_train_fn_utils

from raylastic import ConfigError, TorchTrainer
from raylastic._internal.ray_train_local import is_local_mode
from raylastic.ray_train_config import translate
from raylastic.testing.ports import free_port


@pytest.fixture(autouse=True)
def no_ray():
    assert not ray.is_initialized()
    yield
    assert not ray.is_initialized(), "local mode started Ray"


def _local(func, **kw):
    return TorchTrainer(func, scaling_config=ray.train.ScalingConfig(num_workers=0), **kw)


def _ckpt(path, name):
    d = path / name
    d.mkdir()
    return ray.train.Checkpoint.from_directory(str(d))


def test_runs_in_this_process_with_a_one_rank_context(tmp_path):
    ck = _ckpt(tmp_path, "a")
    seen = {}

    def train_func(config):
        ctx = ray.train.get_context()
        seen.update(pid=os.getpid(), world=ctx.get_world_size(), rank=ctx.get_world_rank(),
                    local=ctx.get_local_rank(), name=ctx.get_experiment_name(),
                    device=str(ray.train.torch.get_device()))
        ray.train.report({"step": 1, "lr": config["lr"]}, checkpoint=ck)
        ray.train.report({"step": 2, "lr": config["lr"]})
        return "done"

    result = _local(train_func, train_loop_config={"lr": 0.5},
                    run_config=ray.train.RunConfig(name="dbg", storage_path=str(tmp_path / "store"))).fit()
    assert seen == {"pid": os.getpid(), "world": 1, "rank": 0, "local": 0, "name": "dbg", "device": "cpu"}
    assert result.metrics == {"step": 2, "lr": 0.5}
    assert result.checkpoint is ck  # the latest one reported, kept across a report without one
    assert result.return_value == "done"
    assert result.path is None and result.world_sizes == [1]
    assert isinstance(result, ray.train.Result)
    assert not (tmp_path / "store").exists(), "local mode persists nothing"


def test_context_is_removed_after_fit():
    _local(lambda: ray.train.report({"x": 1})).fit()
    with pytest.raises(RuntimeError, match="not initialized"):
        get_train_fn_utils()


def test_resume_checkpoint_until_one_is_reported(tmp_path):
    start, mine = _ckpt(tmp_path, "start"), _ckpt(tmp_path, "mine")
    got = []

    def train_func():
        got.append(ray.train.get_checkpoint())
        ray.train.report({"i": 0})
        got.append(ray.train.get_checkpoint())
        ray.train.report({"i": 1}, checkpoint=mine)
        got.append(ray.train.get_checkpoint())

    result = _local(train_func, resume_from_checkpoint=start).fit()
    assert [c.path for c in got] == [start.path, start.path, mine.path]
    assert result.checkpoint is mine


def test_nothing_reported():
    result = _local(lambda config: config.get("v", 7)).fit()
    assert result.metrics == {} and result.checkpoint is None and result.return_value == 7


def test_exception_propagates_unwrapped():
    class Boom(Exception):
        pass

    def train_func():
        raise Boom("in the driver")

    with pytest.raises(Boom, match="in the driver"):
        _local(train_func).fit()
    with pytest.raises(RuntimeError):
        get_train_fn_utils()


def test_datasets_are_given_whole():
    rows = [1, 2, 3]

    def train_func():
        assert ray.train.get_dataset_shard("train") is rows
        assert ray.train.get_dataset_shard("lazy") == ["made"]

    _local(train_func, datasets={"train": rows, "lazy": lambda: ["made"]}).fit()


def test_backend_train_func_context_is_entered():
    entered = []

    class Cfg(BackendConfig):
        @property
        def train_func_context(self):
            @contextlib.contextmanager
            def ctx():
                entered.append("in")
                yield
                entered.append("out")
            return ctx

    _local(lambda: entered.append("body"), torch_config=Cfg()).fit()
    assert entered == ["in", "body", "out"]


def test_torchrun_environment_forms_a_process_group(monkeypatch):
    # free_port picks outside the kernel's ephemeral range: a port 0 bind handed out one
    # that another process's connection took before torch's store bound it (EADDRINUSE, a
    # clean-clone make test, 2026-11-27)
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = []

    def train_func():
        seen.append((dist.is_initialized(), dist.get_world_size(), ray.train.get_context().get_world_size()))

    result = _local(train_func).fit()
    assert seen == [(True, 1, 1)] and result.world_sizes == [1]
    assert not dist.is_initialized(), "the group local mode formed is destroyed after fit"


@pytest.mark.parametrize("kw, needles", [
    ({"train_loop_config": [1]}, ["train_loop_config must be a dict", "list"]),
    ({"run_config": ray.train.RunConfig(worker_runtime_env={"env_vars": {"A": "1"}})},
     ["RunConfig.worker_runtime_env", "Fix:"]),
    ({"torch_config": "gloo"}, ["torch_config must be a ray.train.backend.BackendConfig"]),
])
def test_configs_are_still_checked(kw, needles):
    with pytest.raises(ConfigError) as e:
        _local(lambda: None, **kw)
    for needle in needles:
        assert needle in str(e.value)


def test_train_function_arity_is_checked():
    with pytest.raises(ConfigError, match="train_loop_per_worker should take in 0 or 1 required arguments"):
        _local(lambda a, b: None)


def test_only_int_zero_is_local_mode():
    assert is_local_mode(ray.train.ScalingConfig(num_workers=0))
    assert not is_local_mode(ray.train.ScalingConfig(num_workers=1))
    assert not is_local_mode(ray.train.ScalingConfig(num_workers=(1, 2)))
    sc = ray.train.ScalingConfig(num_workers=1)
    sc.num_workers = False
    assert not is_local_mode(sc)
    sc.num_workers = (0, 2)
    with pytest.raises(ConfigError, match=r"num_workers=\(0, 2\)"):
        TorchTrainer(lambda: None, scaling_config=sc)


def test_translate_alone_still_refuses_zero():
    sc = ray.train.ScalingConfig(num_workers=1)
    sc.num_workers = 0
    with pytest.raises(ConfigError, match="raylastic.TorchTrainer runs it itself"):
        translate(sc, None)
