"""Ray Data input (``datasets=`` / ``get_dataset_shard``) with a position that survives resizes.

Why not Ray's ``streaming_split``: it hands blocks to whichever rank asks first and keeps
no position, so after a failure or a resize the split restarts and rows are repeated or
skipped within the epoch (ray-project/ray#37633). Here an epoch of a split dataset is one
deterministic global row order (a materialized dataset's block order; a lazy dataset
executed with ``preserve_order``), and training consumes it front to back in **global
batches** of ``batch_size * world_size`` rows: rank ``r`` takes rows
``[g + r*b, g + (r+1)*b)`` of the global batch starting at ``g``. The position is one
integer, the rows of the epoch consumed in whole global batches (``DataPosition``), as for
``ElasticDataLoader``'s dynamic policy: it does not depend on the world size, so a group of
another size continues at the same row, and every row of the epoch is trained once.

One ``SplitCoordinator`` actor per split dataset executes the epoch once (Ray Data's work
is not repeated per rank) and hands out the block references in order with their row
counts; each rank fetches the blocks and cuts its own rows. The position rides with every
checkpoint a rank reports (a small file next to the user's files) and with every
``ElasticState`` snapshot (``state.py`` puts ``positions()`` in it and hands it back on a
restore). Contract and limits: docs/data.md, "Ray Data input".
"""

from __future__ import annotations

import copy
import json
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from raylastic.data.ray_data_iterator import _BLOCKS_PER_CALL, DataPosition, ElasticDataIterator
from raylastic.data.ray_data_iterator import item_ranges  # noqa: F401 - part of this module's API
from raylastic.errors import ConfigError

POSITION_FILE = ".raylastic_data.json"
POSITION_VERSION = 1

__all__ = [
    "DataPosition",
    "DataPlan",
    "DataShards",
    "ElasticDataIterator",
    "POSITION_FILE",
    "SplitCoordinator",
    "ingest_options",
    "item_ranges",
    "validate_datasets",
]


def validate_datasets(datasets: Any, dataset_config: Any) -> Tuple[Dict[str, Any], List[str]]:
    """Check ``datasets=`` / ``dataset_config=`` before any resources are taken; returns
    the datasets and the names to split across ranks (the rest go whole to every rank)."""
    from ray.data import Dataset
    from ray.train import DataConfig

    if datasets is None:
        datasets = {}
    if not isinstance(datasets, dict):
        raise ConfigError(
            f"datasets must be a dict of name -> ray.data.Dataset, got "
            f"{type(datasets).__name__}. Fix: datasets={{'train': ds}}."
        )
    for name, ds in datasets.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(
                f"datasets has the key {name!r}: names must be non-empty strings "
                "(what get_dataset_shard(name) is called with)."
            )
        if not isinstance(ds, Dataset) and not callable(ds):
            raise ConfigError(
                f"datasets[{name!r}] is a {type(ds).__module__}.{type(ds).__name__}, not a "
                "ray.data.Dataset (or a function returning one). Fix: wrap it, e.g. ray.data.from_pandas(df) / "
                "ray.data.from_items(rows), or build the loader inside the train function."
            )
    if dataset_config is None:
        dataset_config = DataConfig()
    if not isinstance(dataset_config, DataConfig):
        raise ConfigError(f"dataset_config must be a ray.train.DataConfig, got {type(dataset_config).__name__}.")
    if type(dataset_config).configure is not DataConfig.configure:
        raise ConfigError(
            f"dataset_config is a {type(dataset_config).__name__} with its own configure(): "
            "raylastic splits datasets itself (resumable positions) and cannot run a custom "
            "configure(). Fix: use ray.train.DataConfig(datasets_to_split=...) and do custom "
            "per-rank work in the train function."
        )
    split = dataset_config._datasets_to_split
    if split == "all":
        names = sorted(datasets)
    elif isinstance(split, (list, tuple)) and all(isinstance(n, str) for n in split):
        unknown = sorted(set(split) - set(datasets))
        if unknown:
            raise ConfigError(
                f"DataConfig(datasets_to_split={list(split)!r}) names {unknown}, which is not "
                f"in datasets (names: {sorted(datasets)}). Fix: pass those datasets in "
                "datasets=, or drop the names from datasets_to_split."
            )
        names = list(dict.fromkeys(split))
    else:
        raise ConfigError(f"DataConfig(datasets_to_split={split!r}) must be 'all' or a list of dataset names.")
    return dict(datasets), names


