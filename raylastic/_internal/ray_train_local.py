"""Ray Train's local mode for ``raylastic.TorchTrainer``: ``ScalingConfig(num_workers=0)``.

Why: Ray Train 2.60 runs the train function in the driver process when ``num_workers=0``
(no controller, no worker actors, no process group unless the driver was started by
``torchrun``). Users rely on it to step through a train function in a debugger and to
test a train function quickly, and Ray's Lightning and Transformers integrations
(``RayDDPStrategy``, ``RayLightningEnvironment``, ``RayTrainReportCallback``) are written
to work there against a one-process ``ray.train.get_context()``. A drop-in trainer that
refused ``num_workers=0`` broke those scripts at construction.

What runs, as in Ray Train 2.60 (``ray.train.v2._internal.execution.local_mode``):

- the train function, called in this process with ``train_loop_config`` (or no argument)
  inside the backend's ``train_func_context`` (``TorchConfig``'s sets the CUDA device);
- ``ray.train.get_context()`` is Ray's ``LocalTrainContext``: world size 1, rank 0, the
  run's name; under ``torchrun`` (its ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``... variables
  set) a process group is formed from them and the context reports torchrun's ranks;
- ``ray.train.report`` keeps the last metrics and checkpoint in memory: nothing is
  written to ``storage_path`` and nothing is retried (``FailureConfig`` has no effect);
- ``ray.train.get_dataset_shard(name)`` returns the whole dataset given in ``datasets``.

raylastic adds one thing Ray's local mode lacks: ``resume_from_checkpoint`` is what
``ray.train.get_checkpoint()`` returns until the function reports a checkpoint of its own,
as on the distributed path. And ``get_checkpoint()`` keeps the latest reported checkpoint
across reports without one (Ray's local mode forgets it), as both trainers do when
distributed.

``fit()`` raises the train function's own exception unwrapped: there is no worker group
whose failure it would describe, and a debugger stops at the original frame.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Dict, Optional

from ray.train.v2._internal.execution.train_fn_utils import (
    LocalTrainFnUtils,
    set_train_fn_utils,
)

from raylastic.errors import ConfigError

# torchrun's variables: all present means this driver is one process of a torchrun job
_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def is_local_mode(scaling_config: Any) -> bool:
    """Whether Ray Train would run this config in local mode: ``num_workers`` is the int 0
    (Ray's test; an elastic ``(0, n)`` is not local mode and stays refused)."""
    n = getattr(scaling_config, "num_workers", None)
    return isinstance(n, int) and not isinstance(n, bool) and n == 0


def check_config(scaling_config: Any, run_config: Any, torch_config: Any) -> Any:
    """Validate the configs as the distributed path would, so a script that works in local
    mode also constructs with workers: every field is checked by ``translate`` on a copy
    with ``num_workers=1``. Returns the translation (its ``ignored`` notes are the same)."""
    from raylastic.ray_train_config import translate

    return translate(dataclasses.replace(scaling_config, num_workers=1), run_config, torch_config)


class LocalFnUtils(LocalTrainFnUtils):
    """Ray's local ``TrainFnUtils`` with raylastic's checkpoint semantics:
    ``get_checkpoint()`` is the latest checkpoint reported so far, or ``initial`` (the
    trainer's ``resume_from_checkpoint``) before the first one."""

    def __init__(self, *args: Any, initial: Any = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._initial = initial
        self._latest: Any = None

    def report(self, metrics: Dict[str, Any], checkpoint: Any = None, *args: Any, **kwargs: Any) -> None:
        super().report(metrics, checkpoint, *args, **kwargs)
        if checkpoint is not None:
            self._latest = checkpoint

    def get_checkpoint(self) -> Any:
        return self._latest if self._latest is not None else self._initial

    def latest_reported(self) -> Any:
        return self._latest


@dataclasses.dataclass
class LocalOutcome:
    """What a local run gives ``fit()``: the last metrics reported, the latest reported
    checkpoint, the train function's return value, and the world size it ran with
    (torchrun's, else 1)."""

    metrics: Dict[str, Any]
    checkpoint: Any
    return_value: Any
    world_size: int


class LocalRun:
    """One local-mode run of a train function in this process (see the module docstring)."""

    def __init__(
        self,
        func: Callable,
        train_loop_config: Optional[Dict[str, Any]],
        torch_config: Any,
        experiment_name: str,
        datasets: Optional[Dict[str, Any]] = None,
        resume_from_checkpoint: Any = None,
    ):
        from ray.train.torch import TorchConfig
        from ray.train.v2._internal.util import construct_train_func

        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise ConfigError(
                f"TorchTrainer: train_loop_config must be a dict or None, got "
                f"{type(train_loop_config).__name__}. Fix: pass a dict, or leave it out."
            )
        backend_config = torch_config if torch_config is not None else TorchConfig()
        try:
            self.train_fn = construct_train_func(
                func, train_loop_config, backend_config.train_func_context, fn_arg_name="train_loop_per_worker"
            )
        except ValueError as e:
            raise ConfigError(f"TorchTrainer: {e} Fix: define it as train_func(config) or train_func().") from None
        self.experiment_name = experiment_name
        self.datasets = datasets
        self.resume_from_checkpoint = resume_from_checkpoint

    def run(self) -> LocalOutcome:
        """Run the train function here and return what it reported. The driver's previous
        ``TrainFnUtils`` (normally none) is put back afterwards, so ``ray.train.report``
        outside a run fails again instead of reporting into a finished one."""
        import torch
        import torch.distributed as dist

        from ray.train.v2._internal.execution import train_fn_utils as _tfu

        datasets = {k: v() if callable(v) else v for k, v in (self.datasets or {}).items()}
        world_size, rank, local_rank, local_world_size, node_rank = 1, 0, 0, 1, 0
        formed = False
        if all(k in os.environ for k in _TORCHRUN_ENV):
            if datasets and int(os.environ["WORLD_SIZE"]) != 1:
                raise ConfigError(
                    "TorchTrainer(datasets=...) with ScalingConfig(num_workers=0) under torchrun "
                    f"(WORLD_SIZE={os.environ['WORLD_SIZE']}): Ray Data is not supported in local mode with "
                    "several processes (the same in Ray Train). Fix: run one process, or pass "
                    "num_workers >= 1 and start the script with python, not torchrun."
                )
            if not dist.is_initialized():
                dist.init_process_group(backend="nccl" if torch.cuda.is_available() else "gloo")
                formed = True
            world_size, rank = dist.get_world_size(), dist.get_rank()
            local_rank, local_world_size = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
            node_rank = rank // local_world_size
            if torch.cuda.is_available():
                torch.cuda.set_device(local_rank)
        previous = _tfu._train_fn_utils
        utils = LocalFnUtils(
            experiment_name=self.experiment_name,
            dataset_shards=datasets,
            world_size=world_size,
            world_rank=rank,
            local_rank=local_rank,
            local_world_size=local_world_size,
            node_rank=node_rank,
            initial=self.resume_from_checkpoint,
        )
        set_train_fn_utils(utils)
        try:
            value = self.train_fn()
            return LocalOutcome(
                metrics=dict(utils._get_last_metrics() or {}),
                checkpoint=utils.latest_reported(),
                return_value=value,
                world_size=world_size,
            )
        finally:
            set_train_fn_utils(previous)
            if formed and dist.is_initialized():
                dist.destroy_process_group()
