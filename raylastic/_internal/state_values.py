"""What ``ElasticState`` may hold: values that come back from ``torch.load(weights_only=True)``.

Why: a persisted snapshot is read back with ``weights_only=True`` (a checkpoint in the
bucket must not run code when loaded), and that unpickler accepts only a fixed set of
types. ``torch.save`` writes anything, so an attribute such as ``numpy.float64`` used to
save fine and then fail the load, which the user only found out when restoring after a
failure, the one moment a checkpoint is needed. So every value is checked when it is
registered (``ElasticState(step=...)``, ``state.step = ...``), and each snapshot's plain
part again at ``commit()`` (a list attribute can be appended to without ``__setattr__``).

Allowed, as torch's ``weights_only`` unpickler accepts them by default: ``None``, ``bool``,
``int``, ``float``, ``complex``, ``str``, ``bytes``, ``bytearray``; ``torch.Tensor`` and
``torch.nn.Parameter``; ``torch.Size``, ``torch.dtype``, ``torch.device``; ``list``,
``tuple``, ``set``, ``dict``, ``collections.OrderedDict`` and ``collections.Counter`` of
those; and any class the user registered with ``torch.serialization.add_safe_globals``
(their own promise that loading it is safe).

Converted, because it is lossless: a numpy scalar (``numpy.float64``, ``numpy.int64``,
``numpy.float32``, ``numpy.bool_``, ``numpy.str_``, ...) becomes the Python value of
``.item()`` (the same number; a ``numpy.float32`` is then a Python float, float64
arithmetic). Refused with a ``ConfigError`` naming the attribute and the fix: numpy
arrays, subclasses of the containers (``defaultdict``, named tuples), tensor subclasses
and any other object.
"""

from __future__ import annotations

import sys
from collections import Counter, OrderedDict
from typing import Any, Dict, Optional, Set

import torch

from raylastic._internal.validate import is_int
from raylastic.errors import ConfigError

_ATOMS = frozenset(
    {
        type(None),
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        bytearray,
        torch.Size,
        torch.dtype,
        torch.device,
        torch.Tensor,
        torch.nn.Parameter,
    }
)
_SEQUENCES = (list, tuple, set)
_MAPPINGS = (dict, OrderedDict, Counter)
_PLAIN = "plain Python values (None, bool, int, float, str, bytes), tensors, or lists, tuples, dicts and sets of them"


# ``ElasticState(lean_snapshots=IN_PLACE)``: the peer copy lands in the buffers it replaces
# (``snapshots/sharded/lean.py``).
IN_PLACE = "in_place"


def check_state_args(
    *, persist_every: Any, snapshot_every: Any, async_snapshot: Any, striped: Any, lean_snapshots: Any = False
) -> None:
    """``ElasticState``'s own keyword arguments (a bool is not a count)."""

    def bad(name: str, value: Any, want: str, fix: str) -> ConfigError:
        return ConfigError(f"ElasticState({name}={value!r}) must be {want}. Fix: {fix}.")

    if not is_int(snapshot_every) or snapshot_every < 1:
        raise bad("snapshot_every", snapshot_every, "an int >= 1", "pass 1 (every commit) or k (every k-th)")
    if persist_every is not None and (not is_int(persist_every) or persist_every < 1):
        raise bad(
            "persist_every",
            persist_every,
            "an int >= 1 or None (CheckpointConfig.persist_every)",
            "pass N to write every N-th snapshot to storage, or leave it out",
        )
    for name, value in (("async_snapshot", async_snapshot), ("striped", striped)):
        if not isinstance(value, bool):
            raise bad(name, value, "True or False", f"pass {name}=True or {name}=False")
    if not isinstance(lean_snapshots, bool) and lean_snapshots != IN_PLACE:
        raise bad(
            "lean_snapshots",
            lean_snapshots,
            f"True, False or {IN_PLACE!r}",
            f"pass lean_snapshots=True (3x the own shard at a commit's peak), {IN_PLACE!r} (2x; a loss "
            "during a commit's peer copy restores from storage) or False (docs/sharded.md)",
        )


def storable_attr(name: str, value: Any) -> Any:
    """``value`` as it will be snapshotted for attribute ``name`` (numpy scalars made
    Python scalars), or ``ConfigError`` naming the attribute and the fix."""
    return storable(value, f"ElasticState attribute {name!r}")


