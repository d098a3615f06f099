"""Ray Train's own configs, translated field by field into raylastic's.

``raylastic.TorchTrainer`` takes ``ray.train.ScalingConfig`` / ``RunConfig`` (with its
``FailureConfig`` and ``CheckpointConfig``) and ``ray.train.torch.TorchConfig`` (or any
other ``ray.train.backend.BackendConfig``, whose ``Backend`` hooks then run around each
group: ``raylastic/_internal/ray_train_hooks.py``). Every field of those classes (ray 2.60)
is one of:

- honoured: translated into ``raylastic.ScalingConfig`` / ``RunConfig``;
- ignored, with a reason: it asks for nothing raylastic does differently, or it only
  tunes a part of Ray Train that does not run here. A non-default value is returned in
  ``Translation.ignored`` (the trainer logs it);
- refused: ``ConfigError`` naming the field and what to do instead.

All of it runs at construction, before ``ray.init`` or any actor. docs/ray_train.md has
the table with the reasons. Every field is also checked for its type and range with the
rules of ``raylastic._internal.validate`` (Ray Train itself checks few: ``use_gpu="yes"``
and a NaN grace period pass its constructors); an error raised by raylastic's own config
for a translated value names the Ray Train field (``ray.train.RunConfig.name``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, cast

import pyarrow.fs as pafs
from ray._common.utils import RESOURCE_CONSTRAINT_PREFIX
from ray.train.v2._internal.constants import _DEPRECATED
from ray.train.v2.api.config import (
    CheckpointConfig as RayCheckpointConfig,
    FailureConfig as RayFailureConfig,
    LoggingConfig as RayLoggingConfig,
    RunConfig as RayRunConfig,
    ScalingConfig as RayScalingConfig,
)

from raylastic._internal.validate import check_bool, check_instance, check_number, check_resources, check_text, is_int
from raylastic._internal.worker_group.group import GROUP_TIMEOUT_S
from raylastic.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from raylastic.errors import ConfigError

_TORCH_CONFIG_DEFAULT_TIMEOUT_S = 1800  # ray.train.torch.TorchConfig().timeout_s


@dataclass(frozen=True)
class Ignored:
    """A field set to a non-default value that has no effect here, and why."""

    field: str
    reason: str

    def __str__(self) -> str:
        return f"{self.field} is ignored: {self.reason}"


@dataclass(frozen=True)
class Translation:
    """raylastic's configs, what was ignored, and the Ray Train code the controller must
    call: ``backend`` (a ``BackendConfig`` whose hooks run, None on raylastic's TorchConfig
    path) and ``callbacks`` (``ray.train.UserCallback``s)."""

    scaling: ScalingConfig
    run: RunConfig
    ignored: Tuple[Ignored, ...] = ()
    backend: Any = None
    callbacks: Tuple[Any, ...] = ()


def translate(
    scaling_config: Optional[RayScalingConfig], run_config: Optional[RayRunConfig], torch_config: Any = None
) -> Translation:
    """raylastic's configs for Ray Train's; ``None`` means Ray Train's default object."""
    scaling_config = RayScalingConfig() if scaling_config is None else scaling_config
    run_config = RayRunConfig() if run_config is None else run_config
    _check_type(scaling_config, RayScalingConfig, "scaling_config", "ray.train.ScalingConfig(num_workers=...)")
    _check_type(run_config, RayRunConfig, "run_config", "ray.train.RunConfig(name=..., storage_path=...)")
    ignored: List[Ignored] = []
    scaling = translate_scaling(scaling_config, ignored)
    run = translate_run(run_config, ignored)
    callbacks = check_callbacks(run_config.callbacks)
    # use_gpu is a real bool here (translate_scaling refused anything else); Ray's type also
    # admits Tune search spaces
    backend = check_torch_config(torch_config, cast(bool, scaling_config.use_gpu), ignored)
    return Translation(scaling=scaling, run=run, ignored=tuple(ignored), backend=backend, callbacks=callbacks)


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


# -- ScalingConfig ----------------------------------------------------------------------


