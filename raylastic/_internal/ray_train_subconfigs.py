"""Ray Train's FailureConfig, CheckpointConfig, torch_config and callbacks, for ``TorchTrainer``.

Why a module of its own: ``raylastic/ray_train_config.py`` translates the two configs a
``TorchTrainer`` is built with, ``ScalingConfig`` and ``RunConfig``, and hands the rest here:
``RunConfig``'s ``failure_config`` and ``checkpoint_config`` (translated into raylastic's
``FailureConfig`` / ``CheckpointConfig``), and the Ray Train code raylastic runs as it is,
``torch_config`` (a ``TorchConfig`` or any ``BackendConfig``) and ``RunConfig.callbacks``
(checked here, called by ``ray_train_hooks``). What every translator shares lives here too,
below both modules: :class:`Ignored`, and the errors that name Ray Train's field
(``_check_type``, ``_refuse``, ``_ours``). ray_train_config's module docstring says how a
field is honoured, ignored or refused; docs/ray_train.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from ray.train.v2._internal.constants import _DEPRECATED
from ray.train.v2.api.config import (
    CheckpointConfig as RayCheckpointConfig,
    FailureConfig as RayFailureConfig,
)

from raylastic._internal.validate import check_bool, check_number, check_text, is_int
from raylastic._internal.worker_group.group import GROUP_TIMEOUT_S
from raylastic.config import CheckpointConfig, FailureConfig
from raylastic.errors import ConfigError

_TORCH_CONFIG_DEFAULT_TIMEOUT_S = 1800  # ray.train.torch.TorchConfig().timeout_s


@dataclass(frozen=True)
class Ignored:
    """A field set to a non-default value that has no effect here, and why."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field} is ignored: {self.reason}"


def _check_type(obj: Any, cls: type, arg: str, example: str) -> None:
    if isinstance(obj, cls):
        return
    got = f"{type(obj).__module__}.{type(obj).__name__}"
    hint = ""
    if type(obj).__module__.startswith("raylastic"):
        hint = " raylastic's own configs go to raylastic.ElasticTrainer."
    raise ConfigError(
        f"TorchTrainer: {arg} must be Ray Train's {example.split('(')[0]}, got {got}. Fix: pass {example}.{hint}"
    )


def _refuse(field: str, value: Any, why: str, fix: str) -> ConfigError:
    return ConfigError(f"ray.train.{field}={value!r} is not supported by raylastic: {why}. Fix: {fix}.")


def _ours(cls: type, **kwargs: Any) -> Any:
    """raylastic's config built from translated values; its errors name Ray Train's field
    (``RunConfig.name`` -> ``ray.train.RunConfig.name``): that is what the user typed."""
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"ray.train.{e}") from None


# -- RunConfig.failure_config and checkpoint_config -------------------------------------


def translate_failure(fc: Optional[RayFailureConfig], ignored: List[Ignored]) -> FailureConfig:
    fc = RayFailureConfig() if fc is None else fc
    _check_type(fc, RayFailureConfig, "RunConfig.failure_config", "ray.train.FailureConfig(max_failures=...)")
    if fc.fail_fast != _DEPRECATED:
        raise _refuse(
            "FailureConfig.fail_fast",
            fc.fail_fast,
            "Ray Train 2.x deprecated it",
            "remove fail_fast; max_failures=0 (the default) fails at the first error",
        )
    for name in ("max_failures", "max_preemption_failures", "controller_failure_limit"):
        value = getattr(fc, name)
        if not is_int(value) or value < -1:
            raise ConfigError(
                f"ray.train.FailureConfig.{name} must be an int >= -1 (-1 = unlimited), got "
                f"{value!r}. Fix: pass {name}=-1 (unlimited), 0, or a number of retries."
            )
    check_bool(fc.relax_collectives_on_preemption, "ray.train.FailureConfig.relax_collectives_on_preemption")
    check_number(
        fc.preemption_grace_s,
        "ray.train.FailureConfig.preemption_grace_s",
        minimum=0,
        unit="seconds",
        fix="remove it (survivors are never torn down at a preemption deadline here)",
    )
    if fc.controller_failure_limit != -1:
        raise _refuse(
            "FailureConfig.controller_failure_limit",
            fc.controller_failure_limit,
            "raylastic has no controller retry count: a group that cannot start waits for "
            "capacity instead of failing, as Ray Train does with the default -1",
            "remove controller_failure_limit",
        )
    if fc.relax_collectives_on_preemption:
        ignored.append(
            Ignored(
                "FailureConfig.relax_collectives_on_preemption",
                "report() and get_checkpoint() are no collectives here: a preempted rank "
                "never strands the others, which is what the flag asks for",
            )
        )
    if fc.preemption_grace_s:
        ignored.append(
            Ignored(
                "FailureConfig.preemption_grace_s",
                "survivors are never torn down at a preemption deadline: only the workers "
                "on the draining node leave, at a report index every rank reaches",
            )
        )
    # Ray Train charges a node loss without a preemption to max_failures; raylastic
    # charges every node loss to its own budget (max_node_failures), user errors and
    # crashed processes on healthy nodes to max_failures.
    preempt = fc.max_preemption_failures
    return _ours(FailureConfig, max_failures=fc.max_failures, max_node_failures=None if preempt == -1 else preempt)


