"""The worker group's stop calls: make members' train threads exit, and find out what a
member that does not exit was stuck in and what it reported last, before it is replaced.

Part of ``WorkerGroup`` (a mixin, so that ``group.py`` stays about forming, polling and
the drain view); it owns no state and uses the group's interruptible waits, so a stop
request cuts these calls short like every other wait of the group.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import ray
from ray.exceptions import RayActorError

from raylastic._internal.protocol import JOIN_TIMEOUT_S
from raylastic._internal.worker_group.membership import HungWorker, Interrupted, StopOutcome
from raylastic._internal.worker_group.pool import WorkerHandle
from raylastic._internal.worker_group.results import PollResult, StopAnswer

logger = logging.getLogger("raylastic")

# After an abort, the least time a worker gets to unwind (see ``stop``), and the bound on
# asking a worker about to be replaced for its last words.
ABORT_JOIN_MIN_S = 5.0


class StopCalls:
    """Mixed into ``WorkerGroup``; not used on its own."""

    if TYPE_CHECKING:
        # The group's waits these calls use (defined by WorkerGroup).
        def _wait(self, refs: List[Any], timeout_s: float) -> Tuple[List[Any], List[Any]]: ...
        def _get(self, ref: Any, timeout_s: float) -> Any: ...
        def _call_all(
            self,
            members: Sequence[WorkerHandle],
            call: Callable,
            timeout_s: float,
            args: Optional[Sequence[Any]] = None,
        ) -> List[Any]: ...

    def request_stop_at(self, members: Sequence[WorkerHandle], index: int) -> List[StopAnswer]:
        """Ask every member to stop right after report ``index``; ``MembersLost`` if some
        are gone."""
        return self._call_all(members, lambda m: m.actor.request_stop_at.remote(index), JOIN_TIMEOUT_S)

    def abort(self, members: Sequence[WorkerHandle], epoch: int) -> Dict[int, Any]:
        """Tell members to unwind the train function of ``epoch`` now (no waiting);
        returns each call's ref by wid (it answers how many connections were shut)."""
        refs = {}
        for m in members:
            try:
                refs[m.wid] = m.actor.abort.remote(epoch)
            except Exception:  # noqa: BLE001 - an actor already gone
                pass
        return refs

    def stop(self, members: Sequence[WorkerHandle], epoch: int, graceful: bool, abort_join_s: float) -> StopOutcome:
        """Make members' train threads exit: wait for them (``graceful``: they stop at
        an agreed report, within ``JOIN_TIMEOUT_S``), or abort them first and wait
        ``abort_join_s``. A member that does not exit is returned as hung, with where it
        was stuck and its last words, for the controller to rescue and replace."""
        if not members:
            return StopOutcome([], [])
        timeout_s, aborts = JOIN_TIMEOUT_S, {}
        if not graceful:
            aborts = self.abort(members, epoch)
            timeout_s = abort_join_s
        refs = {m.actor.join.remote(timeout_s): m for m in members}
        # The aborts too: a thread that stopped on its own can join before its abort
        # ran (actor calls run in a thread pool), and the next group must not form first.
        if aborts:
            self._wait(list(aborts.values()), timeout_s + 5)
        done, not_done = self._wait(list(refs), timeout_s + 5)
        stopped, hung = [], [(refs[ref], "did not answer") for ref in not_done]
        for ref in done:
            try:
                if ray.get(ref):
                    stopped.append(refs[ref])
                    continue
            except RayActorError:
                pass
            hung.append((refs[ref], "did not stop in time"))
        wheres = self._where_stuck([m for m, _why in hung], aborts)
        return StopOutcome(stopped, [HungWorker(m, why, wheres[m.wid], self._last_words(m)) for m, why in hung])

    def _where_stuck(self, hung: List[WorkerHandle], aborts: Dict[int, Any]) -> Dict[int, str]:
        """What workers about to be replaced were doing, for the event log: how many
        group connections each one's abort shut down, and its train thread's innermost
        frames. Asked of all at once, under one deadline."""
        stacks = {m.wid: m.actor.train_stack.remote() for m in hung}
        self._wait(list(stacks.values()), ABORT_JOIN_MIN_S)
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

    def _last_words(self, m: WorkerHandle) -> Optional[PollResult]:
        """The reports a worker about to be replaced made since the last poll (its
        actor answers; only its train thread is stuck), so its metrics and checkpoint
        records are not lost with it. The poll also refreshes what snapshots it holds.
        None if it does not answer."""
        try:
            last = self._get(m.actor.poll.remote(), ABORT_JOIN_MIN_S)
        except Interrupted:
            raise
        except Exception as e:  # noqa: BLE001 - a dead or unresponsive actor: nothing to save
            logger.debug("no last reports from rank %s: %s", m.prev_rank, e)
            return None
        m.update_holdings(last.holdings)
        return last
