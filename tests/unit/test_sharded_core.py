"""The sharded-state core (``raylastic/_internal/snapshots/sharded/``): overlap arithmetic and
refusals (pure), and FSDP2 state re-partitioned 2 -> 3 over real gloo in spawned
processes (no Ray): from peer memory (``reshard_from_memory``) and from per-rank files
(``fill_from_files``), equal to an uninterrupted run."""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.multiprocessing as mp

from raylastic._internal.snapshots.sharded.layout import Chunk, check_fits, fill, hyper_params
from raylastic._internal.snapshots.sharded.reshard import fill_from_files

pytestmark = pytest.mark.timeout(300)


def _split(key, whole, world, dim=0):
    """(Chunk, tensor) pieces of ``whole`` cut along ``dim`` like FSDP2 (ceil-sized)."""
    n = whole.shape[dim]
    step = -(-n // world)
    out = []
    for r in range(world):
        lo, hi = min(r * step, n), min((r + 1) * step, n)
        offsets = tuple(lo if d == dim else 0 for d in range(whole.dim()))
        piece = whole.narrow(dim, lo, hi - lo)
        out.append((Chunk(key, tuple(whole.shape), offsets, tuple(piece.shape), str(whole.dtype)), piece.clone()))
    return out


@pytest.mark.parametrize("old,new,dim", [(2, 3, 0), (3, 2, 0), (3, 5, 1), (4, 1, 0)])
def test_fill_rebuilds_every_new_piece_from_the_old_ones(old, new, dim):
    whole = torch.arange(7 * 11, dtype=torch.float32).reshape(7, 11)
    pieces = _split("w", whole, old, dim)
    targets = _split("w", torch.zeros_like(whole), new, dim)
    check_fits([c for c, _ in pieces], [c for c, _ in targets])
    for c, t in targets:
        assert fill(c, t, pieces) == c.numel()
    rebuilt = torch.cat([t for _, t in targets], dim=dim)
    assert torch.equal(rebuilt, whole)


def test_replicated_pieces_and_scalars():
    whole = torch.randn(5)
    pieces = [(Chunk("b", (5,), (0,), (5,), "torch.float32"), whole)] * 3  # every old rank holds it
    c, t = Chunk("b", (5,), (0,), (5,), "torch.float32"), torch.zeros(5)
    check_fits([p for p, _ in pieces], [c])
    fill_from_files([(c, t)], {s: {"chunks": [pieces[s][0].as_tuple()], "tensors": [whole]} for s in range(3)})
    assert torch.equal(t, whole)
    s_chunk = Chunk("step", (), (), (), "torch.float32")
    target = torch.zeros(())
    assert fill(s_chunk, target, [(s_chunk, torch.tensor(7.0))]) == 1 and target.item() == 7.0


@pytest.mark.parametrize("change,reason", [
    (lambda c: Chunk("other", c.global_shape, c.offsets, c.sizes, c.dtype), "missing"),
    (lambda c: Chunk(c.key, (8, 11), c.offsets, c.sizes, c.dtype), "global shape"),
    (lambda c: Chunk(c.key, c.global_shape, c.offsets, c.sizes, "torch.bfloat16"), "mixed-precision"),
])
def test_state_that_does_not_fit_is_refused_with_the_reason(change, reason):
    pieces = _split("w", torch.zeros(7, 11), 2)
    targets = [(change(c), t) for c, t in _split("w", torch.zeros(7, 11), 3)]
    with pytest.raises(ValueError, match=reason):
        check_fits([c for c, _ in pieces], [c for c, _ in targets])


def test_hyper_parameters_are_copied_out_of_the_live_param_group():
    """A tensor lr is updated in place by LR schedulers: the snapshot's must not follow."""
    lr = torch.tensor(0.1)
    saved = hyper_params({"params": [torch.zeros(2)], "lr": lr, "betas": (0.9, 0.99)})
    lr.mul_(0.5)
    assert set(saved) == {"lr", "betas"} and saved["betas"] == (0.9, 0.99)
    assert float(saved["lr"]) == pytest.approx(0.1)
    live = {"params": [], "lr": torch.tensor(1.0)}
    live.update(hyper_params(saved))  # a restore: the live value is not the snapshot's tensor
    live["lr"].mul_(0.5)
    assert float(saved["lr"]) == pytest.approx(0.1)


def test_pieces_that_do_not_cover_a_new_piece_are_refused():
    pieces = _split("w", torch.zeros(7, 11), 2)[:1]  # rank 1's shard is missing
    targets = _split("w", torch.zeros(7, 11), 3)
    with pytest.raises(ValueError, match="cover"):
        check_fits([c for c, _ in pieces], [c for c, _ in targets])


def test_a_rank_without_a_piece_of_some_tensor_restores_from_files_checked_against_the_group():
    """ZeRO-3 at 2 ranks gives rank 1 no piece of a 1-element bias: its own targets lack
    the key the checkpoint has. Checked against the whole group's pieces (what the
    storage restore gathers) it loads; checked against its own alone it was refused
    ("unexpected ..."), which failed a 51.6M ZeRO-3 run resumed from storage at 3 -> 2."""
    w, b = torch.arange(12, dtype=torch.float32), torch.tensor([5.0])
    files = {s: {"chunks": [c.as_tuple() for c, _ in ws] + [c.as_tuple() for c, _ in bs],
                 "tensors": [t for _, t in ws] + [t for _, t in bs]}
             for s, (ws, bs) in enumerate(zip(([p] for p in _split("w", w, 3)), ([p] for p in _split("b", b, 3))))}
    group = _split("w", torch.zeros(12), 2) + [_split("b", torch.zeros(1), 2)[0]]  # rank 1: no piece of b
    rank1 = [_split("w", torch.zeros(12), 2)[1]]
    with pytest.raises(ValueError, match="unexpected"):
        fill_from_files(rank1, files)
    fill_from_files(rank1, files, everyone=[c for c, _ in group])
    assert torch.equal(rank1[0][1], w[6:])
    with pytest.raises(ValueError, match="missing"):  # a tensor the checkpoint lacks is still refused
        fill_from_files(rank1, files, everyone=[c for c, _ in group] + [Chunk("c", (1,), (0,), (1,), "torch.float32")])


# -- FSDP2 over gloo ---------------------------------------------------------------------------
G = 48


def _build():
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(m)
    return m, torch.optim.Adam(m.parameters(), lr=1e-2)


def _step(m, opt, i, world, rank):
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(G, 8, generator=g), torch.randn(G, 5, generator=g)
    xs, ys = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
    (torch.nn.functional.mse_loss(m(xs), ys) * len(xs) * world / G).backward()
    opt.step()
    opt.zero_grad()


def _worker(rank, world, port, phases, d):
    """Runs ``phases`` one after the other in one process group of ``world`` ranks: a
    spawn (fresh interpreters importing torch) costs seconds, a phase a fraction of one.
    Each phase builds its own model and optimizer from the same seed."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    for phase in phases:
        _phase(rank, world, phase, d)
        dist.barrier()
    dist.destroy_process_group()


def _phase(rank, world, phase, d):
    from raylastic._internal.snapshots.sharded.fsdp2 import FSDP2Adapter
    from raylastic._internal.snapshots.sharded.layout import Chunk
    from raylastic._internal.snapshots.sharded.reshard import fill_from_files, reshard_from_memory
    from raylastic._internal.snapshots.transport import Transport
    m, opt = _build()
    ad = FSDP2Adapter(m, opt)
    if phase == "target_error":  # rank 1 cannot make its targets: every rank raises, none waits
        old = {s: torch.load(f"{d}/r{s}.pt", weights_only=True) for s in range(2)}
        layout = {s: [Chunk.of(c) for c in old[s]["chunks"]] for s in old}
        held = {s: old[s]["tensors"] for s in old if rank == 2}

        def targets_or_fail(saved):
            if rank == 1:
                raise MemoryError("no room")
            return ad.restore_targets(saved)

        try:
            reshard_from_memory(Transport.training(), targets_or_fail, layout if held else None, held,
                                old[0]["plain"] if held else None)
        except MemoryError:
            assert rank == 1
        except RuntimeError as e:
            assert rank != 1 and "rank 1: MemoryError: no room" in str(e), e
        else:
            raise AssertionError(f"rank {rank} went on")
        return
    if phase == "save":  # 2 ranks, 3 steps: every rank keeps its pieces
        for i in range(3):
            _step(m, opt, i, world, rank)
        torch.save({"chunks": [c.as_tuple() for c, _ in ad.live_chunks()],
                    "tensors": [t.clone() for _, t in ad.live_chunks()], "plain": ad.plain()}, f"{d}/r{rank}.pt")
    elif phase in ("memory", "files"):  # 3 ranks restore, 3 more steps
        old = {s: torch.load(f"{d}/r{s}.pt", weights_only=True) for s in range(2)}
        layout = {s: [Chunk.of(c) for c in old[s]["chunks"]] for s in old}
        held = {s: old[s]["tensors"] for s in old if phase == "memory" and ((rank == 1 and s == 1) or (rank == 2 and s in (0, 1)))}
        made = []

        def targets_for(saved):
            # Told the saved layout (every rank is, rank 0 in "memory" holding nothing
            # too), the moments are made empty, one per saved key; not told, by a
            # zero-gradient step, which leaves a "step" behind.
            out = ad.restore_targets(saved if rank != 1 or phase != "files" else None)
            made.extend(sorted(opt.state[p]) for p in m.parameters())
            return out

        if phase == "memory":  # old shard s held by new rank s; rank 2 holds a copy of shard 1, rank 0 none
            class Counting(Transport):
                received = 0

                def recv(self, buf, src, tag):
                    self.received += buf.numel()
                    return super().recv(buf, src, tag)

            transport = Counting.training()
            plain = reshard_from_memory(transport, targets_for, layout if held else None, held,
                                          old[0]["plain"] if held else None)
            # What moves is what a rank lacks, and only the box of each old piece it needs:
            # rank 2 holds both old shards; rank 0 holds none and gets exactly its pieces
            # (a third of each parameter and moment, and the step counters), not the half
            # of each that old shard 0 holds.
            want = sum(c.numel() for c, _t in ad.live_chunks())
            assert transport.received == {0: want, 2: 0}.get(rank, transport.received), (rank, transport.received, want)
            assert rank != 1 or 0 < transport.received < want, (transport.received, want)
        else:
            fill_from_files(targets_for([c for cs in layout.values() for c in cs]), old)
            plain = old[0]["plain"]
        stepped = rank == 1 and phase == "files"
        assert made == [["exp_avg", "exp_avg_sq", "step"] if stepped else ["exp_avg", "exp_avg_sq"]] * 4, made
        ad.finish_restore(plain)
        for i in range(3, 6):
            _step(m, opt, i, world, rank)
        # Adam counts its steps in place: the restored counters are copies, and the saved
        # state (an in-memory snapshot may serve another restore) still says 3.
        saved_steps = [float(v["step"]) for v in plain["scalars"].values()]
        assert saved_steps == [3.0] * 4 and [float(opt.state[p]["step"]) for p in m.parameters()] == [6.0] * 4
    else:  # uninterrupted, 2 ranks, 6 steps
        for i in range(6):
            _step(m, opt, i, world, rank)
    full = {k: v.full_tensor().detach().clone() for k, v in m.state_dict().items()}
    if rank == 0 and phase != "save":
        torch.save(full, f"{d}/{phase}.pt")


def test_fsdp2_state_resumes_at_another_world_size_from_memory_and_from_files(tmp_path):
    d = str(tmp_path)
    # Two spawns (one per world size), not one per phase: "fixed" is independent of "save",
    # and "memory" and "files" each restore from save's files on their own fresh model.
    mp.spawn(_worker, args=(2, 29701, ("save", "fixed"), d), nprocs=2)
    mp.spawn(_worker, args=(3, 29702, ("memory", "files", "target_error"), d), nprocs=3)
    fixed = torch.load(f"{d}/fixed.pt")
    for phase in ("memory", "files"):
        got = torch.load(f"{d}/{phase}.pt")
        rel = max(((got[k] - fixed[k]).abs().max() / fixed[k].abs().max()).item() for k in fixed)
        assert rel <= 1e-5, (phase, rel)
