"""Lean sharded snapshots (``ElasticState(lean_snapshots=True)``, no Ray): one snapshot
kept, 2x the own shard between commits and 3x while a commit's peer copy is on the wire;
the older snapshot is dropped only once every rank's peer copies landed; an abort or a
failed peer copy keeps both. One rank of two, the side group's exchange stubbed; the
real gloo exchange is in ``test_lean_exchange_over_gloo``."""

from types import SimpleNamespace

import pytest
import torch

from raylastic._internal.snapshots.capture import nbytes
from raylastic._internal.snapshots.sharded.layout import Chunk, layout_fingerprint
from raylastic._internal.snapshots.sharded.state import ShardedState
from raylastic.session import StopTraining
from raylastic.state import Snapshot, SnapshotStore


class _Exchange:
    """What ``PeerExchange`` does (for a lean commit, and the default's ``exchange``), run
    when the test says; ``votes``:
    what the other rank answers (False: its peer copy failed)."""

    def __init__(self):
        self.jobs, self.votes, self.sent = [], [], []

    def sources(self):
        return [1]

    def receivers(self):
        return [1]

    def submit(self, job):
        self.jobs.append(job)

    def exchange(self, own, incoming, index):  # the default's peer copy
        incoming[1][0].fill_(float(index))

    def exchange_all(self, own, incoming, index):
        self.sent.append([t.clone() for t in own])
        incoming[1][0].fill_(float(-index))
        return True, True, None

    def all_true(self, flag):
        vote = self.votes.pop(0) if self.votes else True
        return flag and (vote() if callable(vote) else vote)

    def run(self):
        for job in self.jobs:
            job()
        self.jobs.clear()


def _lean(store, lean=True):
    live = torch.zeros(6)
    mine, peer = (Chunk("w", (12,), (o,), (6,), str(live.dtype)) for o in (0, 6))
    param = torch.nn.Parameter(torch.zeros(1))

    class Adapter:
        optimizer = torch.optim.SGD([param], lr=0.1)

        def live_chunks(self):
            return [(mine, live)]

        def plain(self):
            return {}

    spec = SimpleNamespace(rank=0, world_size=2, stripe=(), timeout_s=30.0)
    sess = SimpleNamespace(spec=spec, run_rel="r", aborted=False)
    st = ShardedState(Adapter(), sess, overlap=True, lean=lean, store=store)
    st._exchange, st._layout, st._local_fp = _Exchange(), {0: [mine], 1: [peer]}, layout_fingerprint([mine])
    return st, live, sess, Adapter.optimizer, param


def _commit(st, store, index):
    snap = Snapshot(index=index, plain={})
    start = st.capture(snap, None, persist=False)  # as ElasticState.commit does when lean
    snap.nbytes = nbytes(snap.tensors)
    store.add("r", snap, trim=False)
    start()
    return snap


def _voted_then_on_the_wire(store):
    """Snapshot 1 committed and voted (live 1.0), snapshot 2 captured (live 2.0), its peer
    copy not run yet."""
    st, live, sess, opt, param = _lean(store)
    live.fill_(1.0)
    one = _commit(st, store, 1)
    st._exchange.run()
    param.grad = torch.ones(1)
    opt.step()  # param: -0.1
    live.fill_(2.0)
    two = _commit(st, store, 2)
    return st, live, sess, opt, param, one, two


def test_lean_holds_2x_between_commits_3x_on_the_wire_and_keeps_the_state_of_the_commit():
    store = SnapshotStore(keep=2)
    st, live, _sess, opt, param = _lean(store)
    own = st.shard_bytes()
    on_the_wire, after = [], []
    for index in range(1, 5):
        live.fill_(float(index))  # the optimizer's step, before the commit
        snap = _commit(st, store, index)
        on_the_wire.append(store.nbytes() / own)
        assert store.complete_indices("r") == ([index - 1] if index > 1 else [])  # k whole until k+1 is
        st._exchange.run()
        after.append(store.nbytes() / own)
        param.grad = torch.zeros(1)
        opt.step()  # the hook waits for the commit (over here), then the live state may change
        live.fill_(99.0)
        assert store.complete_indices("r") == [index]
        assert snap.tensors["sharded"][0][0].tolist() == [float(index)] * 6  # not the 99s
        assert snap.tensors["sharded"][1][0].tolist() == [float(-index)] * 6
        assert st._exchange.sent[-1][0].tolist() == [float(index)] * 6
        assert snap.holding == (2, (0, 1))
    assert on_the_wire == [1, 3, 3, 3] and after == [2, 2, 2, 2]  # the default: [2, 4, 4, 4] both


