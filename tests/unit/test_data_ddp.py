"""Two real gloo ranks: DDP + no_sync + micro weights give the single-process full-batch update.

G = 5 over 2 ranks splits 3/2; with micro_batch_size 2 rank 0 runs micro-batches (2, 1) and
rank 1 runs (2,), so the ranks also differ in micro-batch count: each must all-reduce exactly
once per step (no_sync on all but its last micro-batch) or the collectives would mismatch.
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import TensorDataset

from raylastic.data import ElasticDataLoader
from raylastic.testing.ports import free_port

N, GBS, MICRO, STEPS, LR = 20, 5, 2, 3, 0.1


def _setup():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(N, 1, generator=gen, dtype=torch.float64)
    torch.manual_seed(0)
    return TensorDataset(x, y), torch.nn.Linear(3, 1).double()


def _train(model, loader, steps):
    """The documented train loop; returns the parameters after ``steps`` optimizer steps."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    for _, batch in zip(range(steps), loader):
        opt.zero_grad()
        for (xb, yb), weight in batch.accumulate(model):
            (torch.nn.functional.mse_loss(model(xb), yb) * weight).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return grads


def _worker(rank, port, results):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        dataset, model = _setup()
        loader = ElasticDataLoader(dataset, global_batch_size=GBS, micro_batch_size=MICRO, seed=3)
        assert (loader.world_size, loader.rank) == (2, rank)  # read from torch.distributed
        grads = _train(DistributedDataParallel(model), loader, STEPS)
        # Plain lists: tensors would travel as shared-memory fds that die with this process.
        results.put((rank, [[g.tolist() for g in step] for step in grads], loader.state_dict()))
    finally:
        dist.destroy_process_group()


# Generous: in `make test` this runs at idle priority beside the Ray tests, and once spent
# over 60 s importing torch._dynamo there.
@pytest.mark.timeout(300)
def test_two_gloo_ranks_match_single_process_full_batch():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = mp.spawn(_worker, args=(free_port(), results), nprocs=2, join=False)
    replies = [results.get(timeout=240) for _ in range(2)]
    got = {rank: (grads, state) for rank, grads, state in replies}
    procs.join(timeout=60)

    dataset, model = _setup()
    single = ElasticDataLoader(dataset, global_batch_size=GBS, micro_batch_size=GBS, seed=3,
                               world_size=1, rank=0)
    expected = _train(model, single, STEPS)
    for rank in (0, 1):
        grads, state = got[rank]
        for step_grads, want in zip(grads, expected, strict=True):
            assert all(torch.allclose(torch.tensor(g, dtype=w.dtype), w)
                       for g, w in zip(step_grads, want)), rank
        assert state["step"] == STEPS
