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
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("ok")
