"""The pure parts of Ray Data input (raylastic/data/ray_data.py), without Ray: which rows a
rank reads from a position, and that resuming the position at any world size trains
every row of the epoch exactly once."""

import random

import pytest
import ray.train

from raylastic.data.ray_data import DataPosition, item_ranges, validate_datasets
from raylastic.errors import ConfigError


def _rows(ranges):
    return [i for lo, hi in ranges for i in range(lo, hi)]


def test_full_global_batches_are_cut_by_rank():
    # b=4, W=3: rank r takes [g + 4r, g + 4r + 4) of each 12-row global batch.
    assert item_ranges(0, 4, 3, 1, 2, None, False) == ([(4, 8), (16, 20)], False)
    assert item_ranges(24, 4, 3, 2, 1, 100, False) == ([(32, 36)], False)


def test_the_final_partial_global_batch_is_split_evenly_or_dropped():
    # 10 rows left at b=4, W=3: shares 4/3/3 (shard_bounds), then the epoch ends.
    shares = [item_ranges(90, 4, 3, r, 1, 100, False) for r in range(3)]
    assert [s[0] for s in shares] == [[(90, 94)], [(94, 97)], [(97, 100)]]
    assert all(s[1] for s in shares)
    # drop_last drops it; fewer rows than ranks would leave a rank without a step: dropped.
    assert item_ranges(90, 4, 3, 0, 1, 100, True) == ([], True)
    assert item_ranges(98, 4, 3, 0, 1, 100, False) == ([], True)
    # An exact end: the last full batch says so when the total is known.
    assert item_ranges(88, 4, 3, 0, 1, 100, False) == ([(88, 92)], True)
    assert item_ranges(100, 4, 3, 0, 1, 100, False) == ([], True)


def _consume(n, start, b, world, steps, drop_last=False):
    """Every rank's rows for ``steps`` steps from ``start`` (None: to the end), and the
    position after them."""
    rows, g = [], start
    for _ in range(steps if steps is not None else 10 ** 9):
        per_rank = [item_ranges(g, b, world, r, 1, n, drop_last) for r in range(world)]
        got = [rng for rng, _ in per_rank]
        assert len({len(x) for x in got}) == 1, "every rank takes the same number of steps"
        if not got[0]:
            return rows, None
        for rng in got:
            rows += _rows(rng)
        g += b * world
        if per_rank[0][1]:
            return rows, None
    return rows, g


@pytest.mark.parametrize("seed", range(40))
def test_resizes_at_any_point_train_each_row_once(seed):
    rnd = random.Random(seed)
    n, b = rnd.randrange(50, 400), rnd.randrange(1, 9)
    drop_last = rnd.random() < 0.3
    world, pos, trained = rnd.randrange(1, 5), 0, []
    while pos is not None:
        rows, pos = _consume(n, pos, b, world, rnd.randrange(0, 6))
        trained += rows
        world = rnd.randrange(1, 5)  # the next group, resuming from the position
    assert len(trained) == len(set(trained)), "no row twice"
    missing = set(range(n)) - set(trained)
    # Only a final partial global batch may be dropped (drop_last, or fewer rows than ranks).
    assert not missing or (min(missing) >= n - b * 4 and max(missing) == n - 1)
    if not drop_last:
        assert len(missing) < 4


def test_position_roundtrip_and_checks():
    assert DataPosition.from_dict({"epoch": 2, "rows": 36}) == DataPosition(2, 36)
    assert DataPosition(1, 5).to_dict() == {"epoch": 1, "rows": 5}
    for bad in ({"epoch": 1}, {"epoch": -1, "rows": 0}, {"epoch": 1, "rows": True}, [1, 2]):
        with pytest.raises(ValueError):
            DataPosition.from_dict(bad)


def test_validate_datasets_splits_all_by_default_and_checks_names():
    factory = lambda: None  # noqa: E731 - Ray Train's Callable[[], Dataset]; called at fit()
    datasets, split = validate_datasets({"train": factory, "valid": factory}, None)
    assert split == ["train", "valid"] and set(datasets) == {"train", "valid"}
    _, split = validate_datasets({"train": factory, "valid": factory},
                                 ray.train.DataConfig(datasets_to_split=["train"]))
    assert split == ["train"]
    with pytest.raises(ConfigError, match=r"names \['nope'\].*names: \['train'\]"):
        validate_datasets({"train": factory}, ray.train.DataConfig(datasets_to_split=["nope"]))

    class Custom(ray.train.DataConfig):
        def configure(self, *a, **k):
            return super().configure(*a, **k)

    with pytest.raises(ConfigError, match="its own configure"):
        validate_datasets({"train": factory}, Custom())
