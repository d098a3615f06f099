"""DeepSpeed ZeRO through a node loss and a scale-up: ``examples/sharded_fsdp2.py`` with
``--deepspeed-stage`` (default 3). Run: .venv/bin/python examples/sharded_deepspeed.py [--stage 1|2|3]"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sharded_fsdp2 import main  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=3)
    main(["--deepspeed-stage", str(p.parse_args().stage)])
