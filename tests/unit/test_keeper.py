"""The bookkeeping of kept workers (keeper.py) and ScalingConfig.keep_workers_s, without Ray."""

import pytest

from raylastic import ConfigError, ScalingConfig
from raylastic._internal.worker_group.keeper import KeptWorkers
from raylastic._internal.worker_group.pool import _options_key
from raylastic.config import KEEP_ENV


def test_a_run_takes_kept_workers_of_its_options_and_ends_every_other():
    kept = KeptWorkers()
    kept.put("cpu", ["a", "b", "c"], keep_s=10, now=0)
    kept.put("gpu", ["g"], keep_s=10, now=0)
    taken, ended = kept.take("cpu", 2, now=5)
    assert taken == ["a", "b"]
    assert sorted(ended) == ["c", "g"]  # beyond what it asked for, and of other options
    assert len(kept) == 0


def test_all_or_nothing_a_run_asking_for_more_than_is_kept_starts_afresh():
    kept = KeptWorkers()
    kept.put("cpu", ["a", "b"], keep_s=10, now=0)
    taken, ended = kept.take("cpu", 3, now=1)
    assert (taken, sorted(ended)) == ([], ["a", "b"])


def test_expired_workers_are_ended_not_taken():
    kept = KeptWorkers()
    kept.put("cpu", ["old"], keep_s=1, now=0)
    kept.put("cpu", ["new"], keep_s=10, now=0)
    assert kept.expired(now=0.5) == []
    assert kept.expired(now=1.0) == ["old"]
    kept.put("cpu", ["late"], keep_s=1, now=0)
    taken, ended = kept.take("cpu", 1, now=2)
    assert (taken, ended) == (["new"], ["late"])
    kept.put("cpu", ["x"], keep_s=1, now=0)
    assert kept.all() == ["x"] and len(kept) == 0


def test_keep_workers_s_defaults_to_the_environment_and_is_checked(monkeypatch):
    monkeypatch.delenv(KEEP_ENV, raising=False)
    assert ScalingConfig().keep_workers_s == 0
    monkeypatch.setenv(KEEP_ENV, "12.5")
    assert ScalingConfig().keep_workers_s == 12.5
    assert ScalingConfig(keep_workers_s=0).keep_workers_s == 0  # explicit wins
    monkeypatch.setenv(KEEP_ENV, "soon")
    with pytest.raises(ConfigError, match="RAYLASTIC_KEEP_WORKERS_S='soon'"):
        ScalingConfig()
    monkeypatch.delenv(KEEP_ENV)
    with pytest.raises(ConfigError, match="ScalingConfig.keep_workers_s"):
        ScalingConfig(keep_workers_s=-1)
    with pytest.raises(ConfigError, match="ScalingConfig.keep_workers_s"):
        ScalingConfig(keep_workers_s=float("nan"))


def test_the_options_key_compares_amounts_as_numbers():
    """raylastic.TorchTrainer's workers ({"CPU": 1}, Ray Train's default) serve an
    ElasticTrainer's fit ({"CPU": 1.0}) and back; other amounts and options do not."""
    base = {"num_cpus": 1.0, "num_gpus": 0, "max_concurrency": 8, "resources": {"trainer_node": 1.0}}
    assert _options_key({**base, "num_cpus": 1}) == _options_key(base)
    assert _options_key({**base, "resources": {"trainer_node": 1}}) == _options_key(base)
    assert _options_key({**base, "num_cpus": 2}) != _options_key(base)
    assert _options_key({**base, "scheduling_strategy": "SPREAD"}) != _options_key(base)
    assert _options_key({**base, "num_gpus": True}) != _options_key({**base, "num_gpus": 1})
