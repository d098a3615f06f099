"""DeepSpeed ZeRO-1/2/3 engines as sharded state (see ``sharded/__init__``): the adapter that
lets ``ElasticState(engine=...)`` snapshot each rank's ZeRO partition and restore it at
another world size, in memory.

Why per-parameter pieces: a ZeRO partition is a slice of a flat buffer whose cut points
move with the world size (and, for ZeRO-1/2, with the padding and alignment of each
param group), so the partition itself cannot be re-cut. What stays put is each
parameter: its fp32 master weight and each optimizer moment, flattened, are the same
logical tensors at every world size and every stage. A rank's share of one of them is
one contiguous 1-D range, and DeepSpeed itself exposes that range as a live view:

* ZeRO-1/2: ``param._hp_mapping`` (a ``deepspeed.utils.tensor_fragment``): the range in
  the flattened parameter (``lp_fragment_address``), the fp32 master slice
  (``hp_fragment``) and the moments (``optim_fragment``), all views into the rank's flat
  partition and the optimizer's state. DeepSpeed's universal checkpoint is built on
  these same fragments.
* ZeRO-3: ``param.ds_tensor`` is the rank's partition ``[rank * n, (rank + 1) * n)`` of
  the flattened parameter (the last ones padded); the fp32 master and moment slices are
  what ``deepspeed.utils.safe_get_local_fp32_param`` / ``safe_get_local_optimizer_state``
  return (without their device copy, so they stay live).

Restoring uses DeepSpeed's own steps after a universal-checkpoint load: a fresh engine
gets its optimizer moments from a zero-gradient, zero-learning-rate step (as
``torch.distributed.checkpoint`` does, and as ``FSDP2Adapter`` does), ZeRO-1/2 links the
fragments to them (``_lazy_init_hp_params_optimizer_state``), the fp32 master weights
reach the model's parameters with ``update_lp_params`` (ZeRO-1/2, an all-gather) or the
step's own copy-and-unflatten plus the persistent parameters' all-gather (ZeRO-3).

Not covered (raises ValueError at construction, before anything is taken): ZeRO stage 0
(a replicated model: use ``ElasticState(model=..., optimizer=...)``), optimizer state
swapped to NVMe, and MoE / expert-parallel or tensor-parallel groups (their partitions
are not over the data-parallel world alone).

One thing outside the adapter that DeepSpeed needs from raylastic: DeepSpeed caches the
process groups it derives from the default one (``deepspeed.utils.groups._WORLD_GROUP``);
after ``torch.distributed.destroy_process_group()`` the cache points at a destroyed
group and the next ``deepspeed.initialize`` fails ("Group ... is not registered").
:func:`release_deepspeed_groups` drops that cache; the process-group teardown calls it.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from raylastic._internal.snapshots.sharded.layout import Chunk, Piece, dtype_of, hyper_params, saved_scalar, state_key

FRAMEWORK = "deepspeed"


def release_deepspeed_groups() -> None:
    """Forget the process groups DeepSpeed cached from the default group, so that a
    ``deepspeed.initialize`` after the group was destroyed and re-formed (a resize) builds
    them anew. A no-op when DeepSpeed was never imported. Call it right after
    ``torch.distributed.destroy_process_group()``."""
    groups = sys.modules.get("deepspeed.utils.groups")
    release = getattr(groups, "_release_process_group_references", None)
    if release is not None:
        release(None)
    _reset_zero3_ids()


def _reset_zero3_ids() -> None:
    """ZeRO-3 numbers modules and parameters with process-global counters that no new
    engine resets: module ids come from a mutable default argument
    (``DeepSpeedZeRoOffload._register_deepspeed_module(count=[0])``), parameter ids from
    ``Init.param_id``. After a resize a surviving worker (its second engine) and a worker
    that joined (its first) would number the same modules differently, and ZeRO-3's first
    trace check fails ("Detected a disagreement on list contents between rank0 and rankN").
    Reset with the groups, so every rank's next engine numbers from 0."""
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    cls = getattr(offload, "DeepSpeedZeRoOffload", None)
    defaults = getattr(getattr(cls, "_register_deepspeed_module", None), "__defaults__", None)
    if defaults and isinstance(defaults[0], list) and defaults[0]:
        defaults[0][0] = 0
    params = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    init = getattr(params, "Init", None)
    if init is not None:
        init.param_id = 0


