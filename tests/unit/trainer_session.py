"""A one-rank raylastic ``Session`` installed in this process, for the trainer
integration tests (HF, Lightning): what the worker sets up before each attempt of a train
function. Shared so that both integrations are tested against the same session setup."""

from raylastic import session as _session
from raylastic._internal.worker_group.worker import before_attempt
from raylastic._internal.protocol import GroupSpec, RestoreInfo
from raylastic.session import Session


def session_for(run_rel, restore=None, epoch=1, **spec):
    """Install a world-size-1 session for run ``run_rel`` (``spec``: more ``GroupSpec`` fields)."""
    group = GroupSpec(epoch=epoch, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                      master_addr="127.0.0.1", master_port=0, backend="gloo", **spec)
    sess = Session(spec=group, storage=None, run_rel=run_rel, run_name=run_rel, restore=restore or RestoreInfo())
    _session._set_session(sess)
    before_attempt(sess)  # as the worker does before each attempt
    return sess
