"""The documentation site (guides + API reference from docstrings) builds with warnings as errors.

``mkdocs build --strict`` fails on a broken link or anchor between pages, on a page that
names a Python object mkdocstrings cannot find, and on a docstring griffe cannot parse
(e.g. an ``Args:`` entry for a parameter the signature does not have). Config: mkdocs.yml;
pins: requirements-dev.txt.
"""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=400,
    )
    out = proc.stdout + proc.stderr
    assert "No module named mkdocs" not in out, (
        "mkdocs is not installed in this environment: pip install -r requirements-dev.txt")
    assert proc.returncode == 0, f"mkdocs build --strict failed (exit {proc.returncode}):\n{out}"
    assert (tmp_path / "site" / "api" / "index.html").is_file(), out
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    # mkdocstrings rendered the docstrings, not just the headings.
    for name in ("ElasticTrainer", "ElasticState", "CapacityPolicy", "LocalCluster", "SpotCloud"):
        assert name in api, name
    assert "min_workers" in api
