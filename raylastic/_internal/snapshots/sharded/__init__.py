"""Sharded training state (FSDP2, DeepSpeed ZeRO) kept in peer memory and re-partitioned
at another world size.

Why this differs from the replicated (DDP) case in ``replicated.py``: under FSDP2 or ZeRO
each rank holds only its own part of the parameters and optimizer state, so no rank can
copy anyone else's part from its own memory, and after a resize the parts no longer line
up with the ranks (3 shards of a weight become 2 of other sizes). So:

* A framework **adapter** describes the rank's state as :class:`Chunk` s: pieces of
  named logical tensors (``"model/w"``, ``"optim/w/exp_avg"``) with their global shape
  and where the piece sits in it. FSDP2 pieces are the DTensors' local shards
  (``fsdp2.FSDP2Adapter``); ZeRO pieces are the flattened fragments a rank owns
  (``deepspeed.DeepSpeedAdapter``). The names do not depend on the world size.
* A snapshot holds the rank's own pieces (old rank ``r``'s pieces are *shard r* of the
  snapshot) and, received over a side gloo group in the background (``transport.PeerExchange``),
  a copy of another node's shard chosen by ``placement.plan_stripes``: any single node
  loss leaves every shard on a survivor. That is the same ``(nshards, shards)`` holding
  the controller already plans with, so coverage checks, evacuation before a drain and
  the fallback to storage work unchanged.
* Restoring (``reshard.reshard_from_memory``) is a collective over the new group: every rank
  learns the old layout from the holders and asks for the boxes of its *new* layout
  (``restore_targets``: an empty optimizer's moments are made from the old layout's keys,
  not by a zero-gradient step, which took half of a ~1 s restore); for each old shard,
  its holders copy from their own copy, and its lowest holder sends each other rank the
  box of each piece its new boxes overlap (point to point, one old shard in flight at a
  time), and :func:`fill` copies the overlaps in place. Storage restores read the same
  pieces from per-rank files (memory-mapped: only the overlapping bytes are read).

Modules: ``layout`` (chunks and the overlap arithmetic, pure), ``reshard`` (filling a
new layout from old shards: in memory over the group, or from files), ``fsdp2`` and
``deepspeed`` (the adapters), ``state`` (the sharded half of ``ElasticState``), ``lean``
(``lean_snapshots=True``: one snapshot kept, the own shard sent from the live state).

Every check of whether an old layout fits the new one (keys, global shapes, coverage) is
made on metadata all ranks share, before any tensor moves, so all ranks raise together
(``ValueError``, reported as ``checkpoint_invalid``) and none waits on a peer that gave up.
"""
