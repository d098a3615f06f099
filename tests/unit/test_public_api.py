"""The public API is frozen: adding or removing a name is a deliberate change here."""

import raylastic

EXPECTED = [
    "CapacityTimeoutError", "Checkpoint", "CheckpointConfig", "ConfigError", "DeadlineUnreachableError", "ElasticState", "ElasticTrainer", "FailureConfig",
    "InsufficientCapacityError", "RaylasticError", "Result", "RunConfig", "RunInUseError", "ScalingConfig",
    "TorchTrainer", "TrainingAborted", "TrainingFailedError", "data", "get_checkpoint", "get_context",
    "get_dataset_shard", "report",
]


def test_all_is_frozen():
    assert sorted(raylastic.__all__) == sorted(EXPECTED)


def test_every_name_resolves():
    for name in raylastic.__all__:
        assert getattr(raylastic, name) is not None, name
    from ray.train import Checkpoint

    assert raylastic.Checkpoint is Checkpoint
    assert raylastic.data.ElasticDataLoader is not None
    from raylastic.ray_train import TorchTrainer

    assert raylastic.TorchTrainer is TorchTrainer
