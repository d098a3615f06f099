"""FSDP2 with the model on the GPU (use_gpu=True: NCCL, one worker per GPU): every step's
sharded snapshot copies CUDA DTensor shards to host memory, every step is persisted, and
a second run resumed from storage (``ElasticTrainer.restore``) re-shards the persisted
state back onto the GPU and ends on the same weights as one uninterrupted run. Skipped
without a CUDA device (marker: gpu); CI has none."""

import pytest
import torch

from raylastic import ElasticTrainer, RunConfig, ScalingConfig
from raylastic.testing.cluster import LocalCluster
from raylastic.testing.sharded_funcs import fsdp2_mlp

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def _fit(tmp_path, name, epochs, weights_out, *, gpus, use_gpu=True, resume=False, lean=False):
    config = {"epochs": epochs, "persist_every": 1, "hidden": 64, "n": 480, "cuda": use_gpu,
              "weights_out": str(weights_out), "lean_snapshots": lean}
    kwargs = dict(train_loop_config=config,
                  scaling_config=ScalingConfig(min_workers=gpus, max_workers=gpus, use_gpu=use_gpu),
                  run_config=RunConfig(verbose=False, progress=False))
    if resume:
        return ElasticTrainer.restore(str(tmp_path / name), fsdp2_mlp, **kwargs).fit()
    kwargs["run_config"] = RunConfig(name=name, storage_path=str(tmp_path), verbose=False, progress=False)
    return ElasticTrainer(fsdp2_mlp, **kwargs).fit()


def resumed_equals_uninterrupted(tmp_path, *, gpus, use_gpu=True, lean=False):
    """The check itself, callable without a GPU (``use_gpu=False``) to try it on CPU."""
    with LocalCluster(num_nodes=gpus, cpus_per_node=1, node_resources=None) as cluster:
        if use_gpu:
            for node in list(cluster.worker_nodes):  # give each node one GPU
                cluster.remove_node(node)
            for _ in range(gpus):
                cluster.add_node(num_gpus=1)
        whole = _fit(tmp_path, "whole", 3, tmp_path / "whole.pt", gpus=gpus, use_gpu=use_gpu, lean=lean)
        first = _fit(tmp_path, "split", 1, tmp_path / "first.pt", gpus=gpus, use_gpu=use_gpu, lean=lean)
        rest = _fit(tmp_path, "split", 3, tmp_path / "rest.pt", gpus=gpus, use_gpu=use_gpu, resume=True, lean=lean)
    assert whole.world_sizes == [gpus] and first.world_sizes == [gpus] and rest.world_sizes == [gpus]
    assert whole.metrics["restored_from"] == "none" and rest.metrics["restored_from"] == "storage"
    assert rest.metrics["epoch"] == whole.metrics["epoch"] == 2
    assert rest.metrics["step"] == whole.metrics["step"]
    a, b = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "rest.pt")
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


def test_fsdp2_on_the_gpu_resumes_from_storage_like_an_uninterrupted_run(tmp_path):
    resumed_equals_uninterrupted(tmp_path, gpus=torch.cuda.device_count())


def test_lean_fsdp2_snapshots_on_the_gpu_persist_what_an_uninterrupted_run_trains(tmp_path):
    """``lean_snapshots=True`` with CUDA shards: the own shard is copied out of the live
    state after the commit, behind an event on the training stream; every step persisted
    from it resumes to the same weights."""
    resumed_equals_uninterrupted(tmp_path, gpus=torch.cuda.device_count(), lean=True)
