"""Routes Ray's Hugging Face and Lightning ``prepare_trainer`` to raylastic's elastic ones,
and tells a worker when ``ray.train`` gets imported, without importing ``ray.train``.

The import hook must be in place when a worker actor is created, before any train function
is unpickled: a function that did ``from ray.train.lightning import prepare_trainer`` binds
the name when it is unpickled. ``TrainWorker.__init__`` calls :func:`route_on_import`.

Why a worker waits for ``ray.train`` to be imported before it routes Ray Train's API to
the session (``ray_train_compat.install``, see ``TrainWorker.start``): importing it (and
``ray.train.torch``, which the routing needs) costs a worker process about 0.9 s of CPU,
three times per run of three workers, and a train function written for ``ElasticTrainer``
never uses it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import Any, Callable, Optional, Sequence

from raylastic import session as _session

# Called when ``ray.train`` is imported (the worker routes Ray Train's API then).
_on_ray_train: Optional[Callable[[], None]] = None

# Ray's integration module -> (its package, raylastic's elastic integration module).
_ROUTES = {
    "ray.train.huggingface.transformers._transformers_utils": (
        "ray.train.huggingface.transformers",
        "raylastic.integrations.transformers",
    ),
    "ray.train.lightning._lightning_utils": ("ray.train.lightning", "raylastic.integrations.lightning"),
}


def _routed_prepare_trainer(ray_prepare, ray_module: str):
    """Ray's ``prepare_trainer`` followed by raylastic's, while a raylastic session runs."""

    def prepare_trainer(trainer):
        trainer = ray_prepare(trainer)  # Ray Data iterables as train/eval datasets keep working
        if _session._session is None:  # not in a raylastic train function: Ray's behaviour
            return trainer
        # a script ours cannot resize in place (Ray Data iterables, sharded strategies)
        # keeps working as it did: warned, restarted from checkpoints on a resize
        elastic = importlib.import_module(_ROUTES[ray_module][1])
        return elastic.prepare_trainer(trainer, fallback_to_restart=True)

    prepare_trainer.__wrapped__ = ray_prepare  # type: ignore[attr-defined]
    prepare_trainer.__doc__ = ray_prepare.__doc__
    # Named as Ray's: cloudpickle then pickles a reference to it, which another process
    # resolves to its own (routed or not) function, never a copy of this closure.
    prepare_trainer.__module__, prepare_trainer.__qualname__ = ray_module, "prepare_trainer"
    return prepare_trainer


def _route_ray(module: Any) -> None:
    """Point Ray's ``prepare_trainer`` (the module attribute and the package's) at ours."""
    current = module.prepare_trainer
    if hasattr(current, "__wrapped__"):
        return
    routed = _routed_prepare_trainer(current, module.__name__)
    module.prepare_trainer = routed
    package: Any = sys.modules.get(_ROUTES[module.__name__][0])
    if package is not None and getattr(package, "prepare_trainer", None) is current:
        package.prepare_trainer = routed


class _RouteOnImport(importlib.abc.MetaPathFinder):
    """Routes Ray's HF / Lightning ``prepare_trainer`` as soon as its module is imported,
    and Ray Train's API to the running attempt's session as soon as ``ray.train`` is.

    Why at import: a train function that did ``from ray.train.lightning import
    prepare_trainer`` at module level is unpickled (binding that name) before any attempt
    starts; patching only in :func:`install` would reach the module attribute too late."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None):
        if fullname not in _ROUTES and fullname != "ray.train":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_route(module: Any) -> None:
            exec_module(module)
            if fullname == "ray.train":
                if _on_ray_train is not None:
                    # what the import system does next, needed now: ray.train.torch's
                    # modules read ``ray.train`` as an attribute of ``ray``
                    ray_package: Any = sys.modules["ray"]
                    ray_package.train = module
                    _on_ray_train()
                return
            _route_ray(module)

        loader.exec_module = exec_and_route  # type: ignore[method-assign]
        return spec


def route_on_import() -> None:
    """Install the import hook once per process (at this module's import: worker actors
    import it when they are created, before any train function is unpickled)."""
    if not any(isinstance(f, _RouteOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RouteOnImport())


def reset_library_state() -> None:
    """Forget what Accelerate cached about the previous process group.

    ``PartialState``, ``AcceleratorState`` and ``GradientState`` are process-wide singletons
    that read the world size, rank and device once; the survivors of a resize call the train
    function again in the same process, where the next ``TrainingArguments`` / ``Trainer`` /
    ``Accelerator`` would otherwise get the old world size (and a destroyed group). Resetting
    here, in the worker before each attempt, is the one place that runs after the new group
    exists and before any user code builds those objects. Only when Accelerate is already
    imported: a run that never uses it pays nothing."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return
    state.AcceleratorState._reset_state(reset_partial_state=True)
    state.GradientState._reset_state()


def on_ray_train_import(callback: Optional[Callable[[], None]]) -> None:
    """Call ``callback`` once ``ray.train`` is imported in this process (None: nothing)."""
    global _on_ray_train
    _on_ray_train = callback
    route_on_import()
