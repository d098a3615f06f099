"""Moments of a run that code attached to it (not the controller's own) is told about.

Why: a front end can need to run its users' code at points only the controller sees: a
group formed, every rank reported an index, ranks failed, a group ended.
``raylastic.TorchTrainer`` runs Ray Train's ``Backend`` hooks and ``UserCallback``s there
(``raylastic/_internal/ray_train_hooks.py``). The controller calls a :class:`RunHooks`
at each; this base does nothing, so a run without hooks pays nothing, and the controller
stays free of Ray Train.

Contract for implementations (the controller relies on it):

- ``group_started`` runs after the members joined the process group of ``epoch`` and
  before the train function is entered; raising ``MembersLost`` makes the loss an
  ordinary one (the first poll finds those members gone), any other exception ends the
  run with it (a ``TrainingFailedError`` as is, anything else as a controller crash);
- ``records`` gets every batch of report records the controller takes, with the
  checkpoints those records committed;
- ``failed`` gets the per-rank failures of one attempt, before the failure policy decides;
- ``group_ended`` runs once per started group, when it stopped (finished, failed, resized
  or the run ended) and before its workers are released; it never raises: it returns
  the error that must end the run, or None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional

if TYPE_CHECKING:
    from raylastic.checkpoint.manager import CommittedCheckpoint
    from raylastic._internal.worker_group.pool import WorkerHandle
    from raylastic.errors import RankFailure
    from raylastic._internal.protocol import ReportRecord


class RunHooks:
    """No hooks: what a run gets unless its front end attaches some."""

    def group_started(self, members: "List[WorkerHandle]", epoch: int) -> None:
        """The group of ``epoch`` is formed (members in rank order); training is next."""

    def records(self, records: "List[ReportRecord]", committed: "List[CommittedCheckpoint]") -> None:
        """Report records taken from one worker's poll, and what they committed."""

    def failed(self, failures: "List[RankFailure]") -> None:
        """Ranks failed (raised, crashed or were lost) in the current group."""

    def group_ended(self) -> Optional[BaseException]:
        """The current group stopped; the error that must end the run, or None."""
        return None