def test_in_place_holds_2x_at_every_instant_and_reuses_the_buffers():
    """``lean_snapshots="in_place"``: the peer copy lands in the buffers of the shard the
    older snapshot backed up, which says it no longer holds it (a loss now restores from
    storage); the own shard moves into the older snapshot's own buffers after the vote."""
    store = SnapshotStore(keep=2)
    st, live, _sess, opt, param = _lean(store, lean="in_place")
    own = st.shard_bytes()
    on_the_wire, after, bufs = [], [], set()
    for index in range(1, 5):
        live.fill_(float(index))
        snap = _commit(st, store, index)
        on_the_wire.append(store.nbytes() / own)
        if index > 1:  # the older snapshot holds its own shard only, still that of its commit
            older = store.get("r", index - 1)
            assert store.holdings("r") == ([index - 1], {index - 1: (2, (0,))})
            assert older.tensors["sharded"][1][0].is_meta and older.tensors["sharded"][0][0].tolist() == [index - 1] * 6
        st._exchange.run()
        after.append(store.nbytes() / own)
        param.grad = torch.zeros(1)
        opt.step()
        live.fill_(99.0)
        assert store.holdings("r") == ([index], {index: (2, (0, 1))})
        assert snap.tensors["sharded"][0][0].tolist() == [float(index)] * 6
        assert snap.tensors["sharded"][1][0].tolist() == [float(-index)] * 6
        bufs.add((snap.tensors["sharded"][0][0].data_ptr(), snap.tensors["sharded"][1][0].data_ptr()))
    assert on_the_wire == [1, 2, 2, 2] and after == [2, 2, 2, 2]  # lean=True: [1, 3, 3, 3], [2, 2, 2, 2]
    assert len(bufs) == 1  # every commit lands in the same two buffers


def test_in_place_a_failed_vote_keeps_both_snapshots_as_far_as_they_go():
    """The older snapshot gave its peer shard up at the commit but keeps its own shard (a
    peer that unwound before committing the newer one holds only the older: every rank's
    own shard of it restores it); the newer one keeps its own shard, in new memory, and
    the peer shard that landed. One more shard until the restore."""
    store = SnapshotStore(keep=2)
    st, live, _sess, opt, param = _lean(store, lean="in_place")
    live.fill_(1.0)
    one = _commit(st, store, 1)
    st._exchange.run()
    param.grad = torch.ones(1)
    opt.step()
    live.fill_(2.0)
    two = _commit(st, store, 2)
    st._exchange.votes = [False]
    st._exchange.run()
    st.wait()
    assert store.holdings("r") == ([1, 2], {1: (2, (0,)), 2: (2, (0, 1))})
    assert one.tensors["sharded"][0][0].tolist() == [1.0] * 6 and two.tensors["sharded"][0][0].tolist() == [2.0] * 6
    assert two.tensors["sharded"][1][0].tolist() == [-2.0] * 6
    assert store.nbytes() == 3 * st.shard_bytes()


def test_in_place_no_commit_after_an_abort_gives_the_older_snapshot_up():
    """An aborted attempt's next commit would pair with no peer: it unwinds before the
    older snapshot lends anything, which stays whole."""
    store = SnapshotStore(keep=2)
    st, live, sess, opt, param = _lean(store, lean="in_place")
    live.fill_(1.0)
    one = _commit(st, store, 1)
    st._exchange.run()
    sess.aborted = True
    with pytest.raises(StopTraining):
        _commit(st, store, 2)
    assert store.holdings("r") == ([1], {1: (2, (0, 1))})
    assert one.holding == (2, (0, 1)) and one.tensors["sharded"][1][0].tolist() == [-1.0] * 6


