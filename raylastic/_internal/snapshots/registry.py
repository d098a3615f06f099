"""Who contributes state to a snapshot: one registry of ``state_dict()`` /
``load_state_dict()`` objects, and the ``Half`` protocol the tensor state implements.

Why one registry: every contributor is snapshotted, persisted and restored the same way
(as torchtitan's ``Stateful`` objects are), so a new one (a Hugging Face trainer's state,
a Lightning module's) needs a registration, not a special case in ``ElasticState``. Each
contributor has one place in a snapshot, which is also its place in ``elastic_state.pt``:

- ``tensors[name]``: the model's and optimizer's state dicts of a replicated model, copied
  into reused host buffers in the background (``capture``), striped over the ranks;
- ``plain["_objects"][name]``: small state dicts (LR scheduler, the elastic data loader,
  any object given as ``ElasticState(stateful={name: obj})``), deep-copied each commit;
- ``plain["attrs"]``: the user's plain attributes (``ElasticState(step=0)``);
- ``plain["datasets"]``: the Ray Data split positions (``raylastic.data``);
- ``rng``: this rank's RNG streams, restored only from its own snapshot in memory.

The tensors of a sharded model (FSDP2, a DeepSpeed engine) are not registry entries:
their state is the rank's shard, described piece by piece by an adapter
(``sharded/``). Replicated and sharded tensor state are the two implementations of
:class:`Half`, the one interface ``ElasticState`` drives.
"""

from __future__ import annotations

import copy
import random
from typing import Any, Callable, Dict, Mapping, Optional, Protocol, Tuple, Union

import torch

from raylastic._internal.state_values import storable_attr, storable_plain
from raylastic.errors import ConfigError

# ElasticState's own keywords: a stateful= object may not take their names
RESERVED = ("model", "optimizer", "lr_scheduler", "loader", "engine")


class Stateful(Protocol):
    """Anything with ``state_dict()`` / ``load_state_dict()`` (torch modules, optimizers,
    LR schedulers, the elastic data loader, torchtitan's ``Stateful``)."""

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state_dict: Dict[str, Any]) -> Any: ...


