"""DeepSpeed ZeRO-1/2/3 state re-partitioned at another world size by ``DeepSpeedAdapter``
(``raylastic/_internal/sharded_deepspeed.py``), with real engines over gloo in spawned
processes (no Ray).

A fixed-size run at 2 ranks trains 9 steps of a fixed 12-sample global batch and keeps
every rank's pieces after step 3. Three fresh ranks restore from those pieces with the
core's own ``check_fits`` / ``fill``, train steps 3-5 and must match the 2-rank run at
step 6; they keep their pieces, re-form the group with 2 of them in the same processes
(as raylastic does after a node loss: destroy, re-create, a new ``deepspeed.initialize``)
and restore again: steps 6-8 must match the 2-rank run at step 9. Max relative weight
difference <= 1e-5 (fp32). One spawn per world size; all stages run in each.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any, Dict, List

import pytest
import torch
import torch.multiprocessing as mp

deepspeed = pytest.importorskip("deepspeed")

pytestmark = pytest.mark.timeout(300)

STAGES = (1, 2, 3)
G = 12  # global batch: 6 per rank at 2 ranks, 4 at 3
TOL = 1e-5


# -- what every rank runs ------------------------------------------------------------------------
def _model(hidden: int = 16) -> torch.nn.Module:
    torch.manual_seed(0)
    # 8*hidden+hidden+hidden*3+3 elements: partitions cut through the parameters at 2 and 3 ranks
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 3))


def _engine(stage: int, world: int, hidden: int = 16):
    cfg = {"train_micro_batch_size_per_gpu": G // world, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "weight_decay": 0.01, "torch_adam": True}},
           "zero_optimization": {"stage": stage,
                                 # ZeRO-3: keep every parameter partitioned (the default keeps small ones whole)
                                 "stage3_param_persistence_threshold": 0},
           "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=_model(hidden), config=cfg)
    return engine


def _train(engine, step: int, rank: int, world: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(G, 8, generator=g), torch.randn(G, 3, generator=g)
    loss = torch.nn.functional.mse_loss(engine(x.tensor_split(world)[rank]), y.tensor_split(world)[rank])
    engine.backward(loss)
    engine.step()


def _full(engine) -> Dict[str, torch.Tensor]:
    """Every parameter's whole fp32 master weight (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _snapshot(engine) -> Dict[str, Any]:
    """What the core keeps of a rank: copies of its live pieces and the plain state."""
    from raylastic._internal.sharded_deepspeed import DeepSpeedAdapter
    adapter = DeepSpeedAdapter(engine)
    return {"pieces": [(c.as_tuple(), t.detach().clone()) for c, t in adapter.live_chunks()],
            "plain": adapter.plain()}


def _restore(engine, shards: List[Dict[str, Any]]) -> None:
    """The core's restore from every old rank's pieces (all held here): targets, then
    ``check_fits`` over every new rank's targets, ``fill``, ``finish_restore``."""
    import torch.distributed as dist

    from raylastic._internal.sharded import Chunk, check_fits, fill
    from raylastic._internal.sharded_deepspeed import DeepSpeedAdapter
    adapter = DeepSpeedAdapter(engine)
    old = [(Chunk.of(c), t) for s in shards for c, t in s["pieces"]]
    targets = adapter.restore_targets()
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [c.as_tuple() for c, _t in targets])
    check_fits([c for c, _t in old], [Chunk.of(c) for e in everyone for c in e])
    for c, t in targets:
        assert fill(c, t, old) == c.numel(), c
    adapter.finish_restore(shards[0]["plain"])


def _reshard(engine, shards: List[Dict[str, Any]], held: List[int]) -> None:
    """The core's peer-memory restore: this rank holds old shards ``held`` only; the
    others come over the group from their holders (``reshard_from_memory``)."""
    import torch.distributed as dist

    from raylastic._internal.sharded import Chunk, reshard_from_memory
    from raylastic._internal.sharded_deepspeed import DeepSpeedAdapter
    adapter = DeepSpeedAdapter(engine)
    layout = {s: [Chunk.of(c) for c, _t in sh["pieces"]] for s, sh in enumerate(shards)}
    mine = {s: [t for _c, t in shards[s]["pieces"]] for s in held}
    plain = reshard_from_memory(dist.group.WORLD, adapter.restore_targets(), layout, mine, shards[0]["plain"])
    adapter.finish_restore(plain)