def test_a_failed_vote_keeps_the_older_snapshot_and_the_newer_one_as_far_as_it_goes():
    store = SnapshotStore(keep=2)
    st, live, *_ = _voted_then_on_the_wire(store)
    st._exchange.votes = [False]  # the other rank's peer copy failed: it keeps snapshot 1
    st._exchange.run()
    st.wait()
    assert store.complete_indices("r") == [1, 2]
    one, two = store.get("r", 1), store.get("r", 2)
    assert one.tensors["sharded"][0][0].tolist() == [1.0] * 6 and one.holding == (2, (0, 1))
    # its own shard copied out of the live state into memory of its own, the peer's landed
    assert two.tensors["sharded"][0][0].tolist() == [2.0] * 6 and two.holding == (2, (0, 1))
    assert two.tensors["sharded"][0][0].data_ptr() != one.tensors["sharded"][0][0].data_ptr()


def test_a_vote_that_keeps_failing_keeps_the_last_voted_snapshot_and_no_pile():
    """Failed votes without an abort (training goes on): the last snapshot every peer copy
    of which landed stays until a newer one's vote passes, and at most it, the newest
    complete one and the one on the wire are held."""
    store = SnapshotStore(keep=2)
    st, live, _sess, opt, param = _lean(store)
    param.grad = torch.zeros(1)
    for index, vote in ((1, True), (2, False), (3, False), (4, False)):
        live.fill_(float(index))
        _commit(st, store, index)
        assert store.complete_indices("r") == {1: [], 2: [1], 3: [1, 2], 4: [1, 3]}[index]
        st._exchange.votes = [vote]
        st._exchange.run()
        opt.step()
    assert store.complete_indices("r") == [1, 3, 4] and store.get("r", 1).voted and not store.get("r", 4).voted
    live.fill_(5.0)
    _commit(st, store, 5)
    assert store.complete_indices("r") == [1, 4]
    st._exchange.run()
    assert store.complete_indices("r") == [5] and store.get("r", 5).voted


def test_a_late_vote_leaves_the_store_as_a_restore_made_it():
    """A stopping worker gave up on a commit's peer copy; the controller restored the
    snapshot before it, which dropped it as a rolled-back future. Its vote passing later
    must not take the restored snapshot out of the store or write into its buffers."""
    store = SnapshotStore(keep=2)
    st, live, _sess, _opt, _param, one, two = _voted_then_on_the_wire(store)
    buf = one.tensors["sharded"][0][0]
    store.drop_after("r", 1)  # the restore of snapshot 1
    st._exchange.run()  # the vote passes after all
    assert store.complete_indices("r") == [1] and store.get("r", 1) is one
    assert buf.tolist() == [1.0] * 6 and one.tensors["sharded"][0][0] is buf
    assert two.complete.is_set() and not two.voted and two.done.is_set()


def test_a_settle_during_the_vote_keeps_the_shards_that_landed():
    """The abort reaches a rank blocked in the vote (its peer died mid all-reduce, and
    other ranks may have passed it and dropped the older snapshot): what it received
    must count, or the shard it backs up is nowhere."""
    store = SnapshotStore(keep=2)
    st, _live, _sess, _opt, _param, _one, snap = _voted_then_on_the_wire(store)
    commit = st._pending
    st._exchange.votes = [lambda: (commit.settle(), False)[1]]  # settled while voting, then the vote fails
    st._exchange.run()
    assert snap.holding == (2, (0, 1)) and snap.tensors["sharded"][1][0].tolist() == [-2.0] * 6
    assert snap.settle is None and commit.sources == [] and commit.incoming == {}  # nothing of the attempt kept


def test_an_abort_settles_the_commit_and_unwinds_instead_of_stepping():
    store = SnapshotStore(keep=2)
    st, live, sess, opt, param, _one, snap = _voted_then_on_the_wire(store)  # its peer copy hangs: never run
    sess.aborted = True
    with pytest.raises(StopTraining):
        opt.step()
    assert param.tolist() == pytest.approx([-0.1])  # the step did not run (-0.2 if it had)
    assert store.complete_indices("r") == [1, 2]
    assert snap.tensors["sharded"][0][0].tolist() == [2.0] * 6 and snap.holding == (2, (0,))
    live.fill_(3.0)
    st._exchange.run()  # the peer copy ends after all: what landed whole is added
    assert snap.holding == (2, (0, 1)) and snap.tensors["sharded"][0][0].tolist() == [2.0] * 6
    assert snap.done.is_set() and snap.pins == 0


