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

import json
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from raylastic.data.plan import shard_bounds
from raylastic.errors import ConfigError

POSITION_FILE = ".raylastic_data.json"
POSITION_VERSION = 1
_BLOCKS_PER_CALL = 16  # block references asked of the coordinator per call
_ROWS_PER_ITEM = 256  # iter_rows: rows cut from the blocks at a time

__all__ = [
    "DataPosition", "DataPlan", "DataShards", "ElasticDataIterator", "POSITION_FILE",
    "SplitCoordinator", "item_ranges", "validate_datasets",
]


# --------------------------------------------------------------------------------------
# Pure parts: the position and which rows a rank reads (unit-tested without Ray)
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataPosition:
    """Where a split dataset stands: ``rows`` of epoch ``epoch``'s global order have been
    handed out in whole global batches. Independent of the world size."""

    epoch: int = 0
    rows: int = 0

    def to_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "rows": self.rows}

    @classmethod
    def from_dict(cls, d: Any) -> "DataPosition":
        if not isinstance(d, dict) or set(d) != {"epoch", "rows"}:
            raise ValueError(f"a dataset position must be a dict with keys epoch and rows, got {d!r}")
        for k in ("epoch", "rows"):
            if isinstance(d[k], bool) or not isinstance(d[k], int) or d[k] < 0:
                raise ValueError(f"dataset position {k}={d[k]!r} must be a non-negative int")
        return cls(epoch=d["epoch"], rows=d["rows"])


def item_ranges(start: int, batch_size: int, world_size: int, rank: int, batches: int,
                total: Optional[int], drop_last: bool) -> Tuple[List[Tuple[int, int]], bool]:
    """Rank ``rank``'s row ranges for up to ``batches`` global batches from row ``start``.

    A full global batch ``[g, g + b*W)`` gives the rank ``[g + r*b, g + (r+1)*b)``. When the
    epoch's row count ``total`` is known and fewer than ``b*W`` rows remain, the final
    partial global batch of ``T`` rows is split by :func:`shard_bounds` (shares differ by at
    most one row), unless ``drop_last`` or ``T < W`` (some rank would get no row: every rank
    must take the same number of steps), in which case it is dropped. Returns the ranges,
    one per global batch, and whether they reach the end of the epoch (``total`` known and
    nothing after them)."""
    if batch_size < 1 or world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"batch_size={batch_size}, world_size={world_size}, rank={rank}")
    span = batch_size * world_size
    full = batches if total is None else max(0, min(batches, (total - start) // span))
    ranges = [(start + i * span + rank * batch_size, start + i * span + (rank + 1) * batch_size)
              for i in range(full)]
    if total is None or full == batches:
        return ranges, total is not None and start + full * span >= total
    tail_start = start + full * span
    tail = total - tail_start
    if tail > 0 and not drop_last and tail >= world_size:
        lo, hi = shard_bounds(tail, rank, world_size)
        ranges.append((tail_start + lo, tail_start + hi))
    return ranges, True


def validate_datasets(datasets: Any, dataset_config: Any) -> Tuple[Dict[str, Any], List[str]]:
    """Check ``datasets=`` / ``dataset_config=`` before any resources are taken; returns
    the datasets and the names to split across ranks (the rest go whole to every rank)."""
    from ray.data import Dataset
    from ray.train import DataConfig

    if datasets is None:
        datasets = {}
    if not isinstance(datasets, dict):
        raise ConfigError(f"datasets must be a dict of name -> ray.data.Dataset, got "
                          f"{type(datasets).__name__}. Fix: datasets={{'train': ds}}.")
    for name, ds in datasets.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"datasets has the key {name!r}: names must be non-empty strings "
                              "(what get_dataset_shard(name) is called with).")
        if not isinstance(ds, Dataset) and not callable(ds):
            raise ConfigError(
                f"datasets[{name!r}] is a {type(ds).__module__}.{type(ds).__name__}, not a "
                "ray.data.Dataset (or a function returning one). Fix: wrap it, e.g. ray.data.from_pandas(df) / "
                "ray.data.from_items(rows), or build the loader inside the train function.")
    if dataset_config is None:
        dataset_config = DataConfig()
    if not isinstance(dataset_config, DataConfig):
        raise ConfigError(f"dataset_config must be a ray.train.DataConfig, got "
                          f"{type(dataset_config).__name__}.")
    if type(dataset_config).configure is not DataConfig.configure:
        raise ConfigError(
            f"dataset_config is a {type(dataset_config).__name__} with its own configure(): "
            "raylastic splits datasets itself (resumable positions) and cannot run a custom "
            "configure(). Fix: use ray.train.DataConfig(datasets_to_split=...) and do custom "
            "per-rank work in the train function.")
    split = dataset_config._datasets_to_split
    if split == "all":
        names = sorted(datasets)
    elif isinstance(split, (list, tuple)) and all(isinstance(n, str) for n in split):
        unknown = sorted(set(split) - set(datasets))
        if unknown:
            raise ConfigError(
                f"DataConfig(datasets_to_split={list(split)!r}) names {unknown}, which is not "
                f"in datasets (names: {sorted(datasets)}). Fix: pass those datasets in "
                "datasets=, or drop the names from datasets_to_split.")
        names = list(dict.fromkeys(split))
    else:
        raise ConfigError(f"DataConfig(datasets_to_split={split!r}) must be 'all' or a list of "
                          "dataset names.")
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

    def __init__(self, dataset, name: str):
        ctx = dataset.context
        ctx.execution_options.preserve_order = True
        from ray.data.dataset import MaterializedDataset

        self._ds = dataset
        self._name = name
        self._materialized = isinstance(dataset, MaterializedDataset)
        self._lock = threading.Lock()
        self._streams: Dict[int, _EpochStream] = {}
        self._fronts: Dict[Tuple[int, int], Dict[int, int]] = {}  # (epoch, group) -> rank -> row
        self.executions = 0

    def blocks(self, epoch: int, from_row: int, group: Tuple[int, int, int],
               max_blocks: int = _BLOCKS_PER_CALL) -> Tuple[List[Tuple[int, int, Any]], bool, Optional[int]]:
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

    def _note_front(self, stream: _EpochStream, epoch: int, group_epoch: int, rank: int,
                    world: int, row: int) -> None:
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
                    "first iter_batches / iter_torch_batches / iter_rows call.")
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
            it = ElasticDataIterator(name, self._plan.split[name], self)
        elif name in self._plan.whole:
            it = self._plan.whole[name].iterator()
        else:
            raise KeyError(
                f"get_dataset_shard({name!r}): no dataset of that name was passed to the "
                f"trainer (datasets: {names or 'none'}). Fix: pass it in datasets={{{name!r}: ds}}, "
                "or use one of those names.")
        self._iters[name] = it
        return it

    def close(self) -> None:
        for it in self._iters.values():
            if isinstance(it, ElasticDataIterator):
                it.close()

    def group(self) -> Tuple[int, int, int]:
        spec = self._sess.spec
        return spec.epoch, spec.rank, spec.world_size