def translate_checkpoint(cc: Optional[RayCheckpointConfig], ignored: List[Ignored]) -> CheckpointConfig:
    cc = RayCheckpointConfig() if cc is None else cc
    _check_type(cc, RayCheckpointConfig, "RunConfig.checkpoint_config", "ray.train.CheckpointConfig(num_to_keep=...)")
    for name in ("checkpoint_frequency", "checkpoint_at_end"):
        if getattr(cc, name) != _DEPRECATED:
            raise _refuse(
                f"CheckpointConfig.{name}",
                getattr(cc, name),
                "Ray Train 2.x deprecated it: the train function decides when to checkpoint",
                f"remove {name} and pass checkpoint= to ray.train.report() when you want one",
            )
    check_text(
        cc.checkpoint_score_attribute,
        "ray.train.CheckpointConfig.checkpoint_score_attribute",
        optional=True,
        fix="pass the name of a metric your train function reports, or leave it out",
    )
    if cc.checkpoint_score_order not in ("max", "min"):
        raise ConfigError(
            f"ray.train.CheckpointConfig.checkpoint_score_order={cc.checkpoint_score_order!r} must "
            "be 'max' or 'min'. Fix: pass 'min' for a loss, 'max' for an accuracy."
        )
    if cc.checkpoint_score_attribute is None and cc.checkpoint_score_order != "max":
        ignored.append(
            Ignored(
                "CheckpointConfig.checkpoint_score_order",
                "it only orders checkpoints by checkpoint_score_attribute, which is not set (the same in Ray Train)",
            )
        )
    keep = cc.num_to_keep
    if keep is not None and (not is_int(keep) or keep < 1):
        raise ConfigError(
            f"ray.train.CheckpointConfig.num_to_keep must be an int >= 1 or None (keep all), "
            f"got {keep!r}. Fix: pass num_to_keep=2 or more (1 keeps only the newest), or None."
        )
    return _ours(
        CheckpointConfig,
        num_to_keep=keep,
        score_attribute=cc.checkpoint_score_attribute,
        score_order=cc.checkpoint_score_order,
    )


# -- torch_config: TorchConfig, or any BackendConfig -------------------------------------


def check_torch_config(tc: Any, use_gpu: bool, ignored: List[Ignored]) -> Any:
    """``ray.train.torch.TorchConfig``: the backend must be the one raylastic uses (its
    process group is raylastic's own; Ray's ``_TorchBackend`` does not run). Any other
    ``BackendConfig`` (a ``TorchConfig`` subclass with its own ``backend_cls`` included) is
    returned: its ``Backend`` hooks run around each group (``check_backend_config``)."""
    if tc is None:
        return None
    from ray.train.backend import BackendConfig
    from ray.train.torch import TorchConfig
    from ray.train.torch.config import _TorchBackend

    if not isinstance(tc, BackendConfig):
        raise ConfigError(
            f"TorchTrainer: torch_config must be a ray.train.backend.BackendConfig (usually "
            f"ray.train.torch.TorchConfig), got {type(tc).__module__}.{type(tc).__name__}. "
            "Fix: pass ray.train.torch.TorchConfig(...) or your BackendConfig, or leave it out."
        )
    if not (isinstance(tc, TorchConfig) and tc.backend_cls is _TorchBackend):
        return check_backend_config(tc, use_gpu, ignored)
    check_text(tc.init_method, "ray.train.torch.TorchConfig.init_method", fix="remove init_method")
    check_number(tc.timeout_s, "ray.train.torch.TorchConfig.timeout_s", above=0, unit="seconds", fix="remove timeout_s")
    backend = "nccl" if use_gpu else "gloo"
    if tc.backend not in (None, backend):
        raise _refuse(
            "torch.TorchConfig.backend",
            tc.backend,
            f"raylastic uses {backend} {'with use_gpu=True' if use_gpu else 'on CPU (use_gpu=False)'}",
            f"remove backend (or pass backend={backend!r})",
        )
    if tc.timeout_s not in (_TORCH_CONFIG_DEFAULT_TIMEOUT_S, GROUP_TIMEOUT_S):
        raise _refuse(
            "torch.TorchConfig.timeout_s",
            tc.timeout_s,
            f"raylastic's process group times out after {GROUP_TIMEOUT_S:.0f} s so that a lost peer is noticed quickly",
            f"remove timeout_s, and keep work that one rank does while the others wait in a "
            f"collective under {GROUP_TIMEOUT_S:.0f} s",
        )
    if tc.init_method != "env":
        ignored.append(
            Ignored(
                "torch.TorchConfig.init_method", "raylastic rendezvouses each membership epoch through its own TCPStore"
            )
        )
    return None


