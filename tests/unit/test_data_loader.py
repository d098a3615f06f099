"""ElasticDataLoader: per-rank splits, resume across resizes, epochs, policies, bad input."""

import itertools
import math

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

import raylastic.data as rd
from raylastic.data import BatchPolicy, ElasticDataLoader
from raylastic.data.plan import global_batch_indices, steps_per_epoch


class IndexDataset(Dataset):
    """Sample i is the int i, so collated micro-batches show exactly what was read."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


N, GBS, MICRO = 50, 8, 3  # 6 fixed steps per epoch, tail of 2 dropped


def make(world, rank, n=N, **kw):
    kw.setdefault("global_batch_size", GBS)
    kw.setdefault("micro_batch_size", MICRO)
    return ElasticDataLoader(IndexDataset(n), seed=5, world_size=world, rank=rank, **kw)


def read(step_batch):
    """Indices as actually loaded and collated, checked against the advertised ones."""
    loaded = list(itertools.chain(*(m.tolist() for m in step_batch)))
    assert loaded == step_batch.indices
    assert all(len(m) <= MICRO for m in step_batch)
    return loaded


def test_every_world_size_splits_each_global_step():
    steps = steps_per_epoch(N, GBS)
    for world in range(1, 9):
        loaders = [make(world, r) for r in range(world)]
        assert all(len(loader) == steps for loader in loaders)
        for k, batches in enumerate(zip(*loaders)):
            assert {b.step for b in batches} == {k}
            assert [read(b) for b in batches] == [
                list(x) for x in _split(global_batch_indices(N, 5, 0, k, GBS, True), world)
            ]
            assert sum(b.num_samples for b in batches) == GBS
        assert k == steps - 1


def _split(indices, world):
    return [rd.shard_for_rank(indices, r, world) for r in range(world)]


def test_state_round_trip_resumes_next_step_after_world_size_change():
    steps = steps_per_epoch(N, GBS)
    expected = [global_batch_indices(N, 5, 0, k, GBS, True) for k in range(steps)]
    for w1, w2 in itertools.product(range(1, 9), repeat=2):
        for switch in (0, 1, 3, steps - 1, steps):
            before = [make(w1, r) for r in range(w1)]
            got = [list(itertools.chain(*map(read, bs)))
                   for bs in itertools.islice(zip(*before), switch)]
            state = before[0].state_dict()
            assert all(loader.state_dict() == state for loader in before)
            assert (state["epoch"], state["step"]) == (0, switch)
            after = [make(w2, r) for r in range(w2)]
            for loader in after:
                loader.load_state_dict(state)
            rest = list(zip(*after))
            if switch == steps:  # saved at the end of an epoch: resumes at the next one
                assert {b.epoch for bs in rest for b in bs} == {1} and len(rest) == steps
                continue
            assert [bs[0].step for bs in rest] == list(range(switch, steps))
            got += [list(itertools.chain(*map(read, bs))) for bs in rest]
            assert got == expected, (w1, w2, switch)


def test_epochs_advance_automatically_and_cover_every_index_once():
    loader = make(1, 0)
    orders = []
    for epoch in range(3):
        batches = list(loader)
        assert {b.epoch for b in batches} == {epoch}
        seen = list(itertools.chain(*(b.indices for b in batches)))
        assert len(seen) == len(set(seen)) == N - N % GBS
        orders.append(seen)
        assert loader.state_dict()["epoch"] == epoch + 1
        assert loader.state_dict()["step"] == 0
    assert orders[0] != orders[1] != orders[2]


def test_break_then_reiterate_continues_the_epoch():
    loader = make(2, 1)
    first = [b.step for b in itertools.islice(loader, 2)]
    rest = [b.step for b in loader]
    assert first + rest == list(range(6))
    assert next(iter(loader)).epoch == 1


def test_set_epoch_keeps_position_for_current_epoch_and_resets_otherwise():
    loader = make(1, 0)
    next(iter(loader))
    loader.set_epoch(0)  # the usual `for e in range(start, n): set_epoch(e)` after a resume
    assert next(iter(loader)).step == 1
    loader.set_epoch(4)
    batch = next(iter(loader))
    assert (batch.epoch, batch.step) == (4, 0)


def test_load_state_dict_stops_a_live_iterator():
    loader = make(1, 0)
    it = iter(loader)
    next(it)
    next(it)
    state = loader.state_dict()
    loader.load_state_dict(make(1, 0).state_dict())
    assert list(it) == []
    assert [b.step for b in loader] == list(range(6))
    loader.load_state_dict(state)
    assert next(iter(loader)).step == 2


def test_dynamic_policy_exactly_once_across_resizes():
    order = torch.randperm(N, generator=torch.Generator().manual_seed(5)).tolist()
    for w1, w2, w3 in itertools.product((1, 2, 4, 6, 8), (1, 3, 5, 7), (1, 2, 7)):
        trained, state = [], None
        for world, count in ((w1, 2), (w2, 1), (w3, None)):
            loaders = [make(world, r, global_batch_size=None, batch_policy="dynamic")
                       for r in range(world)]
            for loader in loaders:
                if state is not None:
                    loader.load_state_dict(state)
            for bs in itertools.islice(zip(*loaders), count):
                assert all(b.global_batch_size == MICRO * world for b in bs)
                assert all(b.micro_weights == (1.0,) for b in bs)
                if bs[0].epoch == 0:  # a stage may start after epoch 0's dropped tail
                    trained += itertools.chain(*map(read, bs))
            state = loaders[0].state_dict()
        assert trained == order[: len(trained)], (w1, w2, w3)  # none skipped or repeated
        assert N - len(trained) < MICRO * 8  # only a tail shorter than a global batch dropped


def test_dynamic_len_and_lr_scale():
    loader = make(4, 0, global_batch_size=None, batch_policy=BatchPolicy.DYNAMIC,
                  lr_scaling="sqrt", base_world_size=2)
    assert loader.global_batch_size == 12 and len(loader) == 4
    assert loader.lr_scale() == pytest.approx(math.sqrt(2))
    assert make(4, 0, global_batch_size=None, batch_policy="dynamic").lr_scale() == 4.0
    assert make(4, 0).lr_scale() == 1.0  # fixed global batch: nothing to rescale
    next(iter(loader))
    resized = make(2, 0, global_batch_size=None, batch_policy="dynamic")
    resized.load_state_dict(loader.state_dict())
    assert len(resized) == 1 + (N - 12) // 6


def test_apply_lr_scaling_uses_base_lrs_without_compounding():
    params = [torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))]
    opt = torch.optim.SGD([{"params": params[:1], "lr": 0.1}, {"params": params[1:], "lr": 0.2}])
    base = [g["lr"] for g in opt.param_groups]
    rd.apply_lr_scaling(opt, 2.0, base)
    rd.apply_lr_scaling(opt, 2.0, base)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.2, 0.4])
    with pytest.raises(ValueError, match="base_lrs"):
        rd.apply_lr_scaling(opt, 2.0, [0.1])
    with pytest.raises(ValueError, match="factor"):
        rd.apply_lr_scaling(opt, 0.0, base)


def test_world_comes_from_torch_distributed_when_initialised(monkeypatch):
    import raylastic.data.loader as loader_mod

    loader = make(None, None)
    assert (loader.world_size, loader.rank) == (1, 0)
    monkeypatch.setattr(loader_mod.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(loader_mod.dist, "get_world_size", lambda: 3)
    monkeypatch.setattr(loader_mod.dist, "get_rank", lambda: 2)
    batch = next(iter(loader))  # re-read at iter(): the group may be built after construction
    assert (batch.world_size, batch.rank, batch.num_samples) == (3, 2, 2)
    monkeypatch.setattr(loader_mod.dist, "get_world_size", lambda: 9)
    with pytest.raises(ValueError, match="global_batch_size"):
        iter(loader)


def test_workers_and_collate_fn_give_the_same_batches():
    def collate(samples):
        return torch.tensor(samples) * 10

    def epoch(seed_loader):
        return [[m.tolist() for m in b] for b in seed_loader]

    plain = make(3, 1, collate_fn=collate)
    expected = [epoch(plain), epoch(plain)]
    assert expected[0][0][0] == [10 * i for i in next(iter(make(3, 1))).indices[:MICRO]]
    loader = make(3, 1, collate_fn=collate, num_workers=2,
                  dataloader_kwargs={"persistent_workers": True})
    # The second epoch reuses the persistent workers with a new plan.
    assert [epoch(loader), epoch(loader)] == expected


class _RecordingModel:
    def __init__(self):
        self.entered = []

    def no_sync(self):
        import contextlib

        self.entered.append(len(self.entered))
        return contextlib.nullcontext()


def test_accumulate_skips_sync_on_all_but_the_last_micro_batch():
    batch = next(iter(make(1, 0)))  # 8 samples in micro-batches 3, 3, 2
    assert batch.micro_sizes == (3, 3, 2)
    model = _RecordingModel()
    pairs = list(batch.accumulate(model))
    assert model.entered == [0, 1]
    assert [w for _, w in pairs] == [3 / 8, 3 / 8, 2 / 8] == list(batch.micro_weights)
    assert [len(m) for m, _ in batch.accumulate(torch.nn.Linear(1, 1))] == [3, 3, 2]


class _NoLen(Dataset):
    def __getitem__(self, i):
        return i


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(global_batch_size=2, world_size=3, rank=0), "global_batch_size"),
        (dict(global_batch_size=4, max_world_size=5), "max_world_size"),
        (dict(micro_batch_size=0), "micro_batch_size"),
        (dict(micro_batch_size=-1), "micro_batch_size"),
        (dict(global_batch_size=None), "global_batch_size"),
        (dict(batch_policy="dynamic"), "global_batch_size"),
        (dict(batch_policy="dynamic", global_batch_size=None, micro_batch_size=None),
         "micro_batch_size"),
        (dict(batch_policy="elastic"), "batch_policy"),
        (dict(lr_scaling="cubic"), "lr_scaling"),
        (dict(world_size=2, rank=None), "rank"),
        (dict(world_size=2, rank=2), "rank"),
        (dict(world_size=4, rank=0, max_world_size=3), "max_world_size"),
        (dict(dataloader_kwargs={"batch_size": 4}), "batch_size"),
        (dict(seed=-1), "seed"),
        (dict(base_world_size=0), "base_world_size"),
    ],
)
def test_bad_arguments_raise_naming_the_parameter(kwargs, name):
    kwargs.setdefault("global_batch_size", GBS)
    with pytest.raises(ValueError, match=name):
        ElasticDataLoader(IndexDataset(N), **kwargs)


@pytest.mark.parametrize("dataset", [_NoLen(), _Stream(), IndexDataset(0)])
def test_bad_datasets_raise(dataset):
    with pytest.raises(ValueError, match="dataset"):
        ElasticDataLoader(dataset, global_batch_size=2)


def test_dynamic_needs_a_step_per_epoch():
    with pytest.raises(ValueError, match="micro_batch_size"):
        make(4, 0, n=10, global_batch_size=None, micro_batch_size=3, batch_policy="dynamic")


@pytest.mark.parametrize(
    "change, name",
    [
        (dict(n=N + 1), "dataset_len"),
        (dict(seed=6), "seed"),
        (dict(shuffle=False), "shuffle"),
        (dict(global_batch_size=10), "global_batch_size"),
        (dict(global_batch_size=None, batch_policy="dynamic"), "batch_policy"),
    ],
)
def test_incompatible_state_raises_at_load(change, name):
    state = make(2, 0).state_dict()
    n = change.pop("n", N)
    seed = change.pop("seed", 5)
    kw = dict(global_batch_size=GBS, micro_batch_size=MICRO, world_size=2, rank=0)
    kw.update(change)
    loader = ElasticDataLoader(IndexDataset(n), seed=seed, **kw)
    with pytest.raises(ValueError, match=name):
        loader.load_state_dict(state)


@pytest.mark.parametrize(
    "corrupt, name",
    [
        (lambda s: s.pop("samples"), "samples"),
        (lambda s: s.update(version=99), "version"),
        (lambda s: s.update(step=-1), "step"),
        (lambda s: s.update(samples=3), "samples"),
    ],
)
def test_malformed_state_raises(corrupt, name):
    state = make(2, 0).state_dict()
    corrupt(state)
    with pytest.raises(ValueError, match=name):
        make(2, 0).load_state_dict(state)


def test_micro_batch_size_may_change_on_resume_under_fixed_policy():
    loader = make(2, 0)
    next(iter(loader))
    other = make(3, 2, micro_batch_size=1)
    other.load_state_dict(loader.state_dict())
    batch = next(iter(other))
    assert batch.step == 1 and batch.micro_sizes == (1, 1)