# --------------------------------------------------------------------------------------
# The coordinator: executes an epoch once, hands out block references in order
# --------------------------------------------------------------------------------------
class _EpochStream:
    """One execution of the dataset for one epoch: blocks in order with their first row."""

    def __init__(self, dataset, skip_to: int):
        self.it = iter(dataset.iter_internal_ref_bundles())
        self.entries: Deque[Tuple[int, int, Any]] = deque()  # (start row, rows, ref)
        self.next_row = 0  # rows seen so far
        self.base = skip_to  # rows below this are not kept (released or skipped)
        self.ended = False

    def pull(self) -> None:
        try:
            bundle = next(self.it)
        except StopIteration:
            self.ended = True
            return
        for entry in bundle.blocks:
            ref, rows = entry.ref, entry.metadata.num_rows
            if rows is None:  # pragma: no cover - Ray sets it for every block it produces
                import ray
                from ray.data.block import BlockAccessor

                rows = BlockAccessor.for_block(ray.get(ref)).num_rows()
            start, self.next_row = self.next_row, self.next_row + rows
            if rows and self.next_row > self.base:
                self.entries.append((start, rows, ref))

    def release_below(self, row: int) -> None:
        while self.entries and self.entries[0][0] + self.entries[0][1] <= row:
            self.entries.popleft()
        self.base = max(self.base, row)


class SplitCoordinator:
    """Ray actor (one per split dataset, on the head node): executes the dataset once per
    epoch with ``preserve_order`` and answers, for a row offset, the blocks that hold it
    and the following ones. It drops its references to blocks every rank of the newest
    group has received (the ranks hold their own); a request behind that point (a group
    resuming from an older position) re-executes the epoch and skips to the row."""

    def __init__(self, dataset, name: str, options: Any = None):
        ctx = dataset.context
        if options is not None:  # DataConfig's (ingest_options), applied here where the epochs execute
            ctx.execution_options = options
        ctx.execution_options.preserve_order = True
        from ray.data.dataset import MaterializedDataset

        self._ds = dataset
        self._name = name
        self._materialized = isinstance(dataset, MaterializedDataset)
        self._lock = threading.Lock()
        self._streams: Dict[int, _EpochStream] = {}
        self._fronts: Dict[Tuple[int, int], Dict[int, int]] = {}  # (epoch, group) -> rank -> row
        self.executions = 0

    def blocks(
        self, epoch: int, from_row: int, group: Tuple[int, int, int], max_blocks: int = _BLOCKS_PER_CALL
    ) -> Tuple[List[Tuple[int, int, Any]], bool, Optional[int]]:
        """Blocks of ``epoch`` from the one holding ``from_row``: ``(entries, ended, total)``
        with ``entries`` = ``[(start row, rows, ref)]``. At least one block unless the epoch
        has no more (``ended``; ``total`` is then its row count)."""
        group_epoch, rank, world = group
        with self._lock:
            stream = self._streams.get(epoch)
            if stream is None or from_row < stream.base:
                stream = self._streams[epoch] = _EpochStream(self._ds, from_row)
                self.executions += 1
                for old in [e for e in self._streams if e < epoch - 1]:
                    del self._streams[old]
            self._note_front(stream, epoch, group_epoch, rank, world, from_row)
            out = [e for e in stream.entries if e[0] + e[1] > from_row][:max_blocks]
            while not out and not stream.ended:
                stream.pull()
                out = [e for e in stream.entries if e[0] + e[1] > from_row][:max_blocks]
            # A materialized dataset's blocks are all there: hand out a full batch of them.
            while self._materialized and len(out) < max_blocks and not stream.ended:
                stream.pull()
                out = [e for e in stream.entries if e[0] + e[1] > from_row][:max_blocks]
            ended = stream.ended and (not out or out[-1] is stream.entries[-1])
            return out, ended, stream.next_row if ended else None

    def _note_front(self, stream: _EpochStream, epoch: int, group_epoch: int, rank: int, world: int, row: int) -> None:
        key = (epoch, group_epoch)
        fronts = self._fronts.setdefault(key, {})
        fronts[rank] = max(row, fronts.get(rank, 0))
        newest = max(g for (e, g) in self._fronts if e == epoch)
        for k in [k for k in self._fronts if k[0] < epoch - 1 or (k[0] == epoch and k[1] < newest)]:
            del self._fronts[k]
        if group_epoch == newest and len(fronts) == world:
            stream.release_below(min(fronts.values()))

    def schema(self):
        return self._ds.schema()

    def stats(self) -> Dict[str, int]:
        return {"executions": self.executions}


