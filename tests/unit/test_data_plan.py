"""Pure index math of raylastic.data.plan: exhaustive small-world property loops."""

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler

from raylastic.data.plan import (
    EpochPlan,
    epoch_order,
    global_batch_indices,
    micro_batch_sizes,
    micro_batches,
    shard_bounds,
    shard_for_rank,
    steps_per_epoch,
)

N, GBS = 103, 12  # 8 steps, a dropped tail of 7


@pytest.mark.parametrize("shuffle", [True, False])
def test_ranks_partition_each_global_batch_for_every_world_size(shuffle):
    for step in range(steps_per_epoch(N, GBS)):
        batch = global_batch_indices(N, 3, 1, step, GBS, shuffle)
        assert len(batch) == GBS
        for world in range(1, 9):
            shards = [shard_for_rank(batch, r, world) for r in range(world)]
            assert list(itertools.chain(*shards)) == batch  # contiguous, rank order
            sizes = [len(s) for s in shards]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_uneven_split_is_contiguous_and_front_loaded():
    assert [shard_bounds(256, r, 3) for r in range(3)] == [(0, 86), (86, 171), (171, 256)]
    assert [len(shard_for_rank(list(range(256)), r, 3)) for r in range(3)] == [86, 85, 85]


@pytest.mark.parametrize("shuffle", [True, False])
def test_epoch_covers_each_index_once_except_dropped_tail(shuffle):
    steps = steps_per_epoch(N, GBS)
    batches = (global_batch_indices(N, 0, 2, k, GBS, shuffle) for k in range(steps))
    seen = list(itertools.chain(*batches))
    assert len(seen) == len(set(seen)) == steps * GBS == N - N % GBS
    order = list(epoch_order(N, seed=0, epoch=2, shuffle=shuffle))
    assert sorted(order) == list(range(N))
    assert seen == order[: steps * GBS]


def test_shuffle_matches_distributed_sampler_at_world_one_and_changes_per_epoch():
    for epoch in range(3):
        sampler = DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True, seed=7)
        sampler.set_epoch(epoch)
        assert epoch_order(N, seed=7, epoch=epoch, shuffle=True).tolist() == list(sampler)
    assert not torch.equal(epoch_order(N, seed=7, epoch=0, shuffle=True),
                           epoch_order(N, seed=7, epoch=1, shuffle=True))


def test_micro_batches_at_most_micro_batch_size():
    shard = list(range(86))
    assert [len(m) for m in micro_batches(shard, 32)] == [32, 32, 22]
    assert list(itertools.chain(*micro_batches(shard, 32))) == shard
    assert micro_batch_sizes(86, 32) == (32, 32, 22)
    assert micro_batch_sizes(64, 32) == (32, 32)
    assert micro_batch_sizes(5, 32) == (5,)


def _plan(world, rank, start_step, start_samples, gbs=GBS, micro=5, n=N):
    return EpochPlan(order=epoch_order(n, seed=1, epoch=0, shuffle=True), epoch=0,
                     start_step=start_step, start_samples=start_samples, global_batch_size=gbs,
                     micro_batch_size=micro, world_size=world, rank=rank)


def test_fixed_resize_at_any_step_keeps_global_batches_and_exactly_once():
    steps = steps_per_epoch(N, GBS)
    expected = [global_batch_indices(N, 1, 0, k, GBS, True) for k in range(steps)]
    for w1, w2, switch in itertools.product(range(1, 9), range(1, 9), range(steps + 1)):
        per_step = []
        for world, start, count in ((w1, 0, switch), (w2, switch, steps - switch)):
            plans = [_plan(world, r, start, start * GBS) for r in range(world)]
            assert all(p.num_steps == steps - start for p in plans)
            for k in range(count):
                per_step.append(list(itertools.chain(*(p.shard(k) for p in plans))))
        assert per_step == expected, (w1, w2, switch)


def test_dynamic_resize_resumes_at_sample_offset_exactly_once():
    micro, order = 3, epoch_order(N, seed=1, epoch=0, shuffle=True).tolist()
    for w1, w2, switch in itertools.product(range(1, 9), range(1, 9), range(5)):
        consumed, trained = 0, []
        for world, max_steps in ((w1, switch), (w2, None)):
            plans = [_plan(world, r, 0, consumed, gbs=micro * world, micro=micro)
                     for r in range(world)]
            count = plans[0].num_steps if max_steps is None else min(max_steps, plans[0].num_steps)
            for k in range(count):
                trained += itertools.chain(*(p.shard(k) for p in plans))
                consumed += micro * world
        assert trained == order[:consumed]  # in order: nothing skipped, nothing repeated
        assert N - consumed < micro * w2  # only a tail shorter than a global batch dropped


def test_iter_micro_batches_matches_shards():
    plan = _plan(3, 1, 2, 2 * GBS, micro=3)
    flat = list(itertools.chain(*plan.iter_micro_batches()))
    assert flat == list(itertools.chain(*(plan.shard(k) for k in range(plan.num_steps))))
    assert all(len(m) <= 3 for m in plan.iter_micro_batches())


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: global_batch_indices(N, 0, 0, 8, GBS, True), "step"),
        (lambda: global_batch_indices(N, 0, 0, 0, 0, True), "global_batch_size"),
        (lambda: shard_for_rank([1, 2], 2, 2), "rank"),
        (lambda: shard_for_rank([1, 2], 0, 0), "world_size"),
        (lambda: micro_batches([1, 2], 0), "micro_batch_size"),
        (lambda: _plan(13, 0, 0, 0), "global_batch_size"),
        (lambda: _plan(2, 0, 0, N + 1), "start_samples"),
    ],
)
def test_bad_arguments_name_the_parameter(call, name):
    with pytest.raises(ValueError, match=name):
        call()