def storable_plain(plain: Dict[str, Any], labels: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """A snapshot's plain part (attributes, the loader's, LR scheduler's and ``stateful=``
    objects' state dicts), checked and converted in place: it is what
    ``torch.load(weights_only=True)`` reads back. ``labels``: how an error names an object
    (default ``ElasticState(<name>=...)``)."""
    labels = labels or {}
    plain["attrs"] = {k: storable_attr(k, v) for k, v in plain["attrs"].items()}
    plain["_objects"] = {
        k: storable(v, f"{labels.get(k, f'ElasticState({k}=...)')}.state_dict()") for k, v in plain["_objects"].items()
    }
    return plain


def storable(value: Any, where: str, _path: Optional[Set[int]] = None) -> Any:
    """``value`` if ``torch.load(weights_only=True)`` reads it back as it is, a lossless
    conversion of it, or ``ConfigError``. Containers are rebuilt only if a member changed."""
    t = type(value)
    if t in _ATOMS:
        return value
    if t in _SEQUENCES or t in _MAPPINGS:
        if t in _SEQUENCES and _ATOMS.issuperset(map(type, value)):
            return value  # the common case (a list of losses), at C speed: commit() runs every step
        if t in _MAPPINGS and _ATOMS.issuperset(map(type, value)) and _ATOMS.issuperset(map(type, value.values())):
            return value
        path = _path if _path is not None else set()
        if id(value) in path:  # a container that holds itself: pickle keeps the cycle
            return value
        path.add(id(value))
        try:
            if t in _MAPPINGS:
                items = [
                    (storable(k, f"{where} key {k!r}", path), storable(v, f"{where}[{k!r}]", path))
                    for k, v in value.items()
                ]
                if all(k2 is k and v2 is v for (k2, v2), (k, v) in zip(items, value.items())):
                    return value
                out: Any = t()  # dict, OrderedDict or Counter
                for k, v in items:
                    out[k] = v
                return out
            items = [
                storable(v, f"{where} element {v!r}" if t is set else f"{where}[{i}]", path)
                for i, v in enumerate(value)
            ]
            return value if all(a is b for a, b in zip(items, value)) else t(items)
        finally:
            path.discard(id(value))
    converted = _numpy_scalar(value)
    if converted is not _NOT_NUMPY:
        return converted
    if t in _safe_globals():
        return value
    raise ConfigError(
        f"{where} is a {_name(t)}: it would be saved with the snapshot, "
        "then refused by torch.load(weights_only=True) when a restore reads it back from "
        f"storage. ElasticState holds {_PLAIN}. Fix: {_fix(value)}."
    )


_NOT_NUMPY = object()


def _numpy_scalar(value: Any) -> Any:
    np = sys.modules.get("numpy")  # never imported here: a numpy value means numpy is loaded
    if np is None or not isinstance(value, (np.bool_, np.number, np.str_, np.bytes_)):
        return _NOT_NUMPY
    item = value.item()
    if type(item) in (bool, int, float, complex, str, bytes):
        return item
    return _NOT_NUMPY  # numpy.longdouble: .item() keeps it (a Python float would round it)


def _name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _fix(value: Any) -> str:
    np = sys.modules.get("numpy")
    cls = _name(type(value))
    if np is not None and isinstance(value, np.ndarray):
        return "store torch.from_numpy(x) (a tensor) or x.tolist(); x.item() for a single value"
    if np is not None and isinstance(value, np.generic):
        return "convert it with .item() or int()/float()/str() to a Python value"
    if isinstance(value, torch.Tensor):
        return (
            "store a plain tensor (t.as_subclass(torch.Tensor)), or register the class with "
            f"torch.serialization.add_safe_globals([{cls}]) if loading it is safe"
        )
    for base, plain in (
        (dict, "dict"),
        (list, "list"),
        (tuple, "tuple"),
        (set, "set"),
        (frozenset, "set"),
        (str, "str"),
        (int, "int"),
        (float, "float"),
        (bytes, "bytes"),
    ):
        if isinstance(value, base):  # a defaultdict, a named tuple, an IntEnum, ...
            return f"store {plain}(x), a plain {plain}"
    return (
        f"store the object's plain state (numbers, strings, tensors; e.g. vars(x)) and rebuild it after "
        f"a restore, or register the class with torch.serialization.add_safe_globals([{cls}]) if "
        "loading it is safe"
    )


def _safe_globals() -> Set[type]:
    """Classes the user allowed for ``weights_only`` loads (``add_safe_globals``)."""
    out: Set[type] = set()
    for entry in torch.serialization.get_safe_globals():
        obj = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(obj, type):
            out.add(obj)
    return out
