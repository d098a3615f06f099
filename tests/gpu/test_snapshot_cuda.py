"""The CUDA snapshot path: device-to-host copies on a side stream into pinned buffers,
overlapped with the next step, the optimizer's stream waiting on their event. Skipped
without a CUDA device (marker: gpu); CI has none."""

import threading

import pytest
import torch

from raylastic._internal.snapshots.capture import StateCopier, copy_into

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_overlapped_cuda_snapshot_holds_the_state_at_commit():
    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.BatchNorm1d(1024),
                                torch.nn.Linear(1024, 1)).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def step(i):
        x = torch.randn(64, 256, device=dev, generator=torch.Generator(device=dev).manual_seed(i))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    copier = StateCopier(model, opt, overlap=True)
    step(0)
    expected = copy_into(None, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    done, finished = [], threading.Event()
    tensors, start = copier.copy(None, lambda err: (done.append(err), finished.set()))
    start()
    for i in range(1, 5):
        step(i)
    copier.wait()
    torch.cuda.synchronize()
    for name, t in expected["model"].items():
        assert tensors["model"][name].device.type == "cpu"
        assert torch.equal(tensors["model"][name], t), name
    assert tensors["model"]["0.weight"].is_pinned()
    for pid, st in expected["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(tensors["optimizer"]["state"][pid][k], v), (pid, k)
    assert finished.wait(30) and done == [None]
