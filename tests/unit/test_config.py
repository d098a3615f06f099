"""Bad input is rejected at construction, naming the field and the fix (no Ray)."""

import pytest

from raylastic import CheckpointConfig, ConfigError, FailureConfig, RunConfig, ScalingConfig


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"min_workers": 3, "max_workers": 2}, "min_workers (3) > max_workers (2)"),
        ({"min_workers": 0}, "min_workers=0 must be an int >= 1"),
        ({"min_workers": 1.5}, "min_workers"),
        ({"max_workers": 0}, "max_workers"),
        ({"max_wait_s": -1}, "max_wait_s"),
        ({"resources_per_worker": {"CPU": -1}}, "resources_per_worker['CPU']"),
        ({"resources_per_worker": {"CPU": float("nan")}}, "resources_per_worker['CPU']"),
        ({"resources_per_worker": {"": 1}}, "bad key"),
        ({"resources_per_worker": ["CPU"]}, "must be a dict"),
        ({"resources_per_worker": {"GPU": 1}}, "use_gpu=True"),
    ],
)
def test_scaling_config_rejects(kwargs, needle):
    with pytest.raises(ConfigError) as e:
        ScalingConfig(**kwargs)
    assert needle in str(e.value)


def test_scaling_config_defaults():
    s = ScalingConfig(min_workers=2)
    assert s.max_workers == 2
    assert s.worker_resources() == {"CPU": 1.0}
    assert s.backend == "gloo"
    g = ScalingConfig(min_workers=1, max_workers=4, use_gpu=True)
    assert g.worker_resources() == {"CPU": 1.0, "GPU": 1.0}
    assert g.backend == "nccl"
    c = ScalingConfig(resources_per_worker={"CPU": 2, "spot": 1})
    assert c.custom_resources() == {"spot": 1}


def test_scaling_config_is_frozen_and_keyword_only():
    s = ScalingConfig(min_workers=1)
    with pytest.raises(Exception):
        s.min_workers = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        ScalingConfig(1, 2)  # type: ignore[misc]


@pytest.mark.parametrize(
    "factory, needle",
    [
        (lambda: FailureConfig(max_failures=-2), "max_failures"),
        (lambda: FailureConfig(max_node_failures=-1), "max_node_failures"),
        (lambda: CheckpointConfig(num_to_keep=0), "num_to_keep"),
        (lambda: RunConfig(name="a/b"), "RunConfig.name"),
        (lambda: RunConfig(name=""), "RunConfig.name"),
        (lambda: RunConfig(storage_path=""), "storage_path"),
        (lambda: RunConfig(poll_interval_s=0), "poll_interval_s"),
        (lambda: RunConfig(failure_config={"max_failures": 1}), "failure_config"),
    ],
)
def test_other_configs_reject(factory, needle):
    with pytest.raises(ConfigError) as e:
        factory()
    assert needle in str(e.value)


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        ScalingConfig(min_workers=0)
