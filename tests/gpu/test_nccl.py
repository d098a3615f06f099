"""The NCCL path (use_gpu=True): one worker per GPU, DDP over NCCL, a node loss on
multi-GPU machines. Skipped without a CUDA device (marker: gpu); CI has none."""

import pytest
import torch

from raylastic import ElasticTrainer, RunConfig, ScalingConfig
from raylastic.testing.cluster import LocalCluster
from raylastic.testing.train_funcs import ddp_regression

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]


def test_nccl_training_on_every_gpu(tmp_path):
    gpus = torch.cuda.device_count()
    with LocalCluster(num_nodes=gpus, cpus_per_node=1, node_resources=None) as cluster:
        for node in list(cluster.worker_nodes):  # give each node one GPU
            cluster.remove_node(node)
        for _ in range(gpus):
            cluster.add_node(num_gpus=1)
        result = ElasticTrainer(
            ddp_regression, train_loop_config={"total_steps": 20, "cuda": True},
            scaling_config=ScalingConfig(min_workers=1, max_workers=gpus, use_gpu=True),
            run_config=RunConfig(name="nccl", storage_path=str(tmp_path), verbose=False, progress=False),
        ).fit()
    assert result.world_sizes == [gpus]
    assert result.metrics["step"] == 20 and result.metrics["loss"] < 1.0
