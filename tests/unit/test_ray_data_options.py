"""Which Ray Data execution options a dataset runs with under raylastic: Ray Train's own
resolution of ``DataConfig(execution_options=...)`` (no Ray cluster needed)."""

import pytest
from ray.data import DataContext, ExecutionOptions, ExecutionResources
from ray.train import DataConfig

from raylastic.data.ray_data import ingest_options


def test_one_execution_options_for_every_dataset():
    opts = ExecutionOptions(resource_limits=ExecutionResources(cpu=2, gpu=1))
    cfg = DataConfig(execution_options=opts)
    for name in ("train", "val"):
        got = ingest_options(cfg, name)
        assert got.resource_limits.cpu == 2 and got.resource_limits.gpu == 1
        assert got is not opts  # a copy: setting preserve_order on it leaves the user's alone


def test_per_dataset_options_and_the_default_for_the_others():
    ctx = DataContext.get_current()
    before = ctx.execution_options
    try:
        ctx.execution_options = ExecutionOptions(resource_limits=ExecutionResources(cpu=3), verbose_progress=True)
        cfg = DataConfig(execution_options={"train": ExecutionOptions(resource_limits=ExecutionResources(cpu=1))})
        assert ingest_options(cfg, "train").resource_limits.cpu == 1
        other = ingest_options(cfg, "val")  # not in the dict: the driver's DataContext, as Ray Train does
        assert other.resource_limits.cpu == 3 and other.verbose_progress
        assert ingest_options(None, "val").resource_limits.cpu == 3
    finally:
        ctx.execution_options = before


@pytest.mark.parametrize("cfg", [None, DataConfig()])
def test_without_options_nothing_is_limited(cfg):
    got = ingest_options(cfg, "train")
    assert got.resource_limits == ExecutionResources.for_limits()
