"""Assembling a striped snapshot over a real gloo process group (no Ray): two survivors
holding different stripes and one new worker holding nothing all end with the whole
state, bit for bit."""

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.timeout(120)


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.BatchNorm1d(48), torch.nn.Linear(48, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(8, 32)).sum().backward()
        opt.step()
    return model, opt


def _rank(rank, port, out_dir):
    import torch.distributed as dist

    from raylastic._internal.snapshots.capture import StateCopier, leaves
    from raylastic._internal.snapshots.placement import plan_stripes
    from raylastic._internal.snapshots.replicated import assemble

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    model, opt = _state()
    old = plan_stripes(["a", "b", "c"])  # the old group: 3 ranks; old rank 2 was lost
    if rank < 2:  # survivors: their stripe of snapshot 11
        holding = (3, old[rank])
        tensors, start = StateCopier(model, opt, overlap=False).copy(None, lambda _e: None, holding)
        start()
        plain = {"attrs": {"step": 11}}
    else:  # a worker that joined: holds nothing
        tensors, plain, holding = None, None, None
    full, got_plain = assemble(11, tensors, plain, holding)
    want, _ = StateCopier(model, opt, overlap=False).copy(None, lambda _e: None)
    ok = len(leaves(full)) == len(leaves(want)) and all(
        not a.is_meta and torch.equal(a, b) for a, b in zip(leaves(full), leaves(want)))
    fresh_model, fresh_opt = torch.nn.Sequential(
        torch.nn.Linear(32, 48), torch.nn.BatchNorm1d(48), torch.nn.Linear(48, 1)), None
    fresh_model.load_state_dict(full["model"])
    fresh_opt = torch.optim.Adam(fresh_model.parameters(), lr=0.01)
    fresh_opt.load_state_dict(full["optimizer"])
    with open(f"{out_dir}/rank{rank}", "w") as fh:
        fh.write(f"{ok} {got_plain['attrs']['step']}")
    dist.destroy_process_group()


def test_survivor_stripes_and_a_new_worker_assemble_the_whole_snapshot(tmp_path):
    from raylastic.testing.ports import free_port

    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=3, join=True)
    for r in range(3):
        assert (tmp_path / f"rank{r}").read_text() == "True 11", r


def _rank_mismatch(rank, port, out_dir):
    import torch.distributed as dist

    from raylastic._internal.snapshots.capture import StateCopier
    from raylastic._internal.snapshots.placement import plan_stripes
    from raylastic._internal.snapshots.replicated import assemble

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    width = 48 if rank != 1 else 40  # rank 1's copy is of another model: not a replica
    model = torch.nn.Linear(32, width)
    opt = torch.optim.Adam(model.parameters())
    holding = (3, plan_stripes(["a", "b", "c"])[rank])
    tensors, start = StateCopier(model, opt, overlap=False).copy(None, lambda _e: None, holding)
    start()
    try:
        assemble(5, tensors, {}, holding)
        outcome = "assembled"
    except RuntimeError as e:
        outcome = "differ" if "differ" in str(e) else f"other: {e}"
    with open(f"{out_dir}/rank{rank}", "w") as fh:
        fh.write(outcome)
    dist.destroy_process_group()


def test_copies_of_different_models_fail_on_every_rank_instead_of_hanging(tmp_path):
    from raylastic.testing.ports import free_port

    mp.spawn(_rank_mismatch, args=(free_port(), str(tmp_path)), nprocs=3, join=True)
    assert [(tmp_path / f"rank{r}").read_text() for r in range(3)] == ["differ"] * 3
