"""Loss weighting: accumulated, DDP-averaged micro-batch gradients == full global-batch gradient."""

import pytest
import torch
from torch.utils.data import TensorDataset

import raylastic.data as rd
from raylastic.data import ElasticDataLoader

N, GBS, MICRO = 40, 13, 2  # 13 over W ranks is uneven for every W in 2..8


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(N, 1, generator=gen, dtype=torch.float64)
    return x, y


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1).double()


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("policy", ["fixed", "dynamic"])
def test_weighted_micro_grads_averaged_over_ranks_equal_full_batch_grad(policy):
    x, y = _data()
    dataset, model = TensorDataset(x, y), _model()
    mse = torch.nn.functional.mse_loss
    for world in range(1, 9):
        kw = (dict(global_batch_size=GBS) if policy == "fixed"
              else dict(global_batch_size=None, batch_policy="dynamic"))
        loaders = [ElasticDataLoader(dataset, micro_batch_size=MICRO, seed=1, world_size=world,
                                     rank=r, **kw) for r in range(world)]
        for batches in zip(*loaders):
            everything = [i for b in batches for i in b.indices]
            model.zero_grad()
            mse(model(x[everything]), y[everything]).backward()  # mean over the global batch
            full = _grads(model)
            per_rank = []
            for batch in batches:  # each rank accumulates its weighted micro-batches
                model.zero_grad()
                for (xb, yb), weight in batch.accumulate(model):
                    (mse(model(xb), yb) * weight).backward()
                per_rank.append(_grads(model))
            ddp_avg = [torch.stack(g).mean(0) for g in zip(*per_rank)]  # what DDP all-reduces
            assert all(torch.allclose(a, b) for a, b in zip(full, ddp_avg)), (world, batch.step)


def test_scale_loss_and_weights():
    loss = torch.tensor(2.0)
    assert rd.scale_loss(loss, 22, 256, 3).item() == pytest.approx(2.0 * 22 * 3 / 256)
    assert rd.loss_weight(32, 256, 8) == 1.0
    with pytest.raises(ValueError, match="global_batch_size"):
        rd.scale_loss(loss, 1, 0, 1)
    with pytest.raises(ValueError, match="num_samples_in_micro"):
        rd.loss_weight(0, 8, 1)


def test_micro_weights_sum_to_world_over_ranks():
    # Sum over ranks of a rank's weights == W, so the DDP mean of the weights is 1.
    for world in range(1, 9):
        loaders = [ElasticDataLoader(TensorDataset(torch.arange(N)), global_batch_size=GBS,
                                     micro_batch_size=MICRO, world_size=world, rank=r)
                   for r in range(world)]
        total = sum(sum(next(iter(loader)).micro_weights) for loader in loaders)
        assert total == pytest.approx(world)


def test_lr_scale_factor_rules():
    assert rd.lr_scale_factor(8, 2, "linear") == 4.0
    assert rd.lr_scale_factor(8, 2, rd.LRScaling.SQRT) == 2.0
    assert rd.lr_scale_factor(8, 2, "none") == 1.0
    with pytest.raises(ValueError, match="base_world_size"):
        rd.lr_scale_factor(8, 0)


def test_maybe_no_sync_is_a_no_op_for_plain_modules():
    with rd.maybe_no_sync(torch.nn.Linear(1, 1), True):
        pass
