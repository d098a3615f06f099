"""What Ray's framework integrations need from a raylastic worker process.

Ray's Lightning strategies (``ray.train.lightning.RayDDPStrategy.root_device``) call
``ray.train.torch.get_device()`` having imported only ``ray.train``; Ray Train's own workers
have ``ray.train.torch`` imported already. A raylastic worker imports it when it installs
the Ray Train API (``ray_train_compat.install``). Checked in a fresh interpreter, since
this test process imports ``ray.train.torch`` anyway.
"""

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import sys
    import types

    import ray.train
    from raylastic._internal import ray_train_compat

    assert "ray.train.torch" not in sys.modules, "imported already: the check below would prove nothing"
    sess = types.SimpleNamespace(context=None)
    ray_train_compat.install(sess)
    # (not called: outside a worker, get_device() would connect to whatever Ray cluster runs here)
    assert callable(ray.train.torch.get_device)
    assert not ray.is_initialized()
    print("ok")
""")


def test_worker_install_makes_ray_train_torch_reachable():
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")


_LAZY = textwrap.dedent("""
    import sys

    from raylastic import session as _session
    from raylastic._internal.protocol import GroupSpec, RestoreInfo
    from raylastic.session import Session

    spec = GroupSpec(epoch=1, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                     master_addr="127.0.0.1", master_port=0, backend="gloo")
    sess = Session(spec=spec, storage=None, run_rel="r", run_name="r", restore=RestoreInfo())
    _session._set_session(sess)
    from raylastic._internal.worker_group.worker import before_attempt

    before_attempt(sess)  # as the worker does before each attempt
    assert "ray.train" not in sys.modules, "a train function that never imports it pays for it"
    import ray.train  # the train function's first use of Ray Train's API

    assert ray.train.get_context().get_world_size() == 1
    assert ray.train.get_context().get_world_rank() == 0
    assert "ray.train.torch" in sys.modules
    print("ok")
""")


def test_ray_train_api_is_routed_when_the_train_function_first_imports_it():
    """A worker routes Ray Train's API to the attempt's session only once ``ray.train`` is
    imported (~0.9 s of CPU per worker process that a raylastic train function never
    needs): at the import, inside the running attempt."""
    proc = subprocess.run([sys.executable, "-c", _LAZY], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
