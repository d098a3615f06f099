"""Route Ray Train's train-function API to the raylastic session.

Ray Train v2 (ray >= 2.50) dispatches ``ray.train.report``, ``get_checkpoint`` and
``get_context`` through a process-global ``TrainFnUtils`` object that a worker installs
with ``set_train_fn_utils``; ``ray.train.torch.prepare_model`` and
``prepare_data_loader`` read ranks through ``ray.train.get_context()``. Installing
:class:`RayTrainAdapter` there makes a function written for ``TorchTrainer`` run
unchanged under ``ElasticTrainer``. ``get_all_reported_checkpoints`` waits for the other
ranks' reports and the commits they imply (``ray_train_checkpoints``).

Per attempt, :func:`install` also resets process-wide state that libraries cache about the
process group (Accelerate's singletons: ``ray_train_routes.reset_library_state``) and routes
Ray's ``prepare_trainer`` of its Hugging Face and Lightning integrations to raylastic's
elastic ones. A worker installs it only where ``ray.train`` is imported: see
``ray_train_routes``.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

import torch.distributed as dist
from ray.train.v2._internal.execution.train_fn_utils import TrainFnUtils, set_train_fn_utils
from ray.train.v2.api.context import TrainContext as RayTrainContext

from raylastic import session as _session
from raylastic._internal.ray_train_checkpoints import ReportProgress, Retention, usable_dir_name
from raylastic._internal.ray_train_routes import _ROUTES, _route_ray, reset_library_state, route_on_import

# The run's retention rules, set in this worker process by ``raylastic.TorchTrainer``'s
# train-function wrapper; ``ElasticTrainer`` runs keep the default (the controller has
# pruned storage already; the default only orders by age).
_retention = Retention()


def set_retention(retention: Retention) -> None:
    global _retention
    _retention = retention


class RayContext(RayTrainContext):
    """Ray Train's context interface over raylastic's."""

    def __init__(self, ctx: "_session.TrainContext"):
        self._ctx = ctx

    def get_experiment_name(self) -> str:
        return self._ctx.get_experiment_name()

    def get_world_size(self) -> int:
        return self._ctx.get_world_size()

    def get_world_rank(self) -> int:
        return self._ctx.get_world_rank()

    def get_local_rank(self) -> int:
        return self._ctx.get_local_rank()

    def get_local_world_size(self) -> int:
        return self._ctx.get_local_world_size()

    def get_node_rank(self) -> int:
        return self._ctx.get_node_rank()

    def get_storage(self):
        return None

    def __getattr__(self, name: str) -> Any:  # raylastic extras (membership epoch, ...)
        return getattr(self._ctx, name)


class RayTrainAdapter(TrainFnUtils):
    def __init__(self, sess: "_session.Session"):
        self._sess = sess
        self._context = RayContext(sess.context)
        self._progress = ReportProgress()
        # report(checkpoint_dir_name=...) names the checkpoint's directory: set for
        # raylastic.TorchTrainer runs (ray_train_checkpoints.honour_dir_names); ElasticTrainer
        # runs keep raylastic's checkpoints/ layout.
        self.names_dirs = False

    def report(
        self,
        metrics: Dict[str, Any],
        checkpoint=None,
        checkpoint_dir_name=None,
        checkpoint_upload_mode=None,
        delete_local_checkpoint_after_upload=None,
        checkpoint_upload_fn=None,
        validation=False,
    ) -> None:
        name = None
        if self.names_dirs and checkpoint is not None and checkpoint_dir_name is not None:
            name = usable_dir_name(checkpoint_dir_name)
        self._sess.report(metrics, checkpoint, checkpoint_dir_name=name)
        self._progress.after_report(self._sess)

    def get_checkpoint(self):
        return self._sess.get_checkpoint()

    def get_all_reported_checkpoints(self, consistency_mode=None, timeout_s=None) -> List[Any]:
        self._progress.retention = _retention
        return self._progress.reported(self._sess, timeout_s)

    def get_dataset_shard(self, dataset_info):
        name = getattr(dataset_info, "dataset_name", dataset_info)
        return self._sess.get_dataset_shard(name)

    def get_context(self) -> RayContext:
        return self._context

    def get_preemption_info(self) -> Optional[Any]:
        return None

    def is_distributed(self) -> bool:
        return True

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast_from_rank_zero(self, data: Any) -> Any:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return data
        box = [data]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def install(sess: "_session.Session") -> None:
    """Route Ray Train's API to ``sess`` in this worker process.

    Also imports ``ray.train.torch``: Ray Train's own workers have it imported (they
    unpickle ``TorchConfig`` from it), and Ray's integrations rely on that: Lightning's
    ``RayDDPStrategy.root_device`` calls ``ray.train.torch.get_device()`` having imported only
    ``ray.train``, which fails with "module 'ray.train' has no attribute 'torch'" where
    nothing imported the submodule."""
    import ray.train.torch  # noqa: F401

    reset_library_state()
    route_on_import()
    for name in _ROUTES:
        module = sys.modules.get(name)
        if module is not None:
            _route_ray(module)
    set_train_fn_utils(RayTrainAdapter(sess))