def translate_scaling(sc: RayScalingConfig, ignored: List[Ignored]) -> ScalingConfig:
    min_workers, max_workers = parse_num_workers(sc.num_workers)
    check_bool(
        sc.use_gpu,
        "ray.train.ScalingConfig.use_gpu",
        "pass use_gpu=True (NCCL, one GPU per worker) or use_gpu=False (gloo on CPU)",
    )
    check_bool(sc.use_tpu, "ray.train.ScalingConfig.use_tpu", "remove use_tpu (raylastic has no TPU support)")
    check_resources(sc.resources_per_worker, "ray.train.ScalingConfig.resources_per_worker")
    check_text(
        sc.accelerator_type,
        "ray.train.ScalingConfig.accelerator_type",
        optional=True,
        fix="pass an accelerator type such as 'A100', or leave it out",
    )
    check_number(
        sc.elastic_resize_monitor_interval_s,
        "ray.train.ScalingConfig.elastic_resize_monitor_interval_s",
        above=0,
        unit="seconds",
        fix="remove it (raylastic has no resize interval)",
    )
    if sc.trainer_resources is not None:
        raise _refuse(
            "ScalingConfig.trainer_resources",
            sc.trainer_resources,
            "the controller reserves no CPU or GPU (Ray Train 2.x rejects it too)",
            "remove trainer_resources",
        )
    if sc.use_tpu or sc.topology is not None:
        field, value = ("use_tpu", sc.use_tpu) if sc.use_tpu else ("topology", sc.topology)
        raise _refuse(
            f"ScalingConfig.{field}",
            value,
            "raylastic trains with gloo on CPU or NCCL on GPU only",
            "use ray.train.torch.TorchTrainer for TPUs",
        )
    if sc.label_selector:
        raise _refuse(
            "ScalingConfig.label_selector",
            sc.label_selector,
            "raylastic places workers by resources, not node labels",
            "start the nodes you want with a custom resource (ray start --resources="
            "'{\"trainer_node\": 1}') and ask for it in resources_per_worker",
        )
    _check_placement(sc.placement_strategy)
    if sc.elastic_resize_monitor_interval_s != 60.0:
        ignored.append(
            Ignored(
                "ScalingConfig.elastic_resize_monitor_interval_s",
                "raylastic has no resize interval: a worker placed on new capacity joins at the next "
                "checkpoint boundary (or an agreed report a few steps ahead) after a 1 s settle window",
            )
        )
    return _ours(
        ScalingConfig,
        min_workers=min_workers,
        max_workers=max_workers,
        resources_per_worker=worker_resources(sc),
        use_gpu=sc.use_gpu,
    )


def parse_num_workers(num_workers: Any) -> Tuple[int, int]:
    """``n`` -> ``(n, n)`` (a fixed size), ``(min, max)`` -> elastic."""
    if isinstance(num_workers, int) and not isinstance(num_workers, bool):
        if num_workers >= 1:
            return num_workers, num_workers
        if num_workers == 0:
            raise ConfigError(
                "ray.train.ScalingConfig.num_workers=0 (Ray Train's local mode: the train function "
                "runs in the driver process) has no worker group to translate; raylastic.TorchTrainer "
                "runs it itself (raylastic/_internal/ray_train_local.py). Fix: pass the config to "
                "raylastic.TorchTrainer, or num_workers=1 for one worker actor."
            )
        raise ConfigError(
            f"ray.train.ScalingConfig.num_workers={num_workers!r} is negative. "
            "Fix: pass an int >= 1, or a (min_workers, max_workers) tuple for elastic training."
        )
    if isinstance(num_workers, tuple):
        if len(num_workers) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in num_workers):
            raise ConfigError(
                f"ray.train.ScalingConfig.num_workers={num_workers!r}: an elastic size is a tuple of "
                "two ints (min_workers, max_workers). Fix: e.g. num_workers=(2, 4)."
            )
        lo, hi = num_workers
        if lo < 1:
            raise ConfigError(
                f"ray.train.ScalingConfig.num_workers={num_workers!r}: min_workers must be >= 1 "
                f"(training needs a worker). Fix: num_workers=(1, {max(hi, 1)})."
            )
        if lo > hi:
            raise ConfigError(
                f"ray.train.ScalingConfig.num_workers={num_workers!r}: min_workers ({lo}) > max_workers "
                f"({hi}). Fix: num_workers=({hi}, {lo}): the tuple is (min_workers, max_workers)."
            )
        return lo, hi
    raise ConfigError(
        f"ray.train.ScalingConfig.num_workers must be an int >= 1 (a fixed size) or a "
        f"(min_workers, max_workers) tuple of ints (elastic), got {type(num_workers).__name__} "
        f"{num_workers!r}. Fix: e.g. num_workers=4 or num_workers=(2, 4)."
    )


