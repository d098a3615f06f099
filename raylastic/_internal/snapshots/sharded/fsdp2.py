"""FSDP2 (``fully_shard``) models and their optimizers as sharded state: the adapter that
describes a rank's DTensor shards as pieces (see ``sharded/__init__``).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from raylastic._internal.snapshots.sharded.layout import Chunk, Piece, dtype_of, hyper_params, saved_scalar, state_key


def is_dtensor(t: Any) -> bool:
    """Without importing ``torch.distributed.tensor`` where nothing has: no DTensor can
    exist before its module is imported, and the import (sympy, symbolic shapes) took
    0.7-1 CPU-s of a worker's start whose model has none (2026-11-27)."""
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def uses_dtensors(model: Optional[torch.nn.Module]) -> bool:
    return model is not None and any(is_dtensor(p) for p in model.parameters())


def _dtensor_chunk(key: str, t: Any) -> Piece:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = t._local_tensor  # the rank's shard, sharing storage with the parameter
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(
            f"{key}: local shard shape {tuple(local.shape)} differs from the placement's "
            f"{tuple(shape)} (padded or strided shards are not supported; {_mesh_view(t)})"
        )
    return Chunk(key, tuple(t.shape), tuple(offset), tuple(local.shape), str(local.dtype)), local


def _mesh_view(t: Any) -> str:
    """Which rank the DTensor's mesh and the process group each say this is, for when a
    shard's shape differs from its placement. Seen once (an FSDP2 3-2-3 test, 2026-11-27):
    most likely a mesh kept from an earlier attempt at another rank, which DTensor's
    per-thread caches handed back until the train thread cleared them (2026-11-28)."""
    import torch.distributed as dist

    try:
        mesh = t.device_mesh
        return (
            f"mesh {mesh.mesh.tolist()} coordinate {mesh.get_coordinate()} local rank "
            f"{mesh.get_local_rank()}; process group rank {dist.get_rank()} of {dist.get_world_size()}"
        )
    except Exception as e:  # noqa: BLE001 - a diagnostic only
        return f"mesh not readable: {e!r}"


def _local(t: Any) -> torch.Tensor:
    return t._local_tensor if is_dtensor(t) else t


def _whole_chunk(key: str, t: torch.Tensor) -> Piece:
    return Chunk(key, tuple(t.shape), (0,) * t.dim(), tuple(t.shape), str(t.dtype)), t


def _piece(key: str, t: torch.Tensor) -> Piece:
    return _dtensor_chunk(key, t) if is_dtensor(t) else _whole_chunk(key, t)


