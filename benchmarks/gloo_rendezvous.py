"""How long forming one gloo process group takes at N ranks on this machine, without Ray.

Why: docs/scaling.md found that re-forming the group after a node loss is dominated by
the process group's set-up once it has 32+ ranks (5.8 s at 48), and this separates that
from Ray and from the controller. N forked processes (torch imported once, before the fork)
each time, from a common start:

- ``init_group``: raylastic's own ``process_group.init_group`` (TCPStore client connect,
  ``init_process_group("gloo")``, the listener exchange the abort needs);
- ``plain``: ``init_process_group("gloo")`` with each rank's store client connected
  before the clock starts, and the first ``all_reduce``. Run it with
  ``TORCH_GLOO_LAZY_INIT=1`` to see lazy connection set-up move into the first collective.

Usage: python benchmarks/gloo_rendezvous.py init_group 8 24 48 64
       python benchmarks/gloo_rendezvous.py plain 32 40 48
Prints one JSON line per N (not saved: a diagnostic, quoted in docs/scaling.md).
"""

import datetime
import json
import multiprocessing as mp
import os
import socket
import sys
import time


def _init_group(rank, world, port_q, start, out):
    from raylastic._internal.distributed import process_group as pg

    if rank == 0:
        port = pg.host_store("127.0.0.1", world, 60)
        for _ in range(world - 1):
            port_q.put(port)
    else:
        port = port_q.get()
    start.wait()
    t0 = time.perf_counter()
    pg.init_group(epoch=1, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port,
                  backend="gloo", timeout_s=60, local_rank=rank, local_world_size=world)
    out.put((time.perf_counter() - t0, None))
    time.sleep(2)
    pg.destroy_group()


def _plain(rank, world, port, start, out):
    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    start.wait()
    t0 = time.perf_counter()
    dist.init_process_group("gloo", store=dist.PrefixStore("x", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    t1 = time.perf_counter()
    dist.all_reduce(torch.ones(1))
    out.put((t1 - t0, time.perf_counter() - t0))
    time.sleep(1)
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in ("init_group", "plain"):
        sys.exit(__doc__)
    import torch  # noqa: F401 - once, before forking

    ctx = mp.get_context("fork")
    for world in [int(x) for x in sys.argv[2:]]:
        start, out = ctx.Event(), ctx.Queue()
        if sys.argv[1] == "init_group":
            q = ctx.Queue()
            procs = [ctx.Process(target=_init_group, args=(r, world, q, start, out)) for r in range(world)]
        else:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            s.close()
            procs = [ctx.Process(target=_plain, args=(r, world, port, start, out)) for r in range(world)]
        for p in procs:
            p.start()
        time.sleep(3)  # every rank imported and (plain) connected to the store
        start.set()
        res = [out.get(timeout=120) for _ in range(world)]
        for p in procs:
            p.join(30)
        line = {"mode": sys.argv[1], "world": world, "lazy": os.environ.get("TORCH_GLOO_LAZY_INIT"),
                "init_max_s": round(max(r[0] for r in res), 3)}
        if res[0][1] is not None:
            line["init_plus_first_allreduce_max_s"] = round(max(r[1] for r in res), 3)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