def _data_iterator_base():
    from ray.data import DataIterator

    return DataIterator


class _Pass:
    """One pass over this rank's rows (a background thread fetches blocks, cuts the
    rank's rows and formats them; the consumer yields them and moves the position)."""

    _END = object()

    def __init__(self, coord, group: Tuple[int, int, int], start: DataPosition, batch_size: int,
                 drop_last: bool, batches_per_item: int, fmt: Callable[[Any], Any], depth: int):
        self.coord, self.group = coord, group
        self.start, self.b, self.drop_last = start, batch_size, drop_last
        self.m, self.fmt = batches_per_item, fmt
        self.q: "queue.Queue" = queue.Queue(maxsize=max(1, depth))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._produce, name="raylastic-data", daemon=True)
        self.thread.start()

    def _put(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            epoch, g = self.start.epoch, self.start.rows
            if not self._epoch(epoch, g) and g > 0:
                # The restored position is at the end of its epoch for this world size
                # (nothing whole left): this pass is the next epoch.
                self._epoch(epoch + 1, 0)
            self._put(self._END)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            self._put(e)

    def _epoch(self, epoch: int, g: int) -> int:
        """Produce the items of ``epoch`` from row ``g``; returns how many."""
        import ray

        _, rank, world = self.group
        span = self.b * world
        blocks: Deque[List[Any]] = deque()  # [start, rows, ref, table or None]
        covered, total, n = g, None, 0
        while not self.stop.is_set():
            need = g + self.m * span
            while total is None and covered < need:
                entries, ended, tot = ray.get(self.coord.blocks.remote(epoch, covered, self.group))
                for start, rows, ref in entries:
                    if start + rows > covered:
                        blocks.append([start, rows, ref, None])
                        covered = start + rows
                if entries:
                    ray.wait([e[2] for e in entries], num_returns=len(entries), timeout=0, fetch_local=True)
                if ended:
                    total = tot
            ranges, at_end = item_ranges(g, self.b, world, rank, self.m, total, self.drop_last)
            if ranges:
                table = _cut(blocks, ranges)
                pos = [DataPosition(epoch, g + (i + 1) * span) for i in range(len(ranges))]
                if at_end:
                    pos[-1] = DataPosition(epoch + 1, 0)
                if not self._put((pos, self.fmt(table))):
                    return n
                n += 1
            if at_end or not ranges:
                return n
            g += len(ranges) * span
            while blocks and blocks[0][0] + blocks[0][1] <= g:
                blocks.popleft()
        return n

    def close(self) -> None:
        self.stop.set()


def _cut(blocks: Deque[List[Any]], ranges: Sequence[Tuple[int, int]]):
    """The rows ``ranges`` (global row offsets) of the epoch, as one pyarrow table."""
    import numpy as np
    import pyarrow as pa
    import ray
    from ray.data.block import BlockAccessor

    parts = []
    for blk in blocks:
        start, rows, ref, table = blk
        end = start + rows
        mine = [(max(lo, start) - start, min(hi, end) - start) for lo, hi in ranges if lo < end and hi > start]
        if not mine:
            if start >= ranges[-1][1]:
                break
            continue
        if table is None:
            table = blk[3] = BlockAccessor.for_block(ray.get(ref)).to_arrow()
        if len(mine) == 1:
            parts.append(table.slice(mine[0][0], mine[0][1] - mine[0][0]))
        else:
            idx = np.concatenate([np.arange(lo, hi) for lo, hi in mine])
            parts.append(table.take(pa.array(idx)))
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


class ElasticDataIterator(_data_iterator_base()):  # type: ignore[misc]  # Ray's base, imported lazily
    """What ``get_dataset_shard(name)`` returns for a split dataset: Ray's ``DataIterator``
    interface (``iter_batches``, ``iter_torch_batches``, ``iter_rows``; Ray's own argument
    handling for dtypes, device, collate_fn, pin_memory) over this rank's share of each
    global batch, with a position that survives resizes.

    Each ``iter_*`` call is one pass: it continues the current epoch from the position
    (restored, or where an earlier pass was left), and once the epoch's last batch has
    been yielded the position moves to the next epoch. Not supported here (``ValueError``):
    ``batch_size=None``, ``local_shuffle_buffer_size`` (it would make the rows trained
    differ from the rows counted), ``to_tf`` / ``iter_tf_batches`` / ``iter_jax_batches``
    / ``materialize`` (no block stream to hand over)."""

    def __init__(self, name: str, coord, shards: DataShards):
        self._name = name
        self._coord = coord
        self._shards = shards
        self._pass: Optional[_Pass] = None
        self._ctx = None

    # -- DataIterator's abstract methods ------------------------------------------------
    def _to_ref_bundle_iterator(self):
        raise ValueError(
            f"get_dataset_shard({self._name!r}) is split by raylastic with a resumable position; "
            "it supports iter_batches, iter_torch_batches and iter_rows only (not to_tf, "
            "iter_tf_batches, iter_jax_batches, to_torch or materialize).")

    def stats(self) -> str:
        import ray

        return f"raylastic split of {self._name!r}: {ray.get(self._coord.stats.remote())}"

    def schema(self):
        import ray

        return ray.get(self._coord.schema.remote())

    def get_context(self):
        from ray.data import DataContext

        if self._ctx is None:
            self._ctx = DataContext.get_current()
        return self._ctx

    def close(self) -> None:
        if self._pass is not None:
            self._pass.close()

    def position(self) -> DataPosition:
        """This dataset's position now (epoch, rows consumed in whole global batches)."""
        return DataPosition.from_dict(self._shards.positions()[self._name])

    # -- batches --------------------------------------------------------------------------
    def _iter_batches(self, *, prefetch_batches: int = 1, batch_size: Optional[int] = 256,
                      batch_format: Optional[str] = "default", drop_last: bool = False,
                      local_shuffle_buffer_size: Optional[int] = None,
                      local_shuffle_seed: Optional[int] = None, _collate_fn=None, _finalize_fn=None):
        from ray.data.block import BlockAccessor, _apply_batch_format
        from ray.data.iterator import _IterableFromIterator

        if batch_size is None or isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"get_dataset_shard({self._name!r}).iter_*(batch_size={batch_size!r}): a split "
                "dataset needs a positive int batch_size (its position is counted in global "
                "batches of batch_size x world_size rows).")
        if local_shuffle_buffer_size is not None:
            raise ValueError(
                f"get_dataset_shard({self._name!r}): local_shuffle_buffer_size is not supported "
                "on a split dataset (rows held in the buffer would be counted as trained). Fix: "
                "shuffle the dataset (ds.random_shuffle(seed=...) or .materialize() after "
                "random_shuffle()), or shuffle within each batch in the train function.")
        fmt_name = _apply_batch_format(batch_format)

        def fmt(table):
            batch = table if fmt_name == "pyarrow" else BlockAccessor.for_block(table).to_batch_format(fmt_name)
            if _collate_fn is not None:
                batch = _collate_fn(batch)
            if _finalize_fn is None:
                return batch, None
            done = _finalize_fn(batch)  # Ray's FinalizedData: the batch, and a hook to call
            return done.data, done.on_consume  # right before the batch goes to the user

        return _IterableFromIterator(lambda: self._yielding(batch_size, drop_last, fmt, prefetch_batches))

    def _yielding(self, batch_size: int, drop_last: bool, fmt, prefetch_batches: int):
        for (batch, on_consume), pos in self._run(batch_size, drop_last, 1, fmt, max(1, prefetch_batches) + 1):
            if on_consume is not None:
                on_consume()
            self._shards._advance(self._name, pos)  # consumed once yielded (docs/data.md)
            yield batch

    def iter_rows(self):
        from ray.data.block import BlockAccessor
        from ray.data.iterator import _IterableFromIterator

        def gen():
            for (table,), positions in self._run_items(1, False, _ROWS_PER_ITEM, lambda t: (t,), 2):
                acc = BlockAccessor.for_block(table)
                for row, pos in zip(acc.iter_rows(public_row_format=True), positions):
                    self._shards._advance(self._name, pos)
                    yield row

        return _IterableFromIterator(gen)

    def _run(self, batch_size, drop_last, m, fmt, depth):
        for payload, positions in self._run_items(batch_size, drop_last, m, fmt, depth):
            yield payload, positions[-1]

    def _run_items(self, batch_size, drop_last, m, fmt, depth):
        """Items (formatted payload, positions after each global batch in it), with the
        last item's last position moved to the next epoch. One pass at a time per dataset:
        starting one closes the previous."""
        if self._pass is not None:
            self._pass.close()
        start = self._shards._begin(self._name)
        p = self._pass = _Pass(self._coord, self._shards.group(), start, batch_size, drop_last, m, fmt, depth)
        try:
            while True:
                try:
                    item = p.q.get(timeout=0.5)
                except queue.Empty:
                    if p.stop.is_set() and not p.thread.is_alive():
                        raise RuntimeError(
                            f"this pass over {self._name!r} was closed: a newer iter_* call on "
                            "the same dataset started (one pass at a time per dataset)") from None
                    continue
                if item is _Pass._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                positions, payload = item
                yield payload, positions
        finally:
            p.close()


