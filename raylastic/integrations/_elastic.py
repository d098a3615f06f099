"""What the HF and Lightning integrations share: when a trainer that cannot be resized in
place may still run as under Ray Train (``prepare_trainer(fallback_to_restart=True)``).

One place for the rule, so the two integrations cannot drift apart: falling back is
allowed only when asked for (Ray's routed ``prepare_trainer`` asks), and never once the
run has been elastic (this attempt restores from the peers' memory: its state only
exists there, so a restart from the last reported checkpoint would lose it).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Dict, Union

from raylastic import session as _session
from raylastic._internal.state_values import check_state_args
from raylastic.errors import ConfigError
from raylastic.state import ElasticState

# ``ElasticState``'s own keyword arguments that a prepared trainer passes on.
STATE_KWARGS = ("persist_every", "snapshot_every", "async_snapshot", "striped")


def check_state_kwargs(state_kwargs: Dict[str, Any]) -> None:
    """``prepare_trainer(**state_kwargs)``, checked where it is called, not at the first
    step inside every worker: a name ``ElasticState`` does not take, or a bad value (the
    others at ``ElasticState``'s own defaults)."""
    unknown = sorted(set(state_kwargs) - set(STATE_KWARGS))
    if unknown:
        raise ConfigError(
            f"prepare_trainer({unknown[0]}=...) is not an ElasticState argument a "
            f"prepared trainer passes on. Fix: use one of {', '.join(STATE_KWARGS)}, or none."
        )
    defaults = inspect.signature(ElasticState.__init__).parameters
    check_state_args(**{name: state_kwargs.get(name, defaults[name].default) for name in STATE_KWARGS})


def restoring_from_memory() -> bool:
    """This attempt restores the state from the peers' memory: the run has been elastic."""
    sess = _session._session
    return sess is not None and sess.restore.memory_index is not None


def refuse_or_fall_back(
    why: Union[str, ValueError],
    allowed: bool,
    log: logging.Logger,
    what: str,
    *,
    warn: bool = True,
    strict_once_elastic: bool = True,
) -> None:
    """Raise ``why`` (as a ValueError) unless falling back to restarts is ``allowed``;
    otherwise log (where ``warn``) that ``what`` is not resized in place, and return.

    ``strict_once_elastic``: refuse as well when this attempt restores from memory (see
    the module docstring). ``log`` is the integration's own logger, so its warnings keep
    their logger's name.
    """
    if not allowed or (strict_once_elastic and restoring_from_memory()):
        raise why if isinstance(why, ValueError) else ValueError(why)
    if warn:
        log.warning(
            "raylastic: %s is not resized in place (%s); a resize restarts it from its last "
            "reported checkpoint, as under Ray Train",
            what,
            why,
        )
