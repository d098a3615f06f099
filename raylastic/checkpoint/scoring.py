"""Which committed checkpoints a run keeps, and in what order it lists them.

Why a module of its own: the controller's ``CheckpointManager`` deletes by these rules, a
worker's ``ray.train.get_all_reported_checkpoints()`` and ``fit()``'s
``Result.best_checkpoints`` list by them, and the three must agree on every run.

The rules are Ray Train 2.60's (``ray/train/v2/_internal/execution/checkpoint/
checkpoint_manager.py`` and ``_insert_into_sorted_list`` / ``_get_checkpoint_score`` of
``ray/train/_internal/checkpoint_manager.py``):

- without a score attribute the checkpoints are ranked by age: keep the newest
  ``num_to_keep``;
- with one they are ranked by ``(not NaN, order * metric)`` (order: 1 for "max", -1 for
  "min"), ties broken by age (the newer ranks higher); NaN ranks below every number; a
  checkpoint whose metrics lack the key has the metric ``-inf``, so it ranks last with
  "max" but first with "min" (Ray's rule, kept as is);
- the lowest ``len - num_to_keep`` are deleted, except the newest checkpoint, which is
  always kept (a restart resumes from it), so ``num_to_keep + 1`` can exist;
- "best" (``Result.best_checkpoints``) is the top ``num_to_keep`` of the ranking, worst
  first; the newest, when kept only for being the newest, is not among them.

One difference: Ray fails the run when the metric is not a number; here such a
checkpoint ranks last (logged), because the controller applies this
after the manifest is written and a commit must not fail half-way.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar

logger = logging.getLogger("raylastic")


class _Scored(Protocol):
    @property
    def metrics(self) -> Dict[str, Any]: ...  # read only: CommittedCheckpoint is frozen


T = TypeVar("T", bound=_Scored)  # anything with ``.metrics`` (CommittedCheckpoint)


def flatten(metrics: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``, as Ray's ``flatten_dict`` (the key a
    ``checkpoint_score_attribute`` names)."""
    out: Dict[str, Any] = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        else:
            out[key] = v
    return out


def score(metrics: Dict[str, Any], attribute: str, order: str) -> Tuple[bool, float]:
    """The sort key of a checkpoint with ``metrics``: higher is better."""
    flat = flatten(metrics or {})
    if attribute not in flat:
        logger.error(
            "checkpoint metrics have no key %r (CheckpointConfig score attribute); it scores -inf. Valid keys: %s",
            attribute,
            sorted(flat),
        )
        value: Any = float("-inf")
    else:
        value = flat[attribute]
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        logger.error("checkpoint metric %r is %r, not a number; it ranks last", attribute, value)
        return (True, float("-inf"))
    value = (1.0 if order == "max" else -1.0) * float(value)
    if math.isnan(value):
        return (False, float("-inf"))
    return (True, value)


def ranked(committed: Sequence[T], attribute: Optional[str], order: str = "max") -> List[T]:
    """``committed`` (oldest first) ranked worst first; by age without an attribute."""
    if attribute is None:
        return list(committed)
    keyed = [(score(c.metrics, attribute, order), i, c) for i, c in enumerate(committed)]
    keyed.sort(key=lambda t: (t[0], t[1]))
    return [c for _, _, c in keyed]


def to_delete(
    committed: Sequence[T], num_to_keep: Optional[int], attribute: Optional[str], order: str = "max"
) -> List[T]:
    """The checkpoints retention removes now, oldest first."""
    if num_to_keep is None or len(committed) <= num_to_keep:
        return []
    worst = ranked(committed, attribute, order)[:-num_to_keep]
    newest = committed[-1]
    doomed = {id(c) for c in worst if c is not newest}
    return [c for c in committed if id(c) in doomed]


def best(committed: Sequence[T], num_to_keep: Optional[int], attribute: Optional[str], order: str = "max") -> List[T]:
    """``Result.best_checkpoints``: the top ``num_to_keep`` of the ranking, worst first."""
    ranking = ranked(committed, attribute, order)
    return ranking if num_to_keep is None else ranking[-num_to_keep:]


def kept(committed: Sequence[T], num_to_keep: Optional[int], attribute: Optional[str], order: str = "max") -> List[T]:
    """What ``get_all_reported_checkpoints()`` lists: every checkpoint retention keeps, in
    the ranking's order (Ray's manager list), worst first."""
    gone = {id(c) for c in to_delete(committed, num_to_keep, attribute, order)}
    return [c for c in ranked(committed, attribute, order) if id(c) not in gone]
