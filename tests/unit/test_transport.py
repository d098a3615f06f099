"""``snapshots.transport.Transport`` over real gloo in 3 spawned ranks (no Ray): the one
interface the peer copies, the sharded restore and the replicated restore move tensors
through. Sends and receives pair up by (peer, tag) whatever order they are posted in; a
broadcast reaches every rank; small facts are gathered and shared; ``PeerExchange`` moves
each rank's shard to the rank that backs it up, over the side group, in its own thread."""

from __future__ import annotations

import datetime
import os
import threading

import torch
import torch.multiprocessing as mp

from raylastic.testing.ports import free_port

WORLD = 3


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from raylastic._internal.snapshots.transport import PeerExchange, Transport

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    seen = {}
    for name, tr in (("training", Transport.training()), ("side", Transport.side(30.0))):
        assert (tr.rank, tr.world, tr.device.type) == (rank, WORLD, "cpu")
        seen[f"{name}.gather"] = tr.gather({"rank": rank})
        seen[f"{name}.share"] = tr.share({"from": rank} if rank == 1 else None, 1)
        # a ring: two tagged tensors to the next rank, received in the other order
        nxt, prev = (rank + 1) % WORLD, (rank - 1) % WORLD
        a, b = torch.empty(4), torch.empty(2, 3)
        works = [tr.recv(b, prev, 8), tr.recv(a, prev, 7),
                 tr.send(torch.full((4,), float(rank)), nxt, 7),
                 tr.send(torch.full((3, 2), float(rank + 10)).t(), nxt, 8)]  # not contiguous
        tr.wait(works)
        seen[f"{name}.ring"] = [a.tolist(), b.flatten().tolist()]
        got = tr.broadcast(torch.arange(6.0).view(2, 3) if rank == 2 else None, torch.empty(2, 3, device="meta"), 2)
        seen[f"{name}.broadcast"] = got.tolist()
        tr.barrier()
    # PeerExchange: rank q holds its own shard and backs up shard q-1's
    side = Transport.side(30.0)
    ex = PeerExchange(side, side.gather((rank, (rank - 1) % WORLD)))
    src = (rank - 1) % WORLD
    assert ex.receivers() == [(rank + 1) % WORLD] and ex.sources() == [src]
    inbox = [torch.empty(5), torch.empty(0)]
    done = threading.Event()

    def job():
        ex.exchange([torch.full((5,), float(rank)), torch.empty(0)], {src: inbox}, index=4097)
        done.set()

    ex.submit(job)
    assert done.wait(30), "the peer exchange did not finish"
    assert threading.current_thread() is threading.main_thread()
    ex.close()
    seen["exchange"] = inbox[0].tolist()
    torch.save(seen, os.path.join(out, f"{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def test_send_recv_broadcast_gather_and_the_peer_exchange_over_gloo(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=WORLD)
    for rank in range(WORLD):
        seen = torch.load(tmp_path / f"{rank}.pt", weights_only=True)
        prev = (rank - 1) % WORLD
        for name in ("training", "side"):
            assert seen[f"{name}.gather"] == [{"rank": r} for r in range(WORLD)]
            assert seen[f"{name}.share"] == {"from": 1}
            assert seen[f"{name}.ring"] == [[float(prev)] * 4, [float(prev + 10)] * 6], (name, rank)
            assert seen[f"{name}.broadcast"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]
        assert seen["exchange"] == [float(prev)] * 5, rank
