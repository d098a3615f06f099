"""The rank side of Ray Data input: the position, the rows a rank reads, and the
``DataIterator`` a train function gets from ``get_dataset_shard`` for a split dataset.

Split from ``ray_data.py`` (the coordinator actor, the per-rank ``DataShards`` and the
driver's lifecycle), which imports this module; the design is in that module's docstring.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from raylastic.data.plan import shard_bounds

_BLOCKS_PER_CALL = 16  # block references asked of the coordinator per call
_ROWS_PER_ITEM = 256  # iter_rows: rows cut from the blocks at a time


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


def item_ranges(
    start: int, batch_size: int, world_size: int, rank: int, batches: int, total: Optional[int], drop_last: bool
) -> Tuple[List[Tuple[int, int]], bool]:
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
    ranges = [(start + i * span + rank * batch_size, start + i * span + (rank + 1) * batch_size) for i in range(full)]
    if total is None or full == batches:
        return ranges, total is not None and start + full * span >= total
    tail_start = start + full * span
    tail = total - tail_start
    if tail > 0 and not drop_last and tail >= world_size:
        lo, hi = shard_bounds(tail, rank, world_size)
        ranges.append((tail_start + lo, tail_start + hi))
    return ranges, True


# --------------------------------------------------------------------------------------
# Rank side: the iterator
# --------------------------------------------------------------------------------------
def _data_iterator_base():
    from ray.data import DataIterator

    return DataIterator


class _Pass:
    """One pass over this rank's rows (a background thread fetches blocks, cuts the
    rank's rows and formats them; the consumer yields them and moves the position)."""

    _END = object()

    def __init__(
        self,
        coord,
        group: Tuple[int, int, int],
        start: DataPosition,
        batch_size: int,
        drop_last: bool,
        batches_per_item: int,
        fmt: Callable[[Any], Any],
        depth: int,
    ):
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

    def __init__(
        self,
        name: str,
        coord,
        shards: Any,  # a ray_data.DataShards (which imports this module)
        options: Any = None,
    ):
        self._name = name
        self._coord = coord
        self._shards = shards
        self._pass: Optional[_Pass] = None
        self._ctx = None
        self._options = options  # the ExecutionOptions the dataset executes with (ingest_options)

    # -- DataIterator's abstract methods ------------------------------------------------
    def _to_ref_bundle_iterator(self):
        raise ValueError(
            f"get_dataset_shard({self._name!r}) is split by raylastic with a resumable position; "
            "it supports iter_batches, iter_torch_batches and iter_rows only (not to_tf, "
            "iter_tf_batches, iter_jax_batches, to_torch or materialize)."
        )

    def stats(self) -> str:
        import ray

        return f"raylastic split of {self._name!r}: {ray.get(self._coord.stats.remote())}"

    def schema(self):
        import ray

        return ray.get(self._coord.schema.remote())

    def get_context(self):
        """The rank's current ``DataContext`` with the dataset's execution options, as Ray
        Train's shard reports the options ``DataConfig`` resolved for that dataset."""
        import copy

        from ray.data import DataContext

        if self._ctx is None:
            self._ctx = DataContext.get_current()
            if self._options is not None:
                self._ctx = copy.deepcopy(self._ctx)
                self._ctx.execution_options = copy.deepcopy(self._options)
        return self._ctx

    def close(self) -> None:
        if self._pass is not None:
            self._pass.close()

    def position(self) -> DataPosition:
        """This dataset's position now (epoch, rows consumed in whole global batches)."""
        return DataPosition.from_dict(self._shards.positions()[self._name])

    # -- batches --------------------------------------------------------------------------
    def _iter_batches(
        self,
        *,
        prefetch_batches: int = 1,
        batch_size: Optional[int] = 256,
        batch_format: Optional[str] = "default",
        drop_last: bool = False,
        local_shuffle_buffer_size: Optional[int] = None,
        local_shuffle_seed: Optional[int] = None,
        _collate_fn=None,
        _finalize_fn=None,
    ):
        from ray.data.block import BlockAccessor, _apply_batch_format
        from ray.data.iterator import _IterableFromIterator

        if batch_size is None or isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(
                f"get_dataset_shard({self._name!r}).iter_*(batch_size={batch_size!r}): a split "
                "dataset needs a positive int batch_size (its position is counted in global "
                "batches of batch_size x world_size rows)."
            )
        if local_shuffle_buffer_size is not None:
            raise ValueError(
                f"get_dataset_shard({self._name!r}): local_shuffle_buffer_size is not supported "
                "on a split dataset (rows held in the buffer would be counted as trained). Fix: "
                "shuffle the dataset (ds.random_shuffle(seed=...) or .materialize() after "
                "random_shuffle()), or shuffle within each batch in the train function."
            )
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
                            "the same dataset started (one pass at a time per dataset)"
                        ) from None
                    continue
                if item is _Pass._END:
                    return
                if isinstance(item, BaseException):
                    raise item
                positions, payload = item
                yield payload, positions
        finally:
            p.close()
