"""Retention by metric, Ray Train's error types and Ray's checkpoint-manager snapshot, as
``raylastic.TorchTrainer`` applies them (no Ray cluster: local storage, plain objects)."""

import math
import pickle
from dataclasses import dataclass, field
from typing import Any, Dict

import pytest
import ray.train
from ray.train import CheckpointConfig as RayCheckpointConfig, RunConfig as RayRunConfig
from ray.train.v2.api.result import Result as RayResult

import raylastic
from raylastic._internal.ray_train_checkpoints import write_ray_snapshot
from raylastic._internal.ray_train_errors import ControllerFailed, RankError, WorkerGroupFailed, as_ray_error
from raylastic.checkpoint import scoring
from raylastic.checkpoint.manager import CheckpointManager
from raylastic.checkpoint.storage import Storage
from raylastic.config import CheckpointConfig
from raylastic.errors import RankFailure, TrainingFailedError, storage_failure
from raylastic.events import EventLog
from raylastic.ray_train_config import translate
from raylastic.session import ReportRecord, checkpoint_rel


@dataclass
class C:
    name: str
    metrics: Dict[str, Any] = field(default_factory=dict)


def names(cs):
    return [c.name for c in cs]


def test_without_attribute_the_newest_are_kept():
    cs = [C(str(i), {"s": -i}) for i in range(5)]
    assert names(scoring.to_delete(cs, 2, None)) == ["0", "1", "2"]
    assert names(scoring.best(cs, 2, None)) == ["3", "4"]
    assert scoring.to_delete(cs, None, "s") == [] and scoring.to_delete(cs, 5, "s") == []


def test_by_score_the_best_and_the_newest_are_kept():
    cs = [C("a", {"s": 5}), C("b", {"s": 1}), C("c", {"s": 3}), C("d", {"s": 0})]
    # max: d is worst but newest (a restart resumes from it): kept beside the best 2.
    assert names(scoring.to_delete(cs, 2, "s", "max")) == ["b"]
    assert names(scoring.kept(cs, 2, "s", "max")) == ["d", "c", "a"]  # Ray's list: worst first
    assert names(scoring.best(cs, 2, "s", "max")) == ["c", "a"]
    assert names(scoring.to_delete(cs, 2, "s", "min")) == ["a", "c"]
    assert names(scoring.best(cs, 2, "s", "min")) == ["b", "d"]


def test_ties_rank_the_newer_higher_nan_and_text_rank_last_missing_is_minus_inf(caplog):
    cs = [C("old", {"s": 1}), C("new", {"s": 1}), C("nan", {"s": math.nan}), C("none", {}),
          C("text", {"s": "high"}), C("nested", {"m": {"s": 0}}), C("last", {"s": 2})]
    assert names(scoring.ranked(cs, "s", "max")) == ["nan", "none", "text", "nested", "old", "new", "last"]
    # min: NaN and text still last; a missing key (-inf, negated) ranks first, as in Ray.
    assert names(scoring.ranked(cs, "s", "min")) == ["nan", "text", "last", "old", "new", "none", "nested"]
    assert names(scoring.ranked(cs, "m/s", "max"))[-1] == "nested"  # Ray's flattened key
    assert "no key 's'" in caplog.text and "not a number" in caplog.text


def _commit(mgr, storage, tmp_path, index, score):
    src = tmp_path / f"src-{index}"
    src.mkdir()
    (src / "w.bin").write_bytes(b"x")
    rel = checkpoint_rel("run", index, 1)
    rec = ReportRecord(index=index, rank=0, epoch=1, ts=0.0, metrics={"score": score},
                       checkpoint_rel=rel, files=storage.upload_dir(str(src), rel))
    return mgr.on_records([rec])