class FSDP2Adapter:
    """FSDP2 (``fully_shard``) model + optimizer as chunks.

    Keys are parameter and buffer names (FSDP2 keeps the module's FQNs) and
    ``optim/<param name>/<state name>`` for each tensor of the optimizer's per-parameter
    state that has the parameter's shape. Scalar per-parameter state (Adam's ``step``),
    the param groups' hyper-parameters and non-tensor state are ``plain``: the same on
    every rank."""

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]):
        self.model = model
        self.optimizer = optimizer
        self._names = {id(p): n for n, p in model.named_parameters()}

    def _optim_items(self) -> Iterable[Tuple[str, str, Any]]:
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                name = self._names.get(id(p))
                if name is None:
                    raise ValueError(
                        "the optimizer holds a parameter that is not the model's: register the "
                        "model the optimizer was built on (ElasticState(model=..., optimizer=...))"
                    )
                for k, v in self.optimizer.state.get(p, {}).items():
                    yield name, k, v

    def live_chunks(self) -> List[Piece]:
        out: List[Piece] = [
            _piece(f"model/{n}", p.detach() if not is_dtensor(p) else p) for n, p in self.model.named_parameters()
        ]
        out += [_whole_chunk(f"buffer/{n}", b) for n, b in self.model.named_buffers()]
        for name, k, v in self._optim_items():
            if isinstance(v, torch.Tensor) and (is_dtensor(v) or v.dim() > 0):
                out.append(_piece(f"optim/{name}/{k}", v))
        return out

    def plain(self) -> Dict[str, Any]:
        scalars: Dict[str, Dict[str, Any]] = {}
        for name, k, v in self._optim_items():
            if isinstance(v, torch.Tensor) and (is_dtensor(v) or v.dim() > 0):
                continue
            scalars.setdefault(name, {})[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
        groups = [hyper_params(g) for g in self.optimizer.param_groups] if self.optimizer is not None else []
        return {
            "framework": "fsdp2",
            "optimizer": type(self.optimizer).__name__ if self.optimizer else None,
            "scalars": scalars,
            "param_groups": groups,
        }

    def restore_targets(self, saved: Optional[Iterable[Chunk]] = None) -> List[Piece]:
        """The pieces to fill. A new optimizer has no moments yet: with ``saved`` (the
        restored state's chunks) they are made empty, one per saved key, to be filled;
        without it (a rank holding none of the snapshot), by a zero-gradient step with lr
        0, as ``torch.distributed.checkpoint`` does. That step took 0.46-0.65 s of a ~1 s
        restore (51.6M parameters, 2 workers on 2 shared cores, 2026-12-07)."""
        if self.optimizer is not None and not self.optimizer.state:
            if saved is None or not self._make_moments(saved):
                from torch.distributed.checkpoint.state_dict import _init_optim_state

                _init_optim_state(self.optimizer)
        return self.live_chunks()

    def _make_moments(self, saved: Iterable[Chunk]) -> bool:
        """An empty tensor like its parameter (a DTensor of the same placement) for every
        saved ``optim/<param>/<state>`` key; the scalars come in ``finish_restore``. False,
        making nothing, when there is no such key, or one does not name a parameter of this
        optimizer or has another shape: the zero-gradient step makes the moments then."""
        assert self.optimizer is not None
        mine = {self._names[id(p)]: p for g in self.optimizer.param_groups for p in g["params"] if id(p) in self._names}
        made: Dict[Any, Dict[str, torch.Tensor]] = {}
        for c in saved:
            named = state_key(c.key, "optim")
            if named is None:
                continue
            name, k = named
            p = mine.get(name)
            if p is None or tuple(c.global_shape) != tuple(p.shape):
                return False
            if k not in made.setdefault(p, {}):  # (each old shard lists the key)
                made[p][k] = torch.empty_like(p.detach(), dtype=dtype_of(c.dtype))
        for p, moments in made.items():
            self.optimizer.state[p].update(moments)
        return bool(made)

    def finish_restore(self, plain: Dict[str, Any]) -> None:
        if plain.get("framework") != "fsdp2":
            raise ValueError(f"the snapshot was taken with {plain.get('framework')!r}, not FSDP2")
        if self.optimizer is None:
            return
        if plain.get("optimizer") != type(self.optimizer).__name__:
            raise ValueError(
                f"the snapshot's optimizer is {plain.get('optimizer')}, this one is {type(self.optimizer).__name__}"
            )
        groups = plain.get("param_groups", [])
        if len(groups) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the snapshot has {len(groups)} optimizer param groups, this optimizer "
                f"{len(self.optimizer.param_groups)}"
            )
        for g, saved in zip(self.optimizer.param_groups, groups):
            g.update(hyper_params(saved))
        scalars = plain.get("scalars", {})
        by_name = {n: p for n, p in self.model.named_parameters()}
        groups_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for name, vals in scalars.items():
            p = by_name[name]
            st = self.optimizer.state[p]
            for k, v in vals.items():
                cur = st.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor):
                    cur.copy_(v)
                elif isinstance(v, torch.Tensor):
                    st[k] = saved_scalar(v, groups_of.get(id(p), {}), _local(p).device)
                else:
                    st[k] = v


__all__ = ["FSDP2Adapter", "uses_dtensors", "is_dtensor"]
