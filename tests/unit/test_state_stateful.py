"""``ElasticState(stateful={"name": obj})``: any object with ``state_dict()`` /
``load_state_dict()`` is snapshotted, persisted and restored like the LR scheduler. No Ray:
a real Session, AsyncUploader and local storage, one process."""

import os

import pytest
import torch

from raylastic.checkpoint.storage import Storage
from raylastic.checkpoint.uploader import AsyncUploader
from raylastic.errors import ConfigError
from raylastic.session import GroupSpec, RestoreInfo, Session, _set_session, checkpoint_rel
from raylastic.state import STATE_FILE, STORE, ElasticState


class Counter:
    """A contributor of state that is neither a module nor an optimizer."""

    def __init__(self, seen=0):
        self.seen = seen
        self.loaded = 0

    def state_dict(self):
        return {"seen": self.seen, "history": [self.seen] * 2}

    def load_state_dict(self, sd):
        self.seen = sd["seen"]
        self.loaded += 1


@pytest.fixture
def run(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    run_rel = f"run-{tmp_path.name}"  # the store is process-wide: one run per test

    def session(restore=None, persist_every=2):
        spec = GroupSpec(epoch=1, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                         master_addr="127.0.0.1", master_port=0, backend="gloo")
        sess = Session(spec=spec, storage=storage, run_rel=run_rel, run_name="run", restore=restore or RestoreInfo(),
                       uploader=AsyncUploader(storage, staging_root=str(tmp_path / "staging")),
                       async_upload=False, persist_every=persist_every)
        _set_session(sess)
        return sess

    yield session, storage, run_rel
    _set_session(None)


def _train(steps, counter, **kw):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = ElasticState(model=model, optimizer=opt, lr_scheduler=sched, stateful={"counter": counter},
                         step=0, **kw)
    for step in range(1, steps + 1):
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        sched.step()
        counter.seen += 10
        state.step = step
        state.commit()
    return state, model, sched


def test_a_stateful_object_rides_in_the_snapshot_and_in_elastic_state_pt(run):
    session, storage, run_rel = run
    sess = session()
    _train(2, Counter())
    STORE.wait_pending()  # the copy of the parameters overlaps the next step
    snap = STORE.get(run_rel, 2)
    assert snap.plain["_objects"]["counter"] == {"seen": 20, "history": [20, 20]}
    assert "lr_scheduler" in snap.plain["_objects"]  # next to the LR scheduler, same format
    sess.uploader.wait(20)
    blob = torch.load(os.path.join(storage.path(checkpoint_rel(run_rel, 2, 1)), STATE_FILE), weights_only=True)
    assert blob["plain"]["_objects"]["counter"]["seen"] == 20
    assert set(blob["tensors"]) == {"model", "optimizer"}


def test_restored_from_memory(run):
    session, _storage, run_rel = run
    session(persist_every=None)
    _, model, sched = _train(3, Counter())
    STORE.wait_pending()  # as the worker does when an attempt ends
    session(restore=RestoreInfo(index=3, memory_index=3))
    counter = Counter()
    model2 = torch.nn.Linear(3, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
    state = ElasticState(model=model2, optimizer=opt2, lr_scheduler=sched2, stateful={"counter": counter}, step=0)
    assert state.restored_from == "memory" and state.step == 3
    assert counter.seen == 30 and counter.loaded == 1
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"] == 3
    assert torch.equal(model2.weight, model.weight)


def test_restored_from_storage(run):
    session, _storage, run_rel = run
    sess = session(persist_every=2)
    _train(2, Counter())
    sess.uploader.wait(20)
    session(restore=RestoreInfo(checkpoint_rel=checkpoint_rel(run_rel, 2, 1), index=2))
    counter = Counter()
    model = torch.nn.Linear(3, 1)
    state = ElasticState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                         stateful={"counter": counter}, step=0)
    assert state.restored_from == "storage" and state.step == 2
    assert counter.seen == 20 and counter.loaded == 1


def test_a_snapshot_without_the_object_leaves_it_as_it_is(run):
    """Snapshots taken before an object was registered restore; the object keeps its state."""
    session, _storage, run_rel = run
    session(persist_every=None)
    model = torch.nn.Linear(3, 1)
    state = ElasticState(model=model, step=0)
    state.step = 1
    state.commit()
    session(restore=RestoreInfo(index=1, memory_index=1))
    counter = Counter(seen=7)
    state = ElasticState(model=torch.nn.Linear(3, 1), stateful={"counter": counter}, step=0)
    assert state.restored_from == "memory" and state.step == 1
    assert counter.seen == 7 and counter.loaded == 0


@pytest.mark.parametrize("stateful,match", [
    ([Counter()], "must be a dict"),
    ({"": Counter()}, "non-empty strings"),
    ({"lr_scheduler": Counter()}, r"ElasticState\(lr_scheduler=...\)"),
    ({"thing": object()}, "no state_dict"),
])
def test_bad_registrations_fail_at_construction(run, stateful, match):
    run[0]()
    with pytest.raises(ConfigError, match=match):
        ElasticState(model=torch.nn.Linear(3, 1), stateful=stateful)


def test_a_state_dict_that_would_not_load_back_fails_at_commit_naming_the_object(run):
    class Opaque(Counter):
        def state_dict(self):
            return {"obj": object()}

    run[0](persist_every=None)
    state = ElasticState(model=torch.nn.Linear(3, 1), stateful={"opaque": Opaque()})
    with pytest.raises(ConfigError, match=r"ElasticState\(stateful=\{'opaque': ...\}\).state_dict\(\)"):
        state.commit()
