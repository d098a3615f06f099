"""Collective waits in the train thread that an abort ends, where gloo's own does not.

``process_group.abort_group`` shuts the group's TCP connections down, and gloo fails the
operations waiting on them, except one kind: an operation whose sends were already handed
to the connection (gloo's ``tx_`` queue) or whose receive was being read. Its
``Pair::signalException`` wakes bound buffers and the unbound buffers still pending, not
those (gloo ``transport/tcp/pair.cc``), so ``work.wait()`` sleeps until the group's timeout.
That is the ring all-gather's rank before the lost one: its sends to the dead rank fill the
socket buffer and stay in ``tx_`` (FSDP2's and ZeRO-3's parameter all-gathers; seen in 3 of
13 sharded benchmark runs, the survivor replaced as hung 11-14 s after the loss, and
reproduced here without Ray by stopping then killing a rank mid all-gather). torch 2.13's
``ProcessGroupGloo`` has no abort that wakes it either.

So the train thread waits in slices (``Work.wait(timeout)`` raises "timed out" and leaves
the work as it was), and once its group has been aborted for ``ABANDON_AFTER_S`` it gives
the wait up (``WaitAbandoned``): the train function unwinds as from any aborted
collective, and the worker joins the next group instead of being replaced. The operation
itself stays in gloo's worker thread until the group's timeout ends it, so the aborted
epoch's groups are kept referenced until then: their destructor joins that thread, and
must not run in the train thread or in the next group's formation.

Only for plain gloo groups (NCCL has its own watchdog), only collectives (a point-to-point
wait with a timeout fails its group when it passes), only in a thread that asked
(``abandon_waits_on_abort``): raylastic's own side-group threads keep plain waits. Waits
inside C++ (DDP's reducer; gloo's reduce-scatter, a work that waits on its all-reduces in
C++ and takes no timeout) are not covered; the controller still replaces a rank that does
not unwind.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Tuple

import torch.distributed as dist

logger = logging.getLogger(__name__)
# How long after its group's abort a wait is given up: long enough for an operation the
# shutdown did fail to raise its own error first (milliseconds, measured).
ABANDON_AFTER_S = 0.5
_SLICE = datetime.timedelta(milliseconds=50)
_FOREVER = datetime.timedelta(0)  # torch's default: no timeout
_SLICE_ENDED = "Operation timed out!"  # c10d::Work::wait(timeout), the work left as it was
# c10d's OpType of the works waited in slices: collectives, whose gloo work is a plain
# c10d::Work (a timed-out wait leaves it as it was). Not SEND / RECV / RECVANYSOURCE (12-14),
# COALESCED (17) or UNKNOWN (100): gloo's point-to-point wait with a timeout fails the work,
# and every connection of its group, when the timeout passes.
_SLICED_OPS = frozenset({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 16, 18})

_local = threading.local()  # .on: this thread gives waits up after an abort
# (epoch, timeout_s) of the current gloo group, None when there is none (or NCCL)
_current: Optional[Tuple[int, float]] = None
_aborted: Tuple[Optional[int], float] = (None, 0.0)  # (epoch, monotonic time) of the last abort
_held: List[List[Any]] = []  # groups of aborted epochs, released once their timeout has passed
_lock = threading.Lock()
_torch_wait: Any = None


class WaitAbandoned(RuntimeError):
    """A collective wait given up because its group was aborted (a peer is gone)."""


def group_formed(epoch: int, backend: str, timeout_s: float) -> None:
    """The epoch's default group is formed: its collective waits become abortable in
    threads that asked. Forgets any earlier abort: a kept worker serves the next ``fit()``,
    whose epochs count from 1 again."""
    global _current, _aborted
    _aborted = (None, 0.0)
    if backend != "gloo":
        _current = None
        return
    _install()
    _current = (epoch, timeout_s)


def group_added(backend: str) -> None:
    """The train function created a group in the epoch: one not of plain gloo (an NCCL
    subgroup, whose wait with a timeout is not harmless) turns slicing off for the epoch."""
    global _current
    if backend != "gloo":
        _current = None


def group_left() -> None:
    """The epoch's groups are about to be destroyed: if the epoch was aborted, an operation
    may still be stuck in one of them (one the train thread never waited for, or a side
    group's), so every live group is held until the epoch's timeout has ended it."""
    global _current
    current, _current = _current, None
    if current is not None and _aborted[0] == current[0]:
        _hold(current)


def aborted(epoch: int) -> None:
    """``abort_group(epoch)`` ran: waits of that epoch end ``ABANDON_AFTER_S`` from now."""
    global _aborted
    _aborted = (epoch, time.monotonic())


@contextlib.contextmanager
def abandon_waits_on_abort() -> Iterator[None]:
    """In this thread (the train thread, for one attempt), a collective wait of a gloo
    group ends with ``WaitAbandoned`` once its group has been aborted."""
    before = getattr(_local, "on", False)
    _local.on = True
    try:
        yield
    finally:
        _local.on = before


def sliced_wait(work: Any, timeout: datetime.timedelta, original: Callable[[Any, datetime.timedelta], Any]) -> Any:
    """``work.wait(timeout)`` through torch's ``original``: in slices, given up after an
    abort, where this module applies; as torch waits everywhere else."""
    current = _current  # read once: the next formation may clear it meanwhile
    if timeout != _FOREVER or current is None or not getattr(_local, "on", False):
        return original(work, timeout)
    try:
        sliced = work._get_op_type() in _SLICED_OPS
    except Exception:  # noqa: BLE001 - a work of another kind: waited as torch waits
        sliced = False
    if not sliced:
        return original(work, timeout)
    while True:
        try:
            return original(work, _SLICE)
        except RuntimeError as e:
            if _SLICE_ENDED not in str(e):  # the operation's own error, or its own timeout
                raise
        epoch, at = _aborted
        if epoch == current[0] and time.monotonic() - at >= ABANDON_AFTER_S:
            logger.warning(
                "gave up a collective wait %.1f s after epoch %s's abort: gloo does not wake it",
                time.monotonic() - at,
                epoch,
            )
            raise WaitAbandoned(
                f"a collective wait of epoch {epoch}'s gloo group given up {ABANDON_AFTER_S} s after "
                "the group's abort (a peer is gone; gloo would wait out the group timeout)"
            )


def _install() -> None:
    global _torch_wait
    if _torch_wait is not None:
        return
    work = dist.distributed_c10d.Work
    _torch_wait = original = work.wait

    @functools.wraps(original)
    def wait(self: Any, timeout: datetime.timedelta = _FOREVER) -> Any:
        return sliced_wait(self, timeout, original)

    work.wait = wait  # type: ignore[method-assign]


def _hold(current: Tuple[int, float]) -> None:
    """Keep every live process group referenced until the aborted epoch's operations have
    timed out: their destructor joins gloo's threads, one of which may be stuck. (Until the
    epoch's groups are left, torch's own registry keeps them alive.)"""
    groups = list(dist.distributed_c10d._world.pg_map)
    if not groups:
        return
    with _lock:
        _held.append(groups)

    def release() -> None:
        with _lock:
            _held[:] = [h for h in _held if h is not groups]

    timer = threading.Timer(current[1] + 10.0, release)
    timer.daemon = True
    timer.start()