def _rel(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


def _init(port: int, rank: int, world: int) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _quiet() -> None:
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    deepspeed.utils.logger.setLevel(logging.WARNING)


def _fixed_run(rank: int, port: int, out: str) -> None:
    """World 2, uninterrupted: pieces after step 3, reference weights at steps 6 and 9."""
    import torch.distributed as dist
    _quiet()
    _init(port, rank, 2)
    for stage in STAGES:
        engine = _engine(stage, 2)
        rec: Dict[str, Any] = {}
        for step in range(9):
            if step == 3:
                rec["snap"] = _snapshot(engine)
            if step == 6:
                rec["ref6"] = _full(engine)
            _train(engine, step, rank, 2)
        rec["ref9"] = _full(engine)
        torch.save(rec, os.path.join(out, f"fixed-s{stage}-r{rank}.pt"))
    dist.destroy_process_group()


def _elastic_run(rank: int, ports: tuple, out: str) -> None:
    """2 -> 3 (restore, 3 steps), then 3 -> 2 in the same processes (restore, 3 steps)."""
    import torch.distributed as dist

    from raylastic._internal.sharded_deepspeed import release_deepspeed_groups
    _quiet()
    fixed = {s: [torch.load(os.path.join(out, f"fixed-s{s}-r{r}.pt"), weights_only=False) for r in range(2)]
             for s in STAGES}
    res: Dict[str, Any] = {"diff6": {}, "diff9": {}, "mismatch": {}}
    _init(ports[0], rank, 3)
    snaps3 = {}
    for stage in STAGES:
        engine = _engine(stage, 3)
        _restore(engine, [f["snap"] for f in fixed[stage]])
        for step in range(3, 6):
            _train(engine, step, rank, 3)
        res["diff6"][stage] = _rel(fixed[stage][0]["ref6"], _full(engine))
        everyone: List[Any] = [None] * 3
        dist.all_gather_object(everyone, _snapshot(engine))  # each rank keeps every shard (small model)
        snaps3[stage] = everyone
        if stage == 2:
            res["mismatch"] = _mismatches(engine, fixed)
        del engine
    # a node loss: the group is destroyed and re-formed with 2 ranks in the same processes
    dist.destroy_process_group()
    release_deepspeed_groups()
    if rank < 2:
        _init(ports[1], rank, 2)
        for stage in STAGES:
            engine = _engine(stage, 2)
            # rank 2's node is gone: rank 0 holds its shard (its peer copy), as plan_stripes would
            _reshard(engine, snaps3[stage], held=[rank] + ([2] if rank == 0 else []))
            for step in range(6, 9):
                _train(engine, step, rank, 2)
            res["diff9"][stage] = _rel(fixed[stage][0]["ref9"], _full(engine))
            del engine
        dist.destroy_process_group()
    torch.save(res, os.path.join(out, f"elastic-r{rank}.pt"))


def _mismatches(engine2, fixed) -> Dict[str, str]:
    """Another stage, another architecture and a stage-0 engine are refused with the reason."""
    import torch.distributed as dist

    from raylastic._internal.sharded import Chunk, check_fits
    from raylastic._internal.sharded_deepspeed import DeepSpeedAdapter
    out = {}
    try:  # a ZeRO-1 snapshot into this ZeRO-2 engine
        DeepSpeedAdapter(engine2).finish_restore(fixed[1][0]["snap"]["plain"])
        out["stage"] = "accepted"
    except ValueError as e:
        out["stage"] = str(e)
    wide = _engine(2, 3, hidden=20)
    adapter = DeepSpeedAdapter(wide)
    old = [Chunk.of(c) for f in fixed[2] for c, _t in f["snap"]["pieces"]]
    everyone: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [c.as_tuple() for c, _t in adapter.restore_targets()])
    try:
        check_fits(old, [Chunk.of(c) for e in everyone for c in e])
        out["arch_pieces"] = "accepted"
    except ValueError as e:
        out["arch_pieces"] = str(e)
    try:
        adapter.finish_restore(fixed[2][0]["snap"]["plain"])
        out["arch_plain"] = "accepted"
    except ValueError as e:
        out["arch_plain"] = str(e)
    try:  # no ZeRO: a replicated model, not sharded state
        DeepSpeedAdapter(_engine(0, 3))
        out["stage0"] = "accepted"
    except ValueError as e:
        out["stage0"] = str(e)
    return out


# -- the tests -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from raylastic.testing.ports import free_port
    out = str(tmp_path_factory.mktemp("zero"))
    mp.spawn(_fixed_run, args=(free_port(), out), nprocs=2, join=True)
    mp.spawn(_elastic_run, args=((free_port(), free_port()), out), nprocs=3, join=True)
    return [torch.load(os.path.join(out, f"elastic-r{r}.pt"), weights_only=False) for r in range(3)]


@pytest.mark.parametrize("stage", STAGES)
def test_zero_state_resumes_at_another_world_size(results, stage):
    d6, d9 = results[0]["diff6"][stage], results[0]["diff9"][stage]
    print(f"ZeRO-{stage}: max relative weight difference 2->3: {d6:.2e}, 3->2: {d9:.2e}")
    assert d6 <= TOL, f"ZeRO-{stage} restored 2 -> 3 differs from the fixed run by {d6:.2e}"
    assert d9 <= TOL, f"ZeRO-{stage} restored 3 -> 2 differs from the fixed run by {d9:.2e}"
    assert results[1]["diff9"][stage] == d9  # the same full weights on every rank


def test_state_of_another_stage_or_architecture_is_refused_with_the_reason(results):
    for rank in range(3):
        m = results[rank]["mismatch"]
        assert "ZeRO stage 1" in m["stage"] and "stage 2" in m["stage"], m["stage"]
        assert "global shape" in m["arch_pieces"], m["arch_pieces"]
        assert "another architecture" in m["arch_plain"], m["arch_plain"]
        assert "ZeRO stage 1, 2 or 3" in m["stage0"], m["stage0"]

