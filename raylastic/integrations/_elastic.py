"""What the HF and Lightning integrations share: when a trainer that cannot be resized in
place may still run as under Ray Train (``prepare_trainer(fallback_to_restart=True)``).

One place for the rule, so the two integrations cannot drift apart: falling back is
allowed only when asked for (Ray's routed ``prepare_trainer`` asks), and never once the
run has been elastic (this attempt restores from the peers' memory: its state only
exists there, so a restart from the last reported checkpoint would lose it).
"""

from __future__ import annotations

import logging
from typing import Union

from raylastic import session as _session


def restoring_from_memory() -> bool:
    """This attempt restores the state from the peers' memory: the run has been elastic."""
    sess = _session._session
    return sess is not None and sess.restore.memory_index is not None


def refuse_or_fall_back(why: Union[str, ValueError], allowed: bool, log: logging.Logger, what: str, *,
                        warn: bool = True, strict_once_elastic: bool = True) -> None:
    """Raise ``why`` (as a ValueError) unless falling back to restarts is ``allowed``;
    otherwise log (where ``warn``) that ``what`` is not resized in place, and return.

    ``strict_once_elastic``: refuse as well when this attempt restores from memory (see
    the module docstring). ``log`` is the integration's own logger, so its warnings keep
    their logger's name.
    """
    if not allowed or (strict_once_elastic and restoring_from_memory()):
        raise why if isinstance(why, ValueError) else ValueError(why)
    if warn:
        log.warning("raylastic: %s is not resized in place (%s); a resize restarts it from its last "
                    "reported checkpoint, as under Ray Train", what, why)
