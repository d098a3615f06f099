"""The loader's resumable position, as a plain dict, and the checks done when loading one.

Why the position is "samples consumed in the epoch" (plus the step counter): under the fixed
policy ``samples == step * global_batch_size``, so either works; under the dynamic policy the
global batch follows the world size, so only the sample offset says where the next world
size must continue for every sample to be trained exactly once per epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from raylastic.data.policy import BatchPolicy

__all__ = ["LoaderState", "STATE_VERSION"]

STATE_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class LoaderState:
    """Position of an :class:`ElasticDataLoader`: ``step`` is the next global step to yield."""

    epoch: int
    step: int
    samples: int
    dataset_len: int
    seed: int
    global_batch_size: int
    micro_batch_size: int
    shuffle: bool
    batch_policy: str
    world_size: int
    version: int = STATE_VERSION

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> "LoaderState":
        """Parse and sanity-check a dict from :meth:`to_dict` (any version-1 checkpoint)."""
        if not isinstance(state, Mapping):
            raise ValueError(
                f"state_dict must be a dict from ElasticDataLoader.state_dict(), got {type(state).__name__}"
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"state_dict['version'] ({state.get('version')!r}) is not supported; this "
                f"raylastic reads version {STATE_VERSION}: resume with the raylastic version "
                "that wrote the checkpoint"
            )
        missing = sorted(set(cls.__dataclass_fields__) - set(state))
        if missing:
            raise ValueError(f"state_dict is missing keys {missing}: it is not a loader state")
        parsed = cls(**{k: state[k] for k in cls.__dataclass_fields__})
        for name in ("epoch", "step", "samples", "dataset_len", "seed"):
            value = getattr(parsed, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"state_dict[{name!r}] ({value!r}) must be a non-negative int")
        if parsed.samples > parsed.dataset_len:
            raise ValueError(
                f"state_dict['samples'] ({parsed.samples}) > state_dict['dataset_len'] "
                f"({parsed.dataset_len}): the state is corrupted"
            )
        return parsed

    def check_compatible(
        self,
        *,
        dataset_len: int,
        seed: int,
        shuffle: bool,
        batch_policy: BatchPolicy,
        global_batch_size: int | None,
    ) -> None:
        """Raise ``ValueError`` if resuming this state with that config would change the data."""
        restart = "or start without load_state_dict() to begin the epoch afresh"
        if self.dataset_len != dataset_len:
            raise ValueError(
                f"state_dict['dataset_len'] ({self.dataset_len}) != len(dataset) ({dataset_len}): "
                "the checkpoint was taken on another dataset; resume with the same dataset, "
                f"{restart}"
            )
        if self.seed != seed:
            raise ValueError(
                f"state_dict['seed'] ({self.seed}) != seed ({seed}): the sample order would "
                f"change mid-epoch; pass seed={self.seed}, {restart}"
            )
        if self.shuffle != shuffle:
            raise ValueError(
                f"state_dict['shuffle'] ({self.shuffle}) != shuffle ({shuffle}): the sample order "
                f"would change mid-epoch; pass shuffle={self.shuffle}, {restart}"
            )
        if self.batch_policy != batch_policy.value:
            raise ValueError(
                f"state_dict['batch_policy'] ({self.batch_policy!r}) != batch_policy "
                f"({batch_policy.value!r}); pass batch_policy={self.batch_policy!r}, {restart}"
            )
        if batch_policy is BatchPolicy.FIXED:
            if self.global_batch_size != global_batch_size:
                raise ValueError(
                    f"state_dict['global_batch_size'] ({self.global_batch_size}) != "
                    f"global_batch_size ({global_batch_size}) under the fixed policy: step "
                    f"boundaries would move; pass global_batch_size={self.global_batch_size}, "
                    f"{restart}"
                )
            if self.samples != self.step * self.global_batch_size:
                raise ValueError(
                    f"state_dict['samples'] ({self.samples}) != step ({self.step}) * "
                    f"global_batch_size ({self.global_batch_size}): the state is corrupted"
                )