class Half(Protocol):
    """The tensor state of one ``ElasticState``: ``replicated.ReplicatedState`` (DDP or a
    single process: every rank holds the whole) or ``sharded.state.ShardedState`` (FSDP2,
    ZeRO: every rank holds its own shard)."""

    snapshot_on_stop: bool  # once a stop is asked for, snapshot every commit (whole copies)
    lean: bool  # one snapshot kept (``sharded/lean.py``): the store is trimmed, not recycled

    def capture(self, snap: Any, old: Optional[Any], persist: bool) -> Callable[[], None]:
        """Fill ``snap`` (tensors, holding) in ``old``'s buffers; returns ``start()``, to
        call once ``snap`` is in the store."""

    def writer(self, snap: Any) -> Optional[Callable[[str], None]]:
        """What this rank writes of a persisted ``snap`` (None: nothing)."""

    def restore_memory(self, index: int, snap: Optional[Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """Load in-memory snapshot ``index`` (``snap``: this rank's copy, if any); returns
        its (plain, rng). ValueError: it does not fit."""

    def restore_storage(self, directory: str, blob: Dict[str, Any]) -> None:
        """Load the tensors of the persisted checkpoint in ``directory``."""

    def shard_bytes(self) -> Optional[int]:
        """Bytes of this rank's own shard (sharded state), else None."""


class Attributes:
    """The user's plain attributes as a contributor (a restore updates, never removes)."""

    def __init__(self, values: Dict[str, Any]):
        self.values = values

    def state_dict(self) -> Dict[str, Any]:
        return copy.deepcopy(self.values)  # (a list attribute may have grown)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.values.update(copy.deepcopy(state_dict))


class DataPositions:
    """The Ray Data splits' positions (``raylastic.data``) as a contributor."""

    def __init__(self, data: Any):
        self._data = data

    def state_dict(self) -> Dict[str, Any]:
        return self._data.positions()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self._data.restore_positions(state_dict)


def check_stateful(stateful: Any) -> Dict[str, Stateful]:
    """``ElasticState(stateful=...)``: a dict of name -> object with ``state_dict`` and
    ``load_state_dict``; ConfigError naming the entry and the fix otherwise."""
    if stateful is None:
        return {}
    if not isinstance(stateful, Mapping):
        raise ConfigError(
            f"ElasticState(stateful={type(stateful).__name__}) must be a dict of name -> object "
            "with state_dict() and load_state_dict(). Fix: stateful={'name': obj}."
        )
    for name, obj in stateful.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(
                f"ElasticState(stateful=...) has the key {name!r}: names are non-empty strings. "
                "Fix: stateful={'name': obj}."
            )
        if name in RESERVED:
            raise ConfigError(
                f"ElasticState(stateful={{{name!r}: ...}}) takes a name ElasticState has a keyword "
                f"for. Fix: pass it as ElasticState({name}=...), or pick another name."
            )
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise ConfigError(
                f"ElasticState(stateful={{{name!r}: {type(obj).__name__}}}) has no state_dict() and "
                "load_state_dict(). Fix: register an object with both (torch modules, optimizers "
                "and LR schedulers have them), or wrap it in one."
            )
    return dict(stateful)


class Registry:
    """Every contributor of one ``ElasticState``, by its place in a snapshot."""

    def __init__(self, attrs: Dict[str, Any]):
        self.tensors: Dict[str, Stateful] = {}
        self.objects: Dict[str, Stateful] = {}
        self._labels: Dict[str, str] = {}  # how errors name an object
        self.attrs = Attributes({k: storable_attr(k, v) for k, v in attrs.items()})
        self.data: Optional[DataPositions] = None

    def add_data(self, data: Any) -> None:
        """The session's Ray Data splits (``raylastic.data``), if the run has any."""
        if data is not None:
            self.data = DataPositions(data)

    def add_tensors(self, name: str, obj: Optional[Stateful]) -> None:
        if obj is not None:
            self.tensors[name] = obj

    def add_objects(self, named: Mapping[str, Optional[Stateful]], stateful: Mapping[str, Stateful]) -> None:
        """``named``: the keyword arguments (``lr_scheduler``, ``loader``); ``stateful``:
        ``ElasticState(stateful=...)``'s objects, which errors name by that argument."""
        self.objects.update({k: o for k, o in named.items() if o is not None})
        for name, obj in stateful.items():
            self.objects[name] = obj
            self._labels[name] = f"ElasticState(stateful={{{name!r}: ...}})"

    def plain(self) -> Dict[str, Any]:
        """The snapshot's plain part, checked to load back with ``weights_only=True``."""
        plain = storable_plain(
            {
                "attrs": self.attrs.state_dict(),
                "_objects": {k: copy.deepcopy(o.state_dict()) for k, o in self.objects.items()},
            },
            self._labels,
        )
        if self.data is not None:  # the split datasets' positions ride with the snapshot
            plain["datasets"] = self.data.state_dict()
        return plain

    def load_plain(self, plain: Dict[str, Any], rng: Dict[str, Any]) -> None:
        """Load a snapshot's plain part (and ``rng``: a survivor keeps its RNG streams)."""
        saved = plain.get("_objects", {})
        for name, obj in self.objects.items():
            if name in saved:
                obj.load_state_dict(copy.deepcopy(saved[name]))
        self.attrs.load_state_dict(plain.get("attrs", {}))
        if plain.get("datasets") is not None and self.data is not None:
            self.data.load_state_dict(plain["datasets"])
        if rng:
            load_rng(rng)


def engine_module(engine: Any, model: Any, optimizer: Any) -> Any:
    """The model: ``engine.module`` for a DeepSpeed engine (which owns the module and the
    ZeRO optimizer, so model= and optimizer= are refused next to it), else ``model``."""
    if engine is None:
        return model
    if model is not None or optimizer is not None:
        raise ValueError(
            "ElasticState(engine=...) takes the DeepSpeed engine instead of model= and optimizer=: pass engine= alone"
        )
    module = getattr(engine, "module", None)
    if module is None:
        raise ValueError(
            f"ElasticState(engine={type(engine).__name__}) is not a DeepSpeed engine "
            "(no .module): pass the engine deepspeed.initialize() returned"
        )
    return module


def tensor_half(
    sess: Any,
    registry: Registry,
    model: Any,
    optimizer: Any,
    engine: Any,
    async_snapshot: bool,
    striped: bool,
    lean: Union[bool, str] = False,
) -> Half:
    """The sharded half (FSDP2 or DeepSpeed), or the replicated one over the registry's
    model and optimizer. Overlapping the copy with the next step needs a point where it
    must be over: the optimizer's next step(). Without an optimizer, copies are synchronous."""
    adapter: Any
    if engine is not None:
        from raylastic._internal.snapshots.sharded.deepspeed import DeepSpeedAdapter

        adapter = DeepSpeedAdapter(engine)
        optimizer = adapter.optimizer  # the torch optimizer inside ZeRO's (it has step hooks)
    else:
        from raylastic._internal.snapshots.sharded.fsdp2 import FSDP2Adapter, uses_dtensors

        if not uses_dtensors(model):
            from raylastic._internal.snapshots.replicated import ReplicatedState

            if lean:
                raise ConfigError(
                    f"ElasticState(lean_snapshots={lean!r}) is for sharded models (FSDP2 fully_shard, "
                    "DeepSpeed ZeRO through engine=); this model is replicated (DDP), whose "
                    "snapshots hold 2/W of the state each with striped=True. Fix: leave "
                    "lean_snapshots out, or shard the model"
                )
            registry.add_tensors("model", model)
            registry.add_tensors("optimizer", optimizer)
            return ReplicatedState(registry.tensors, sess, striped=striped, overlap=async_snapshot)
        adapter = FSDP2Adapter(model, optimizer)
    from raylastic._internal.snapshots.sharded.state import ShardedState

    return ShardedState(
        adapter,
        sess,
        lean=lean,
        overlap=bool(async_snapshot and optimizer is not None and hasattr(optimizer, "register_step_pre_hook")),
    )


def rng_state() -> Dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def load_rng(rng: Dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])


__all__ = [
    "Stateful",
    "Half",
    "Registry",
    "Attributes",
    "DataPositions",
    "check_stateful",
    "engine_module",
    "tensor_half",
    "rng_state",
    "load_rng",
    "RESERVED",
]