# --------------------------------------------------------------------------------------
# Rank side
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataPlan:
    """What the train function wrapper gives every rank: coordinator handles for the split
    datasets, the other datasets whole."""

    split: Dict[str, Any]  # name -> SplitCoordinator handle
    whole: Dict[str, Any]  # name -> ray.data.Dataset
    options: Dict[str, Any] = field(default_factory=dict)  # split name -> its ExecutionOptions (ingest_options)


class DataShards:
    """Per attempt, per rank: the iterators ``get_dataset_shard`` returns and their positions."""

    def __init__(self, plan: DataPlan, sess):
        self._plan = plan
        self._sess = sess
        self._lock = threading.Lock()
        self._iters: Dict[str, Any] = {}
        self._positions: Dict[str, DataPosition] = {}
        self._resolved = False
        self._started: set = set()

    # -- positions ------------------------------------------------------------------
    def _resolve(self) -> None:
        """Initial positions: handed over by ElasticState (restore_positions), else the
        file in the committed checkpoint this attempt resumes from, else the start."""
        if self._resolved:
            return
        self._resolved = True
        found: Dict[str, Any] = {}
        rel = self._sess.restore.checkpoint_rel
        if rel is not None and not self._positions:
            try:
                found = json.loads(self._sess.storage.read_bytes(f"{rel}/{POSITION_FILE}"))["datasets"]
            except FileNotFoundError:
                found = {}
        for name in self._plan.split:
            if name not in self._positions:
                self._positions[name] = DataPosition.from_dict(found[name]) if name in found else DataPosition()

    def positions(self) -> Dict[str, Dict[str, int]]:
        """Every split dataset's position now (what a checkpoint or snapshot records)."""
        with self._lock:
            self._resolve()
            return {n: p.to_dict() for n, p in self._positions.items()}

    def restore_positions(self, positions: Dict[str, Any]) -> None:
        """ElasticState restored a snapshot: continue the split datasets from its positions."""
        with self._lock:
            begun = sorted(self._started & set(positions))
            if begun:
                raise RuntimeError(
                    f"ElasticState restored the positions of datasets {begun} after iterating "
                    "them had begun in this attempt. Fix: construct ElasticState before the "
                    "first iter_batches / iter_torch_batches / iter_rows call."
                )
            for name, d in positions.items():
                if name in self._plan.split:
                    self._positions[name] = DataPosition.from_dict(d)
            self._resolved = False

    def write_positions(self, directory: str) -> None:
        """Put the positions next to a checkpoint's files (``POSITION_FILE``)."""
        if not self._plan.split:
            return
        import os

        with open(os.path.join(directory, POSITION_FILE), "w") as fh:
            json.dump({"version": POSITION_VERSION, "datasets": self.positions()}, fh)

    def _begin(self, name: str) -> DataPosition:
        with self._lock:
            self._resolve()
            self._started.add(name)
            return self._positions[name]

    def _advance(self, name: str, pos: DataPosition) -> None:
        with self._lock:
            self._positions[name] = pos

    # -- shards ---------------------------------------------------------------------
    def get(self, name: Optional[str]):
        names = sorted(set(self._plan.split) | set(self._plan.whole))
        if name is None and len(names) == 1:
            name = names[0]
        if name in self._iters:
            return self._iters[name]
        if name in self._plan.split:
            it = ElasticDataIterator(name, self._plan.split[name], self, self._plan.options.get(name))
        elif name in self._plan.whole:
            it = self._plan.whole[name].iterator()
        else:
            raise KeyError(
                f"get_dataset_shard({name!r}): no dataset of that name was passed to the "
                f"trainer (datasets: {names or 'none'}). Fix: pass it in datasets={{{name!r}: ds}}, "
                "or use one of those names."
            )
        self._iters[name] = it
        return it

    def close(self) -> None:
        for it in self._iters.values():
            if isinstance(it, ElasticDataIterator):
                it.close()

    def group(self) -> Tuple[int, int, int]:
        spec = self._sess.spec
        return spec.epoch, spec.rank, spec.world_size