def check_backend_config(bc: Any, use_gpu: bool, ignored: List[Ignored]) -> Any:
    """A ``BackendConfig`` whose ``Backend`` hooks the controller runs (``ray_train_hooks``).
    It travels to the controller actor, so it must pickle; its ``train_func_context``
    wraps the train function on every worker, as in Ray Train."""
    from ray import cloudpickle
    from ray.train.backend import Backend

    name = type(bc).__name__
    try:
        backend_cls = bc.backend_cls
    except Exception as e:  # noqa: BLE001 - the user's property
        raise ConfigError(
            f"TorchTrainer: torch_config={name}(): its backend_cls property raised "
            f"{type(e).__name__}: {e}. Fix: return a ray.train.backend.Backend subclass."
        ) from None
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, Backend)):
        raise ConfigError(
            f"TorchTrainer: torch_config={name}().backend_cls must be a ray.train.backend.Backend "
            f"subclass, got {backend_cls!r}. Fix: return your Backend class from backend_cls."
        )
    if getattr(backend_cls, "has_replica_groups", False):
        raise _refuse(
            f"backend.Backend.has_replica_groups ({backend_cls.__name__})",
            True,
            "raylastic forms one flat group per membership epoch, not Ray Train's replica groups",
            "use a Backend without replica groups",
        )
    try:
        cloudpickle.dumps(bc)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"TorchTrainer: torch_config={name}() cannot be pickled ({type(e).__name__}: {e}); "
            "raylastic calls its backend's hooks in its controller actor. Fix: keep unpicklable "
            "objects out of the BackendConfig (create them in the hooks)."
        ) from None
    if use_gpu and getattr(backend_cls, "share_cuda_visible_devices", False):
        ignored.append(
            Ignored(
                f"backend.Backend.share_cuda_visible_devices ({backend_cls.__name__})",
                "each raylastic worker sees the GPU Ray assigned it, not its node's others",
            )
        )
    return bc


# -- RunConfig.callbacks --------------------------------------------------------------


def check_callbacks(callbacks: Any) -> Tuple[Any, ...]:
    """``ray.train.UserCallback``s, which the controller calls (``ray_train_hooks``).
    Ray Train's internal callback types hook into its own controller and Ray Tune's into
    Tune: neither runs here, so they are refused. Callbacks travel to the controller actor,
    so they must pickle."""
    from ray import cloudpickle
    from ray.train import UserCallback

    if not callbacks:
        return ()
    if not isinstance(callbacks, (list, tuple)):
        raise ConfigError(
            f"ray.train.RunConfig.callbacks must be a list of ray.train.UserCallback, got "
            f"{type(callbacks).__name__}. Fix: callbacks=[MyCallback()]."
        )
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, UserCallback):
            raise _refuse(
                f"RunConfig.callbacks[{i}]",
                type(cb).__name__,
                "raylastic calls Ray Train's UserCallback interface (after_report, after_exception); "
                "other callback types hook into Ray Train's own controller or Ray Tune, which do "
                "not run here",
                "subclass ray.train.UserCallback, or remove it",
            )
        try:
            cloudpickle.dumps(cb)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(
                f"ray.train.RunConfig.callbacks[{i}] ({type(cb).__name__}) cannot be pickled "
                f"({type(e).__name__}: {e}); raylastic calls it in its controller actor. Fix: "
                "create clients, locks or files inside the callback's methods."
            ) from None
    return tuple(callbacks)