# --------------------------------------------------------------------------------------
# Driver side: coordinators and the train function wrapper
# --------------------------------------------------------------------------------------
class WithDatasets:
    """The train function, with ``get_dataset_shard`` answered from ``plan`` (installed on
    the rank's session before the function starts, so positions restore with it)."""

    def __init__(self, func: Callable, plan: DataPlan):
        self.func = func
        self.plan = plan

    def __call__(self, config: Dict[str, Any]) -> Any:
        # Here, not at the top: the worker module imports torch (loaded in the worker already).
        from raylastic import session as _session
        from raylastic._internal.worker_group.worker import _call

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
            raise ConfigError(f"datasets[{name!r}] is a function that returned a "
                              f"{type(value).__name__}, not a ray.data.Dataset.")
        out[name] = value
    return out


def start_coordinators(datasets: Dict[str, Any], split: Sequence[str], resources: Dict[str, float]) -> DataPlan:
    """One ``SplitCoordinator`` per split dataset (no CPU: Ray Data's own tasks do the
    work), pinned with ``resources`` (the head node: it must outlive worker nodes)."""
    import ray

    actor = ray.remote(SplitCoordinator).options(num_cpus=0, max_concurrency=8, max_restarts=0,
                                                 resources=resources)
    coords = {name: actor.remote(datasets[name], name) for name in split}
    return DataPlan(split=coords, whole={n: d for n, d in datasets.items() if n not in coords})


def stop_coordinators(plan: Optional[DataPlan]) -> None:
    import ray

    for handle in (plan.split.values() if plan is not None else ()):
        ray.kill(handle, no_restart=True)