# --------------------------------------------------------------------------------------
# Driver side: coordinators and the train function wrapper
# --------------------------------------------------------------------------------------
class WithDatasets:
    """The train function, with ``get_dataset_shard`` answered from ``plan`` (installed on
    the rank's session before the function starts, so positions restore with it). The
    driver's ``DataContext`` at ``fit()`` becomes each rank's current one, as Ray Train
    propagates it: settings a script makes on the driver apply where the rank iterates."""

    def __init__(self, func: Callable, plan: DataPlan):
        from ray.data import DataContext

        self.func = func
        self.plan = plan
        self.data_context = copy.deepcopy(DataContext.get_current())

    def __call__(self, config: Dict[str, Any]) -> Any:
        # Here, not at the top: the worker module imports torch (loaded in the worker already).
        from raylastic import session as _session
        from raylastic._internal.worker_group.worker import _call

        from ray.data import DataContext

        DataContext._set_current(copy.deepcopy(self.data_context))
        sess = _session._get_session()
        sess.data = shards = DataShards(self.plan, sess)
        try:
            return _call(self.func, config)
        finally:
            shards.close()  # a pass left open by an unwound attempt stops reading


def resolve_datasets(datasets: Dict[str, Any]) -> Dict[str, Any]:
    """Call the dataset factories (Ray Train accepts ``Callable[[], Dataset]``), as Ray
    Train does, on the driver at ``fit()``."""
    from ray.data import Dataset

    out = {}
    for name, ds in datasets.items():
        value = ds if isinstance(ds, Dataset) else ds()
        if not isinstance(value, Dataset):
            raise ConfigError(
                f"datasets[{name!r}] is a function that returned a {type(value).__name__}, not a ray.data.Dataset."
            )
        out[name] = value
    return out


def ingest_options(dataset_config: Any, name: str) -> Any:
    """The Ray Data ``ExecutionOptions`` dataset ``name`` executes with, resolved as Ray
    Train resolves them: ``DataConfig(execution_options=...)`` (one for all datasets, or a
    dict by name), else ``DataConfig.default_ingest_options()`` (the driver's
    ``DataContext``: its ``resource_limits``, ``exclude_resources``, ``preserve_order`` and
    ``verbose_progress``). A fresh copy per dataset: Ray's own method, so the two agree."""
    from ray.train import DataConfig

    return (dataset_config if dataset_config is not None else DataConfig())._resolve_execution_options(name)


def start_coordinators(
    datasets: Dict[str, Any], split: Sequence[str], resources: Dict[str, float], dataset_config: Any = None
) -> DataPlan:
    """One ``SplitCoordinator`` per split dataset (no CPU: Ray Data's own tasks do the
    work), pinned with ``resources`` (the head node: it must outlive worker nodes). Each
    dataset runs with ``ingest_options``; the split ones also with ``preserve_order``."""
    import ray
    from ray.data import Dataset

    actor = ray.remote(SplitCoordinator).options(num_cpus=0, max_concurrency=8, max_restarts=0, resources=resources)
    options = {name: ingest_options(dataset_config, name) for name in split}
    coords = {name: actor.remote(datasets[name], name, options[name]) for name in split}
    whole = {}
    for name in (n for n in datasets if n not in coords):
        ds = Dataset.copy(datasets[name], _deep_copy=True)  # its own context: the user's keeps its options
        ds.context.execution_options = ingest_options(dataset_config, name)
        whole[name] = ds
    return DataPlan(split=coords, whole=whole, options=options)


def stop_coordinators(plan: Optional[DataPlan]) -> None:
    import ray

    for handle in plan.split.values() if plan is not None else ():
        ray.kill(handle, no_restart=True)
