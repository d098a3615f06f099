"""Workers that do not unwind after an abort: which ones to replace early, and what to
say of them.

Why early: after an abort (a peer lost), a rank that is computing unwinds at its next
report, within about a step, and one blocked in a gloo collective at once, because the
abort shuts the group's connections (``process_group.abort_group``). So the controller
waits max(5 s, 3 steps) before it replaces a rank that is still running. But a rank
still inside a ``torch.distributed`` (or DeepSpeed) wait a few seconds after its gloo
abort will not come back before the group timeout: the abort could not reach that
operation (a group gloo joined lazily or that raylastic does not track, or the case
seen on 2026-12-07 in 3 of 13 runs of the sharded benchmark, a survivor left in FSDP2's
or DeepSpeed's all-gather after its abort). Waiting the 3 steps out for it cost 11-14 s
there. Only gloo: an NCCL rank unwinds when NCCL notices the broken connection, which
can take longer than this and is not a hang.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Dict, List, Sequence, Tuple

import ray

logger = logging.getLogger("raylastic")

# How long after its abort returned a gloo rank may still be in a collective wait.
COLLECTIVE_AFTER_ABORT_S = 3.0

_FRAME = re.compile(r'File "([^"]+)", line \d+, in [^\n]*\n\s*([^\n]*)')


def in_collective_wait(stack: str) -> bool:
    """Whether a train thread's innermost frames (``TrainWorker.train_stack``) wait on
    a collective: a ``.wait`` in ``torch/distributed/`` or ``deepspeed/`` code among its
    two innermost frames (torch's ``work.wait()``, DeepSpeed's
    ``allgather_handle.wait`` under its NVTX wrapper)."""
    frames = _FRAME.findall(stack)[-2:]
    return any(("torch/distributed/" in path or "/deepspeed/" in path) and ".wait" in code
               for path, code in frames)


def stuck_in_collectives(joins: Dict[Any, Any], wait: Callable[[List[Any], float], Tuple[List[Any], List[Any]]],
                         budget_s: float) -> List[Any]:
    """Members (values of ``joins``: join ref -> member) whose train thread is still in
    a collective wait ``COLLECTIVE_AFTER_ABORT_S`` after their gloo abort; none when the
    join budget is no longer than that. ``wait``: the group's interruptible ``ray.wait``."""
    if budget_s <= COLLECTIVE_AFTER_ABORT_S:
        return []
    _done, pending = wait(list(joins), COLLECTIVE_AFTER_ABORT_S)
    if not pending:
        return []
    stacks = {ref: joins[ref].actor.train_stack.remote() for ref in pending}
    wait(list(stacks.values()), 2.0)
    out = []
    for ref, stack_ref in stacks.items():
        try:
            stack = ray.get(stack_ref, timeout=0.1)
        except Exception:  # noqa: BLE001 - no answer: left to the join timeout
            continue
        if in_collective_wait(stack):
            out.append(joins[ref])
    return out


def describe(hung: Sequence[Any], aborts: Dict[int, Any], stacks: Dict[int, Any]) -> Dict[int, str]:
    """What workers about to be replaced were doing, for the event log: how many group
    connections each one's abort shut down, and its train thread's innermost frames
    (``aborts`` and ``stacks``: refs by worker id, already waited for)."""
    out = {}
    for m in hung:
        parts = []
        for label, ref in (("abort shut {} group connection(s)", aborts.get(m.wid)), ("{}", stacks[m.wid])):
            if ref is None:
                continue
            try:
                parts.append(label.format(ray.get(ref, timeout=0.1)))
            except Exception as e:  # noqa: BLE001 - an actor that does not answer: say so
                parts.append(f"no answer ({type(e).__name__})")
        out[m.wid] = "\n".join(p for p in parts if p)
        logger.warning("replacing rank %s, which did not unwind: %s", m.prev_rank, out[m.wid])
    return out


__all__ = ["COLLECTIVE_AFTER_ABORT_S", "in_collective_wait", "stuck_in_collectives", "describe"]