def test_a_stopping_worker_settles_a_lean_commit_instead_of_waiting_for_its_peer_copy():
    store = SnapshotStore(keep=2)
    st, live, _sess, _opt, _param = _lean(store)
    live.fill_(5.0)
    snap = _commit(st, store, 1)
    store.wait_pending(timeout_s=5.0, own_only=True)  # returns at once: settled
    assert snap.complete.is_set() and not snap.done.is_set()
    assert snap.tensors["sharded"][0][0].tolist() == [5.0] * 6 and snap.holding == (2, (0,))


def test_lean_snapshots_refuse_a_replicated_model_and_a_non_bool(monkeypatch):
    from raylastic import ElasticState
    from raylastic.errors import ConfigError

    with pytest.raises(ConfigError, match="lean_snapshots='yes'.*True, False or 'in_place'"):
        ElasticState(model=torch.nn.Linear(2, 2), lean_snapshots="yes")


def test_lean_snapshots_refuse_a_replicated_model():
    from raylastic._internal.snapshots.registry import Registry, tensor_half
    from raylastic.errors import ConfigError

    with pytest.raises(ConfigError, match="lean_snapshots=True\\) is for sharded models"):
        tensor_half(SimpleNamespace(), Registry({}), torch.nn.Linear(2, 2), None, None, True, True, lean=True)


# Two processes over a real gloo group: the lean exchange sends live tensors and votes;
# with the peer gone before it sends, the exchange and the vote fail in bounded time.
GLOO_EXCHANGE = r'''
import json, os, sys, time, datetime
import torch, torch.distributed as dist, torch.multiprocessing as mp
from raylastic._internal.snapshots.transport import PeerExchange, Transport

def proc(rank, out, die):
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
    ex = PeerExchange(Transport(None), [(0, 1), (1, 0)])
    live = [torch.full((1000,), float(rank + 1)), torch.arange(7.0) * (rank + 1)]
    incoming = {1 - rank: [torch.empty(1000), torch.empty(7)]}
    dist.barrier()  # both connected (a peer gone during the rendezvous fails the init instead)
    if die and rank == 1:
        os._exit(0)  # gone before its peer copy
    t0 = time.monotonic()
    sent, received, error = ex.exchange_all(live, incoming, index=3, stage_bytes=1024)
    try:
        agreed = ex.all_true(sent and received)
    except Exception as e:
        agreed = f"raised {type(e).__name__}"
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"sent": sent, "received": received, "error": error is not None, "agreed": agreed,
                   "s": time.monotonic() - t0, "got": [t.tolist() for t in incoming[1 - rank]] if received else None}, f)
    if not die:
        dist.destroy_process_group()
    os._exit(0)

if __name__ == "__main__":
    out, die = sys.argv[1], sys.argv[2] == "die"
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=proc, args=(r, out, die)) for r in range(2)]
    for p in ps: p.start()
    for p in ps: p.join(60)
    sys.exit(ps[0].exitcode)
'''


@pytest.mark.parametrize("die", [False, True])
def test_lean_exchange_over_gloo(tmp_path, die):
    import json
    import subprocess
    import sys

    script = tmp_path / "lean_exchange.py"
    script.write_text(GLOO_EXCHANGE)
    out = subprocess.run([sys.executable, str(script), str(tmp_path), "die" if die else "live"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    if not die:
        r1 = json.loads((tmp_path / "rank1.json").read_text())
        assert r0["agreed"] is True and r1["agreed"] is True
        assert r0["got"] == [[2.0] * 1000, [float(2 * i) for i in range(7)]]
        assert r1["got"] == [[1.0] * 1000, [float(i) for i in range(7)]]
    else:
        assert not (tmp_path / "rank1.json").exists()
        assert r0["received"] is False and r0["error"] and r0["agreed"] is not True, r0
        assert r0["s"] < 30, r0  # the connection closed: not the group timeout over again