def _check_placement(strategy: Any) -> None:
    # Workers are separate actors placed with Ray's SPREAD strategy (no placement group:
    # one cannot shrink or grow by one member). PACK, Ray Train's default, is a soft
    # preference there too, so it is accepted; SPREAD is what raylastic does.
    if strategy in ("PACK", "SPREAD"):
        return
    raise _refuse(
        "ScalingConfig.placement_strategy",
        strategy,
        "workers are separate actors spread over nodes (no placement group: an elastic "
        "group grows and shrinks one worker at a time), so a strict placement cannot be kept",
        "remove placement_strategy (or use 'SPREAD'); to keep workers on particular nodes, "
        "give those nodes a custom resource and ask for it in resources_per_worker",
    )


def worker_resources(sc: RayScalingConfig) -> Dict[str, float]:
    """What Ray Train reserves per worker (its ``_resources_per_worker_not_none``):
    ``{"CPU": 1}``, or ``{"GPU": 1}`` with ``use_gpu``, unless ``resources_per_worker``
    says otherwise; a GPU with ``use_gpu``; ``accelerator_type:<type>: 0.001`` with
    ``accelerator_type``. A zero amount reserves nothing, as in Ray."""
    if sc.resources_per_worker is None:
        res: Dict[str, float] = {"GPU": 1} if sc.use_gpu else {"CPU": 1}
    else:
        res = dict(cast(Dict[str, float], sc.resources_per_worker))  # checked: a mapping of amounts
    if sc.use_gpu:
        res.setdefault("GPU", 1)
    if sc.accelerator_type:
        res.setdefault(f"{RESOURCE_CONSTRAINT_PREFIX}{sc.accelerator_type}", 0.001)
    return res


# -- RunConfig --------------------------------------------------------------------------

_RUN_DEPRECATED = ("sync_config", "verbose", "stop", "progress_reporter", "log_to_file")


def translate_run(rc: RayRunConfig, ignored: List[Ignored]) -> RunConfig:
    for name in _RUN_DEPRECATED:
        if getattr(rc, name) != _DEPRECATED:
            raise _refuse(
                f"RunConfig.{name}",
                getattr(rc, name),
                "Ray Train 2.x deprecated it (a Ray Tune option)",
                f"remove {name}",
            )
    storage_path = rc.storage_path
    if rc.storage_filesystem is not None:  # storage_path is a path on that filesystem, as in Ray Train
        if not isinstance(rc.storage_filesystem, pafs.FileSystem):
            raise _refuse(
                "RunConfig.storage_filesystem",
                type(rc.storage_filesystem).__name__,
                "it must be a pyarrow.fs.FileSystem",
                "pass a pyarrow.fs.FileSystem, or the "
                "full URI as storage_path (s3://bucket/path, gs://bucket/path; docs/storage.md)",
            )
        from raylastic.checkpoint.backends import filesystem_uri

        storage_path = filesystem_uri(rc.storage_filesystem, str(storage_path))
    if rc.worker_runtime_env:
        raise _refuse(
            "RunConfig.worker_runtime_env",
            rc.worker_runtime_env,
            "raylastic's worker actors take the job's runtime environment",
            "set it for the whole job: ray.init(runtime_env=...) before fit(), or ray job submit --runtime-env-json",
        )
    check_instance(
        rc.logging_config,
        RayLoggingConfig,
        "ray.train.RunConfig.logging_config",
        "ray.train.LoggingConfig(log_level=...), or leave it out",
        optional=True,
    )
    level = getattr(rc.logging_config, "log_level", "INFO")
    if level != "INFO":
        ignored.append(
            Ignored(
                "RunConfig.logging_config.log_level",
                "it sets the level of Ray Train's controller logs, and that controller "
                "does not run here; raylastic logs to the 'raylastic' logger",
            )
        )
    failure = translate_failure(rc.failure_config, ignored)
    checkpoint = translate_checkpoint(rc.checkpoint_config, ignored)
    return _ours(
        RunConfig, name=rc.name, storage_path=storage_path, failure_config=failure, checkpoint_config=checkpoint
    )


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
