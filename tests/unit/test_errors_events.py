"""Errors group per-rank causes and pickle; the event log survives a torn last line."""

import json
import pickle

import pytest

from raylastic._internal.controller import states
from raylastic.errors import InsufficientCapacityError, RankFailure, TrainingFailedError
from raylastic.events import read_jsonl


def test_training_failed_error_groups_ranks_and_pickles():
    fails = [
        RankFailure(0, 1, "error", "ValueError: bad batch", "Traceback ...\nValueError: bad batch"),
        RankFailure(3, 1, "error", "ValueError: bad batch"),
        RankFailure(2, 1, "node_lost", "node died"),
    ]
    e = TrainingFailedError("failure budget exhausted", fails)
    text = str(e)
    assert "[ranks 0,3]: error: ValueError: bad batch" in text
    assert "[rank 2]: node_lost: node died" in text
    e2 = pickle.loads(pickle.dumps(e))
    assert str(e2) == text and e2.failures == fails


def test_capacity_error_names_the_knobs_and_pickles():
    e = InsufficientCapacityError(4, 1, 30.0, {"CPU": 1})
    assert "max_wait_s" in str(e) and "min_workers=4" in str(e)
    assert str(pickle.loads(pickle.dumps(e))) == str(e)


def test_truncated_last_line_is_skipped_but_corruption_inside_is_not():
    good = json.dumps({"kind": "a"})
    assert list(read_jsonl(f"{good}\n{good}\n{{\"kind\": \"b")) == [{"kind": "a"}] * 2
    with pytest.raises(ValueError, match="line 2"):
        list(read_jsonl(f"{good}\nnot json\n{good}\n"))


def test_state_machine_transitions_are_checked():
    sched = states.Scheduling(since=0.0)
    running = states.Running(epoch=1, members=[], started_at=0.0, restored_index=0)
    states.check_transition(sched, running)
    states.check_transition(running, states.Resizing(epoch=1, members=[], reason="x", graceful=True))
    with pytest.raises(AssertionError, match="Scheduling -> Finished"):
        states.check_transition(sched, states.Finished())
    with pytest.raises(AssertionError):
        states.check_transition(states.Finished(), sched)
    assert states.is_terminal(states.Errored(RuntimeError()))