def _is_zero3(opt: Any) -> bool:
    return hasattr(opt, "fp32_partitioned_groups_flat")


class DeepSpeedAdapter:
    """A DeepSpeed engine (ZeRO stage 1, 2 or 3) as :class:`~raylastic._internal.snapshots.sharded.layout.Chunk` s.

    Keys: ``zero/<param name>/fp32`` for the fp32 master weight and
    ``zero/<param name>/<state>`` (``exp_avg``, ``exp_avg_sq``, ...) for each optimizer
    tensor of the parameter's size; global shape ``(numel,)``; a rank's piece is its
    fragment ``(start,), (n,)``. ``plain`` carries the optimizer's step and
    hyper-parameters, the engine's counters, the LR scheduler, the loss scaler and the
    configuration the state depends on (stage, dtypes, optimizer class, parameters)."""

    def __init__(self, engine: Any):
        opt: Any = getattr(engine, "optimizer", None)
        stage = engine.zero_optimization_stage() if hasattr(engine, "zero_optimization_stage") else None
        if stage not in (1, 2, 3):
            raise ValueError(
                f"ElasticState(engine=...) needs a DeepSpeed engine with ZeRO stage 1, 2 or 3 "
                f"(zero_optimization.stage is {stage}); for stage 0 the model is replicated: "
                "pass ElasticState(model=engine.module, optimizer=<the torch optimizer>)"
            )
        base = getattr(opt, "optimizer", None)
        if not isinstance(base, torch.optim.Optimizer):
            raise ValueError(
                f"the engine's ZeRO optimizer wraps {type(base).__name__}, not a torch optimizer: "
                "build the engine with an optimizer (config 'optimizer' or optimizer=)"
            )
        if getattr(opt, "swap_optimizer", False) or getattr(engine, "zero_nvme_offload_optimizer", lambda: False)():
            raise ValueError(
                "ElasticState(engine=...) does not support optimizer state swapped to NVMe "
                "(zero_optimization.offload_optimizer.device='nvme'): use 'cpu' or no offload"
            )
        if getattr(engine, "has_moe_layers", False):
            raise ValueError("ElasticState(engine=...) does not support MoE / expert-parallel engines")
        mpu = getattr(opt, "mpu", None)
        if mpu is not None:
            raise ValueError("ElasticState(engine=...) does not support tensor/pipeline-parallel engines (mpu=)")
        self.engine = engine
        self.model = engine.module
        self.stage = stage
        self.zero = opt
        # The torch optimizer whose step() writes the fp32 master weights and moments in
        # place: the snapshot copy must be over before it runs (its pre-step hook).
        self.optimizer = base
        self._names: Dict[Any, str] = dict(opt.param_names)
        self._lp_groups: List[List[Any]] = opt.fp16_groups if _is_zero3(opt) else opt.bit16_groups

    # -- pieces ------------------------------------------------------------------------------
    def _name(self, p: Any) -> str:
        name = self._names.get(p)
        if name is None:
            raise ValueError("the ZeRO optimizer holds a parameter that is not the engine module's")
        return name

    def _zero3_range(self, p: Any) -> Tuple[int, int]:
        """(start, valid elements) of this rank's ZeRO-3 partition of ``p``."""
        rank = self.zero._get_param_partition_rank(p)
        per = p.ds_tensor.ds_numel  # partition size; the last partitions are padded
        start = rank * per
        return start, max(0, min(per, p.ds_numel - start))

    def _zero3_view(self, p: Any, key: Any = None) -> torch.Tensor:
        # What safe_get_local_fp32_param / safe_get_local_optimizer_state return, minus their
        # .to(device), which would copy where the optimizer is offloaded to the CPU.
        view, _group = self.zero._get_fp32_opt_state_partition(p, release_swap_buffers=False, optim_state_key=key)
        return view

    def _state_keys(self, flat: torch.Tensor) -> List[str]:
        st = self.optimizer.state.get(flat, {})
        return sorted(k for k, v in st.items() if isinstance(v, torch.Tensor) and v.shape == flat.shape)

    def live_chunks(self) -> List[Piece]:
        out: List[Piece] = []
        if _is_zero3(self.zero):
            for g, lps in enumerate(self._lp_groups):
                flat = self.zero.fp32_partitioned_groups_flat[g]
                keys = self._state_keys(flat)
                for p in lps:
                    if not p.requires_grad:
                        continue
                    start, n = self._zero3_range(p)
                    if n == 0:
                        continue
                    name = self._name(p)
                    for k in [None] + keys:
                        t = self._zero3_view(p, k).narrow(0, 0, n)
                        key = f"zero/{name}/{k or 'fp32'}"
                        out.append((Chunk(key, (p.ds_numel,), (start,), (n,), str(t.dtype)), t))
            return out
        for lps, flat in zip(self._lp_groups, self.zero.single_partition_of_fp32_groups):
            # The moments are cut from the flat partition's state here, not taken from the
            # parameter's ``optim_fragment``: ZeRO-1/2 links those once, after the first
            # group's first step, when the other groups have no state yet, so a second
            # group's moments were never in a snapshot (DeepSpeed 0.19.8, 2026-12-07).
            st = self.optimizer.state.get(flat, {})
            keys = self._state_keys(flat)
            for p in lps:
                m = getattr(p, "_hp_mapping", None)
                if m is None:  # no part of this parameter in this rank's partition
                    continue
                name = self._name(p)
                start, n = m.lp_fragment_address.start, m.lp_fragment_address.numel
                hp = m.hp_fragment_address
                tensors = [("fp32", m.hp_fragment)] + [(k, st[k].narrow(0, hp.start, hp.numel)) for k in keys]
                for k, t in tensors:
                    out.append((Chunk(f"zero/{name}/{k}", (p.numel(),), (start,), (n,), str(t.dtype)), t))
        return out

    # -- plain state ---------------------------------------------------------------------------
    def _flats(self) -> List[List[torch.Tensor]]:
        """The flat fp32 partitions the torch optimizer steps, per param group of it.
        (ZeRO-3 puts a sub-group's partition into its param group only for the length of
        its step, so the groups' ``params`` lists are empty between steps.)"""
        if not _is_zero3(self.zero):
            return [[f] for f in self.zero.single_partition_of_fp32_groups]
        out: List[List[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
        for sg, flat in enumerate(self.zero.fp32_partitioned_groups_flat):
            out[self.zero.sub_group_to_group_id[sg]].append(flat)
        return out

    def _fingerprint(self) -> Dict[str, Any]:
        lp = next((p for ps in self._lp_groups for p in ps), None)
        return {
            "framework": FRAMEWORK,
            "stage": self.stage,
            "param_dtype": str(lp.dtype) if lp is not None else None,
            "bf16": bool(self.engine.bfloat16_enabled()),
            "fp16": bool(self.engine.fp16_enabled()),
            "optimizer": type(self.optimizer).__name__,
            "params": [
                (self._name(p), int(p.ds_numel if hasattr(p, "ds_numel") else p.numel()))
                for ps in self._lp_groups
                for p in ps
            ],
        }

    def plain(self) -> Dict[str, Any]:
        scalars: List[Dict[str, Any]] = []
        for flats in self._flats():
            # every flat partition of a group took the same steps: keep the first one's
            st: Dict[str, Any] = next((self.optimizer.state[f] for f in flats if f in self.optimizer.state), {})
            scalars.append(
                {
                    k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in st.items()
                    if not (isinstance(v, torch.Tensor) and v.dim() > 0)
                }
            )
        eng = self.engine
        sched = getattr(eng, "lr_scheduler", None)
        return {
            **self._fingerprint(),
            "param_groups": [hyper_params(g) for g in self.optimizer.param_groups],
            "scalars": scalars,
            "counters": {
                k: getattr(eng, k)
                for k in ("global_steps", "global_samples", "skipped_steps", "micro_steps")
                if hasattr(eng, k)
            },
            "lr_scheduler": sched.state_dict() if sched is not None and hasattr(sched, "state_dict") else None,
            "loss_scaler": self._loss_scaler_state(),
        }

    def _loss_scaler_state(self) -> Dict[str, Any]:
        """The loss scaler's numbers (not the object: a storage checkpoint's plain state is
        loaded with ``weights_only=True``)."""
        scaler = getattr(self.zero, "loss_scaler", None)
        out: Dict[str, Any] = {
            k: getattr(self.zero, k)
            for k in ("dynamic_loss_scale", "overflow")
            if isinstance(getattr(self.zero, k, None), bool)
        }
        if scaler is not None:
            out["scaler"] = type(scaler).__name__
            out["scaler_state"] = {
                k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                for k, v in vars(scaler).items()
                if isinstance(v, (bool, int, float, str, type(None), torch.Tensor))
            }
        return out

    # -- restore -------------------------------------------------------------------------------
    @torch.no_grad()
    def _init_optimizer_state(self, saved: Optional[Iterable[Chunk]] = None) -> None:
        """Create the moments a fresh engine does not have yet (torch optimizers make them at
        their first step). With ``saved`` (the restored state's chunks): zeros for each
        moment key saved for a group's parameters over that group's flat partition (groups
        may keep different state: amsgrad in one only; zeros: a partition's padding has no
        saved piece), a memset where the step below costs an optimizer step. Else one step
        on zero gradients with learning rate 0, as ``torch.distributed.checkpoint``'s
        ``_init_optim_state`` does, over the flat partitions (placed in their param groups
        as ZeRO's own step places them)."""
        opt, flats = self.optimizer, self._flats()
        if any(f in opt.state for fs in flats for f in fs):
            return
        if saved is not None and self._make_moments(saved):
            return
        kept = [(g["params"], g.get("lr")) for g in opt.param_groups]
        grads = [(f, f.grad) for fs in flats for f in fs]  # CPU offload keeps gradient buffers attached
        try:
            for g, fs in zip(opt.param_groups, flats):
                g["params"] = list(fs)
                if "lr" in g:
                    g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
            for f, _g in grads:
                f.grad = torch.zeros_like(f)
            opt.step()
        finally:
            for g, (params, lr) in zip(opt.param_groups, kept):
                g["params"] = params
                if lr is not None:
                    g["lr"] = lr
            for f, grad in grads:
                f.grad = grad

    def _make_moments(self, saved: Iterable[Chunk]) -> bool:
        """The zeros of ``_init_optimizer_state``; False, making nothing, when a saved key
        names no parameter of this engine or none is a moment."""
        group_of = {self._names.get(p): i for i, lps in enumerate(self._lp_groups) for p in lps}
        moments: Dict[int, Dict[str, str]] = {}
        for c in saved:
            name, k = state_key(c.key, "zero") or ("", "fp32")
            if k == "fp32":
                continue
            if name not in group_of:
                return False
            moments.setdefault(group_of[name], {})[k] = c.dtype
        zero3 = _is_zero3(self.zero)
        for i, keys in moments.items():
            f = self.zero.fp32_partitioned_groups_flat[i] if zero3 else self.zero.single_partition_of_fp32_groups[i]
            self.optimizer.state[f].update({k: torch.zeros_like(f, dtype=dtype_of(d)) for k, d in keys.items()})
        return bool(moments)

    def restore_targets(self, saved: Optional[Iterable[Chunk]] = None) -> List[Piece]:
        if _is_zero3(self.zero):
            self.zero.checkpoint_event_prologue()  # release gathered parameters to their partitions
        self._init_optimizer_state(saved)
        if not _is_zero3(self.zero):
            # link each parameter's optim_fragment to the (new) moments, as the first step()
            # does, for DeepSpeed's own safe_get_*_optimizer_state (``live_chunks`` cuts the
            # moments from the flat partitions instead: see there)
            self.zero._lazy_init_hp_params_optimizer_state()
        return self.live_chunks()

    def check(self, plain: Dict[str, Any]) -> None:
        """ValueError naming the difference when ``plain`` was taken from another
        configuration (stage, precision, optimizer, parameters)."""
        if plain.get("framework") != FRAMEWORK:
            raise ValueError(f"the state was taken with {plain.get('framework')!r}, not a DeepSpeed engine")
        mine = self._fingerprint()
        if plain.get("stage") != mine["stage"]:
            raise ValueError(
                f"the state was taken with ZeRO stage {plain.get('stage')}, this engine runs "
                f"stage {mine['stage']} (zero_optimization.stage)"
            )
        for k, what in (("param_dtype", "parameter dtype"), ("bf16", "bf16"), ("fp16", "fp16")):
            if plain.get(k) != mine[k]:
                raise ValueError(
                    f"the state was taken with {what} {plain.get(k)}, this engine has {mine[k]} "
                    "(a mixed-precision change)"
                )
        scaler = getattr(self.zero, "loss_scaler", None)
        theirs = plain.get("loss_scaler", {}).get("scaler")
        if scaler is not None and theirs is not None and theirs != type(scaler).__name__:
            raise ValueError(
                f"the state was taken with loss scaler {theirs}, this engine has "
                f"{type(scaler).__name__} (a mixed-precision change)"
            )
        if plain.get("optimizer") != mine["optimizer"]:
            raise ValueError(
                f"the state was taken with optimizer {plain.get('optimizer')}, this engine uses {mine['optimizer']}"
            )
        if [tuple(x) for x in plain.get("params", [])] != mine["params"]:
            theirs = {n: s for n, s in plain.get("params", [])}
            ours = dict(mine["params"])
            diff = sorted(set(theirs.items()) ^ set(ours.items()))
            raise ValueError(f"the state was taken from another architecture: parameters differ at {diff[:4]}")
        if len(plain.get("param_groups", [])) != len(self.optimizer.param_groups):
            raise ValueError(
                f"the state has {len(plain.get('param_groups', []))} optimizer param groups, "
                f"this engine {len(self.optimizer.param_groups)}"
            )

    @torch.no_grad()
    def finish_restore(self, plain: Dict[str, Any]) -> None:
        self.check(plain)
        for g, saved in zip(self.optimizer.param_groups, plain["param_groups"]):
            g.update(hyper_params(saved))
        for g, flats, vals in zip(self.optimizer.param_groups, self._flats(), plain["scalars"]):
            for f in flats:
                st = self.optimizer.state[f]
                for k, v in vals.items():
                    cur = st.get(k)
                    if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and cur.shape == v.shape:
                        cur.copy_(v)
                    elif isinstance(v, torch.Tensor):
                        st[k] = saved_scalar(v, g, f.device)
                    else:
                        st[k] = v
        for k, v in plain.get("counters", {}).items():
            setattr(self.engine, k, v)
        sched = getattr(self.engine, "lr_scheduler", None)
        if plain.get("lr_scheduler") is not None and sched is not None:
            sched.load_state_dict(plain["lr_scheduler"])
        ls = plain.get("loss_scaler", {})
        for k in ("dynamic_loss_scale", "overflow"):
            if k in ls:
                setattr(self.zero, k, ls[k])
        scaler = getattr(self.zero, "loss_scaler", None)
        if scaler is not None and ls.get("scaler") == type(scaler).__name__:
            for k, v in ls.get("scaler_state", {}).items():
                setattr(scaler, k, v)
        # the fp32 master weights -> the model's parameters (collective over the group)
        if _is_zero3(self.zero):
            for gi in range(len(self.zero.fp16_groups)):
                self.zero._reassign_or_swap_out_partitioned_parameters(gi)
            self.zero.checkpoint_event_epilogue()  # re-gathers the persistent (small) parameters
        else:
            self.zero.update_lp_params()


__all__ = ["DeepSpeedAdapter", "release_deepspeed_groups", "FRAMEWORK"]
