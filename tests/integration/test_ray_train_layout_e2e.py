"""Ray Train's storage options and run layout under ``raylastic.TorchTrainer``, end to end on
the shared local cluster: ``RunConfig(storage_filesystem=<pyarrow filesystem>)``,
``report(checkpoint_dir_name=...)`` directories directly under the run directory (every
rank's files in one), and workers changed into ``<Ray session>/artifacts/<run name>``."""

import os
import tempfile

import pyarrow.fs as pafs
import pytest
import ray
import ray.train
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

import raylastic

pytestmark = pytest.mark.timeout(300)


def _train(config):
    rank = ray.train.get_context().get_world_rank()
    for epoch in range(2):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"shard-{rank}"), "w") as f:
                f.write(str(epoch))
            ray.train.report({"epoch": epoch}, checkpoint=ray.train.Checkpoint.from_directory(d),
                             checkpoint_dir_name=f"checkpoint_epoch={epoch}")
    kept = ray.train.get_all_reported_checkpoints()
    return os.getcwd(), [c.checkpoint.path for c in kept]


def test_storage_filesystem_named_checkpoints_and_working_directory(local_cluster, tmp_path):
    root = tmp_path / "fs"
    root.mkdir()
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(DirFileSystem(path=str(root), fs=LocalFileSystem())))
    trainer = raylastic.TorchTrainer(
        _train, scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="layout", storage_path="bucket/runs", storage_filesystem=fs,
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=1)))
    result = trainer.fit()

    assert result.path == "bucket/runs/layout" and result.filesystem.type_name == fs.type_name
    run = root / "bucket" / "runs" / "layout"
    assert sorted(p.name for p in run.glob("checkpoint_epoch=*")) == ["checkpoint_epoch=1"]
    assert {"shard-0", "shard-1"} <= set(os.listdir(run / "checkpoint_epoch=1"))
    assert [c.path for c, _ in result.best_checkpoints] == ["bucket/runs/layout/checkpoint_epoch=1"]
    cwd, kept = result.return_value
    assert kept == ["bucket/runs/layout/checkpoint_epoch=1"]
    assert cwd.endswith(os.path.join("artifacts", "layout")), cwd
    with result.checkpoint.as_directory() as d:
        assert open(os.path.join(d, "shard-1")).read() == "1"
