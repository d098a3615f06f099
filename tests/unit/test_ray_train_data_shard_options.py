"""A split dataset's shard reports the execution options its dataset runs with, as Ray
Train's shard does (``ray.train.get_dataset_shard(name).get_context().execution_options``
is what ``DataConfig`` resolved for ``name``). No Ray cluster needed."""

from ray.data import DataContext, ExecutionOptions, ExecutionResources
from ray.train import DataConfig

from raylastic.data.ray_data import DataPlan, DataShards, ingest_options
from raylastic.data.ray_data_iterator import ElasticDataIterator


def test_shard_context_carries_the_datasets_options():
    train = ExecutionOptions(resource_limits=ExecutionResources(cpu=4, gpu=2),
                             exclude_resources=ExecutionResources(cpu=2, gpu=1))
    train.preserve_order = False
    cfg = DataConfig(execution_options={"train": train})
    it = ElasticDataIterator("train", None, None, ingest_options(cfg, "train"))
    opts = it.get_context().execution_options
    assert (opts.resource_limits.cpu, opts.resource_limits.gpu) == (4, 2)
    assert (opts.exclude_resources.cpu, opts.exclude_resources.gpu) == (2, 1)
    assert opts.preserve_order is False
    assert DataContext.get_current().execution_options is not opts  # the rank's own context is left alone
    assert it.get_context() is it.get_context()


def test_without_options_the_shard_has_the_current_context():
    assert ElasticDataIterator("x", None, None).get_context() is DataContext.get_current()


def test_the_plan_hands_each_rank_the_options():
    opts = ExecutionOptions(resource_limits=ExecutionResources(cpu=1))
    plan = DataPlan(split={"train": object()}, whole={}, options={"train": opts})
    shards = DataShards.__new__(DataShards)  # (only get() is exercised: no session needed)
    shards._plan, shards._iters = plan, {}
    it = shards.get("train")
    assert isinstance(it, ElasticDataIterator) and it.get_context().execution_options.resource_limits.cpu == 1
