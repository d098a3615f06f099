"""Adapters between Lightning, raylastic and ``ElasticState`` for an elastic Lightning fit.

Each class here puts one interface behind another, with no say in how the run goes: the
elastic loader behind Lightning's train "dataloader" (:class:`ElasticBatches`), the
raylastic context behind Lightning's cluster environment (:class:`ElasticEnvironment`),
and the data position and Lightning's LR schedulers behind the ``state_dict`` /
``load_state_dict`` objects ``ElasticState`` saves (``_Position``, ``_Schedulers``).
Why apart from :mod:`raylastic.integrations.lightning`: that module holds what decides
(``prepare_trainer``, the strategy, the shared ``_ElasticRun``, the commit callback), and
the split keeps each within its size. The public names are re-exported from there,
where users import them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional

from lightning.fabric.plugins.environments import LightningEnvironment

from raylastic import session as _session
from raylastic.data import ElasticDataLoader

__all__ = ["ElasticBatches", "ElasticEnvironment"]


class ElasticBatches:
    """The train "dataloader" Lightning iterates: this rank's micro-batches, step by step.

    Each ``iter()`` starts from :attr:`position` (the loader position after the last
    *trained* optimizer step), not from where the inner loader's iterator got to: Lightning
    calls ``iter()`` more than once per epoch and fetches ahead, so only the callback knows
    which micro-batches were trained. ``len()`` is a whole epoch at this world size; a
    resumed epoch yields its remainder, and Lightning's batch index starts at the
    remainder's offset (``set_loop_counters``).
    """

    def __init__(self, loader: ElasticDataLoader, accumulate: int, epoch_of: Callable[[], int]):
        self.loader = loader
        self.accumulate = accumulate
        self.position: Optional[Dict[str, Any]] = None
        self._epoch_of = epoch_of
        self._after: Dict[int, Dict[str, Any]] = {}  # batch index -> position after its step

    def __len__(self) -> int:
        return len(self.loader) * self.accumulate

    def __iter__(self) -> Iterator[Any]:
        if self.position:
            self.loader.load_state_dict(self.position)
        self.loader.set_epoch(self._epoch_of())
        return self._batches(self.loader.state_dict()["step"] * self.accumulate)

    def _batches(self, first: int) -> Iterator[Any]:
        self._after = {}
        index = first
        for step in self.loader:
            if len(step.micro_batches) != self.accumulate:
                raise RuntimeError(
                    f"step {step.step} has {len(step.micro_batches)} micro-batches on rank "
                    f"{step.rank}, expected {self.accumulate}"
                )
            after = self.loader.state_dict()
            for micro in step.micro_batches:
                self._after[index] = after
                index += 1
                yield micro

    def trained(self, batch_idx: int) -> Dict[str, Any]:
        """Record that the optimizer step ending with micro-batch ``batch_idx`` was taken."""
        if batch_idx not in self._after:
            raise RuntimeError(
                f"batch {batch_idx} was not yielded by this epoch's iterator "
                f"(have {min(self._after, default=None)}..{max(self._after, default=None)})"
            )
        self.position = self._after[batch_idx]
        for old in [k for k in self._after if k <= batch_idx]:
            del self._after[old]
        return self.position

    # Lightning treats loaders with state_dict/load_state_dict as resumable (no warning).
    def state_dict(self) -> Dict[str, Any]:
        return dict(self.position or {})

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.position = dict(state) or None


class _Position:
    """What ``ElasticState(loader=...)`` saves: the data position after the last step."""

    def __init__(self) -> None:
        self.value: Optional[Dict[str, Any]] = None

    def state_dict(self) -> Dict[str, Any]:
        return dict(self.value or {})

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.value = dict(state) or None


class _Schedulers:
    """Lightning's LR schedulers as one object for ``ElasticState(lr_scheduler=...)``."""

    def __init__(self, schedulers: List[Any]):
        self._schedulers = schedulers

    def state_dict(self) -> Dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self._schedulers]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        saved = state["schedulers"]
        if len(saved) != len(self._schedulers):
            raise ValueError(f"{len(saved)} LR schedulers saved, {len(self._schedulers)} configured")
        for scheduler, sd in zip(self._schedulers, saved):
            scheduler.load_state_dict(sd)


class ElasticEnvironment(LightningEnvironment):
    """Ranks and world size from the raylastic context of the current membership epoch;
    processes and the process group are raylastic's (``creates_processes_externally``)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    def world_size(self) -> int:
        return _session.get_context().get_world_size()

    def global_rank(self) -> int:
        return _session.get_context().get_world_rank()

    def local_rank(self) -> int:
        return _session.get_context().get_local_rank()

    def node_rank(self) -> int:
        return _session.get_context().get_node_rank()

    def set_world_size(self, size: int) -> None:
        pass  # raylastic decides it

    def set_global_rank(self, rank: int) -> None:
        pass

    def teardown(self) -> None:
        pass  # the environment variables are raylastic's, kept for the next call
