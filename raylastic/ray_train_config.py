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
``ScalingConfig`` and ``RunConfig`` are translated here; ``FailureConfig``,
``CheckpointConfig``, ``torch_config`` and the callbacks in
``raylastic/_internal/ray_train_subconfigs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, cast

import pyarrow.fs as pafs
from ray._common.utils import RESOURCE_CONSTRAINT_PREFIX
from ray.train.v2._internal.constants import _DEPRECATED
from ray.train.v2.api.config import (
    LoggingConfig as RayLoggingConfig,
    RunConfig as RayRunConfig,
    ScalingConfig as RayScalingConfig,
)

from raylastic._internal.ray_train_subconfigs import (
    Ignored,
    _check_type,
    _ours,
    _refuse,
    check_backend_config as check_backend_config,  # re-exported: it was defined here
    check_callbacks,
    check_torch_config,
    translate_checkpoint,
    translate_failure,
)
from raylastic._internal.validate import check_bool, check_instance, check_number, check_resources, check_text
from raylastic.config import RunConfig, ScalingConfig
from raylastic.errors import ConfigError


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