def test_manager_deletes_by_score_and_keeps_the_newest(tmp_path):
    storage = Storage(str(tmp_path))
    mgr = CheckpointManager(storage, "run", 2, EventLog(storage, "run", verbose=False),
                            score_attribute="score", score_order="min")
    mgr.begin_epoch(1, 1)
    for index, score in [(1, 0.5), (2, 0.1), (3, 0.9), (4, 0.3), (5, 0.7)]:
        _commit(mgr, storage, tmp_path, index, score)
    # best two by min: 2 (0.1) and 4 (0.3); 5 is the newest.
    assert [c.index for c in mgr.committed] == [2, 4, 5]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [
        checkpoint_rel("run", i, 1).rsplit("/", 1)[1] for i in (2, 4, 5)]
    assert mgr.latest().index == 5
    # A new driver lists exactly what is on storage.
    assert [c.index for c in CheckpointManager(storage, "run", 2, EventLog(storage, "run", verbose=False)).committed] \
        == [2, 4, 5]


def test_ray_checkpoint_config_maps_to_score_fields(tmp_path):
    cc = RayCheckpointConfig(num_to_keep=3, checkpoint_score_attribute="val/loss", checkpoint_score_order="min")
    run = translate(None, RayRunConfig(storage_path=str(tmp_path), checkpoint_config=cc)).run
    assert run.checkpoint_config == CheckpointConfig(num_to_keep=3, score_attribute="val/loss", score_order="min")


def _failures():
    return [RankFailure(rank=0, epoch=1, kind="error", message="ValueError: bad batch",
                        traceback="Traceback (most recent call last):\n  ...\nValueError: bad batch\n"),
            RankFailure(rank=1, epoch=1, kind="crash", message="worker process died")]


def test_worker_failures_are_ray_worker_group_errors_and_raylastic_errors():
    err = as_ray_error(TrainingFailedError("max_failures budget exhausted: FailureConfig.max_failures=0.",
                                           _failures()))
    assert isinstance(err, WorkerGroupFailed)
    for cls in (ray.train.TrainingFailedError, ray.train.WorkerGroupError, raylastic.TrainingFailedError):
        assert isinstance(err, cls)
    text = str(err)
    assert text.startswith("Training failed due to worker errors:\n[Rank 0]: error: ValueError: bad batch")
    assert text.index("ValueError: bad batch\n") < text.index("(raylastic: max_failures budget exhausted")
    assert set(err.worker_failures) == {0, 1} and isinstance(err.worker_failures[0], RankError)
    assert err.worker_failures[0].kind == "error" and "bad batch" in str(err.worker_failures[0])
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is WorkerGroupFailed and str(again) == text and again.failures == err.failures


def test_a_storage_failure_is_a_ray_controller_error():
    cause = OSError("disk gone")
    err = as_ray_error(storage_failure(cause, "file:///runs"))
    assert isinstance(err, ControllerFailed) and isinstance(err, ray.train.ControllerError)
    assert isinstance(err, raylastic.TrainingFailedError) and not isinstance(err, ray.train.WorkerGroupError)
    assert err.controller_failure is cause and err.__cause__ is cause
    assert str(err).startswith("Training failed due to controller error:\nthe controller could not write")
    assert isinstance(pickle.loads(pickle.dumps(err)), ControllerFailed)


def test_ray_result_from_path_reads_the_snapshot(tmp_path):
    storage = Storage(str(tmp_path))
    mgr = CheckpointManager(storage, "run", None, EventLog(storage, "run", verbose=False))
    mgr.begin_epoch(1, 1)
    for index, score in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 0.0)]:
        _commit(mgr, storage, tmp_path, index, score)
    write_ray_snapshot(storage, "run", CheckpointConfig(num_to_keep=2, score_attribute="score"))
    result = RayResult.from_path(str(tmp_path / "run"))
    # Ray's view: the kept ones worst first (the newest, 4, kept for being newest), latest = 4.
    assert [m["score"] for _, m in result.best_checkpoints] == [0.0, 2.0, 3.0]
    assert result.checkpoint.path == str(tmp_path / checkpoint_rel("run", 4, 1))
    assert result.get_best_checkpoint("score", "max").path == str(tmp_path / checkpoint_rel("run", 1, 1))
    with pytest.raises(RuntimeError, match="Invalid metric name"):
        result.get_best_checkpoint("nope", "max")
