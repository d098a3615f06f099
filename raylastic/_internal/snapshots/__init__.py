"""In-memory snapshots of the training state: one package, laid out by lifecycle.

``ElasticState.commit()`` takes a *snapshot* each step into host memory, peers keep
copies of its *shards*, and a new group restores from them without a storage read (or
from the persisted checkpoint when memory is not enough). Follow one snapshot through:

- ``registry``: who contributes state (model, optimizer, LR scheduler, loader, Ray Data
  positions, attributes, ``stateful=`` objects): one registry of ``state_dict()`` /
  ``load_state_dict()`` objects, and the ``Half`` protocol the two kinds of tensor state
  implement (``replicated`` and ``sharded``);
- ``capture``: live tensors into reused host buffers (pinned for CUDA), in the
  background until the next ``optimizer.step()``; the state-dict tree walk;
- ``placement``: which rank holds which shards (pure functions of the group: no torch,
  the controller imports it);
- ``transport``: moving tensors between workers during training and restores, through
  one interface, :class:`~transport.Transport` (send / recv / broadcast / gather), over
  the gloo side group or the training group. The fourth route, a worker's shards
  sent to another worker through Ray (evacuation before a drain, rescuing a hung
  worker), is made of actor calls: ``TrainWorker.export_snapshot`` / ``merge_snapshot``
  (``worker_group/worker.py``) into :meth:`store.SnapshotStore.merge`;
- ``store``: the process-wide :class:`~store.SnapshotStore` (double-buffered snapshots
  that outlive a train function unwound for a resize);
- ``replicated``: DDP state: every rank holds a replica, each copies its stripe, a
  restore assembles the whole from the members (``assemble``);
- ``sharded/``: FSDP2 and DeepSpeed ZeRO state: ``layout`` (chunks, overlaps), ``reshard``
  (re-partition at a new world size), ``fsdp2`` and ``deepspeed`` (the framework
  adapters) and ``state`` (the sharded half: own shard + peer copies);
- ``persist``: what a persisted snapshot writes to storage (``elastic_state.pt``, the
  per-rank shard files) and reads back;
- ``planner``: the restore plan the controller runs (pure: from what every member holds,
  memory or storage, and what must move before workers leave). The controller's
  ``controller/memory_restore.py`` stays a thin module that makes the actor calls and
  writes the events: the package must not depend on the worker group or the controller.

Names differ from the suggestion in two places, for what the code holds: ``registry``
(the contributors of state and the ``Half`` protocol have no other home) and
``sharded/state`` (the sharded half that ``ElasticState`` drives, next to its parts).

Glossary (each word means this and nothing else here):

- **snapshot**: one commit's copy of the training state in one process's host memory
  (:class:`store.Snapshot`), named by its report index. Several ranks' snapshots of the
  same index are *copies* of one snapshot.
- **shard**: one of ``nshards`` parts a snapshot's tensors are split into, placed and
  counted as a unit. Replicated state: a byte-balanced group of the state dict's tensors
  (``placement.shard_of_leaves``). Sharded state (FSDP2, ZeRO): old rank ``s``'s own
  part of the state is shard ``s``.
- **piece**: one tensor of a shard. Sharded state describes each piece with a
  :class:`sharded.layout.Chunk` (which box of which logical tensor it is); replicated
  pieces are the state dict's tensors, named by their *leaf* position in it.
- **holding**: the shards one copy of a snapshot holds, ``(nshards, shards)``, or
  ``WHOLE``; **holder**: a rank (worker) whose copy holds a given shard.
- **stripe**: the shards a rank is assigned to hold in every snapshot
  (``placement.plan_stripes``, ``GroupSpec.stripe``); a *striped* copy holds only its
  rank's stripe (``ElasticState(striped=True)``); ``stripes`` maps (``Holdings``,
  ``SnapshotStore.stripes``) are index -> holding of a member's striped copies.
"""
