"""A new worker's head start (``raylastic/_internal/worker_group/warm_imports.py``): it
imports the slow modules the running workers reported, and only those of the list."""

import json
import subprocess
import sys

PROBE = """
import json, sys
from raylastic._internal.worker_group import warm_imports as w
before = w.imported()
w.warm(["torch._dynamo", "xml.dom.minidom", "no.such.module"])
print(json.dumps({"before": before, "after": w.imported(), "unlisted": "xml.dom.minidom" in sys.modules}))
"""


def test_warm_imports_the_listed_modules_it_is_told_and_nothing_else():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    # Importing raylastic's worker-group modules imports none of them (the controller
    # imports these modules too, and needs no torch internals).
    assert seen["before"] == []
    assert seen["after"] == ["torch._dynamo"]  # reported back, for the next new worker
    assert not seen["unlisted"]  # the list comes over the wire: only SLOW_IMPORTS are imported
