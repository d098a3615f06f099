"""No import cycles inside the ``raylastic`` package, and every module imports on its own.

Static and dynamic checks, because each misses what the other sees:

- the static ones parse every module's imports with ``ast`` and fail on any cycle between
  raylastic modules, even one that happens to work today because of the order modules
  are first imported in: first the imports that run at import time (module level, class
  bodies, ``if``/``try`` blocks; not function bodies, not ``if TYPE_CHECKING:``), then all
  of them, because a function-local import that closes a cycle only hides it (the
  reporting package's ``model`` <-> ``_timeline`` was one: fixed by giving the shared
  records their own module);
- the dynamic one imports each module first, in a fresh interpreter state, so an
  ``ImportError`` from a partially initialised module (the symptom of a cycle, or of a
  module that only works when something else was imported before it) shows up with its
  traceback.
"""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import subprocess
import sys
from typing import Dict, Iterator, List, Optional, Set, Tuple

import pytest

import raylastic

ROOT = "raylastic"
PACKAGE_DIR = os.path.dirname(raylastic.__file__)

# Extras (pyproject.toml) a module may import at module level: when one is not installed,
# that module is skipped with the reason instead of failing. Anything else missing fails.
OPTIONAL = {"adlfs": "azure", "azure": "azure", "matplotlib": "report", "tqdm": "report",
            "tensorboard": "report"}


# ----------------------------------------------------------------------------- discovery

def modules() -> Dict[str, Tuple[str, bool]]:
    """{module name: (file, is_package)} for every module under raylastic/, found on disk
    with pkgutil (nothing is imported while looking)."""
    found = {ROOT: (os.path.join(PACKAGE_DIR, "__init__.py"), True)}

    def walk(path: str, prefix: str) -> None:
        for info in pkgutil.iter_modules([path]):
            name = f"{prefix}.{info.name}"
            sub = os.path.join(path, info.name)
            if info.ispkg:
                found[name] = (os.path.join(sub, "__init__.py"), True)
                walk(sub, name)
            else:
                found[name] = (sub + ".py", False)
    walk(PACKAGE_DIR, ROOT)
    return found


def _all_nodes(body: List[ast.stmt]) -> Iterator[ast.AST]:
    """Every statement, function bodies and TYPE_CHECKING blocks included."""
    for node in body:
        yield from ast.walk(node)


def _import_time_nodes(body: List[ast.stmt]) -> Iterator[ast.stmt]:
    """Statements run when the module is imported: function bodies run later, and
    ``if TYPE_CHECKING:`` never."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from _import_time_nodes(node.orelse)
            continue
        yield node
        for field in ("body", "orelse", "finalbody", "handlers"):
            children = getattr(node, field, None)
            if isinstance(children, list):
                yield from _import_time_nodes([c for c in children if isinstance(c, ast.AST)])


def _resolve(importer: str, is_package: bool, module: Optional[str], level: int) -> str:
    if not level:
        return module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def import_graph(function_local: bool = False) -> Dict[str, Set[str]]:
    """{module: raylastic modules its import runs} (with ``function_local``: or that any of
    its functions imports). ``from pkg import name`` needs ``pkg`` (or ``pkg.name`` when
    that is a module); importing ``a.b.c`` also runs ``a`` and ``a.b``, except the
    importer's own parent packages, which are always started first."""
    statements = _all_nodes if function_local else _import_time_nodes
    mods = modules()
    graph: Dict[str, Set[str]] = {}
    for name, (path, is_package) in mods.items():
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        ancestors = {".".join(name.split(".")[:k]) for k in range(1, name.count(".") + 1)}
        if is_package:
            ancestors.discard(name)
        needs: Set[str] = set()
        for node in statements(tree.body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.module, node.level)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                for k in range(1, len(parts) + 1):
                    dep = ".".join(parts[:k])
                    if dep in mods and dep != name and (dep == target or dep not in ancestors):
                        needs.add(dep)
        graph[name] = needs
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component that has one."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    components: List[List[str]] = []

    def connect(v: str) -> None:  # Tarjan; recursion depth is bounded by ~100 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_one_cycle(graph, set(comp)) for comp in components]


def _one_cycle(graph: Dict[str, Set[str]], comp: Set[str]) -> List[str]:
    """A shortest cycle through the component's first module, for the failure message."""
    start = min(comp)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(comp)}")


# ----------------------------------------------------------------------------- checks

def test_no_import_cycle_between_raylastic_modules():
    found = cycles(import_graph())
    assert not found, "import cycles (module-level imports):\n" + "\n".join(
        "  " + " -> ".join(c) for c in found)


def test_no_cycle_hidden_by_a_function_local_import():
    found = cycles(import_graph(function_local=True))
    assert not found, (
        "import cycles closed by a function-local import (move what both sides need to "
        "a module of its own; local imports are for heavy or optional dependencies):\n"
        + "\n".join("  " + " -> ".join(c) for c in found))


def test_the_cycle_finder_sees_a_cycle_and_how_it_is_imported(tmp_path, monkeypatch):
    """The checker itself: a relative, a package-attribute and a TYPE_CHECKING import."""
    pkg = tmp_path / "raylastic"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from raylastic.sub.a import A\n")
    (pkg / "sub" / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "sub" / "b.py").write_text("from raylastic.sub import A\n"
                                      "def f():\n    from raylastic import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\n"
                              "if TYPE_CHECKING:\n    from raylastic.sub import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE_DIR", str(pkg))
    graph = import_graph()
    assert graph == {"raylastic": set(), "raylastic.c": set(),
                     "raylastic.sub": {"raylastic.sub.a"}, "raylastic.sub.a": {"raylastic.sub.b"},
                     "raylastic.sub.b": {"raylastic.sub"}}
    assert cycles(graph) == [["raylastic.sub", "raylastic.sub.a", "raylastic.sub.b",
                              "raylastic.sub"]]
    (pkg / "sub" / "b.py").write_text("def f():\n    from raylastic import c\n")
    assert cycles(import_graph()) == []
    assert import_graph(function_local=True)["raylastic.sub.b"] == {"raylastic.c"}
    # c's TYPE_CHECKING import now counts: it runs raylastic.sub too, the shortest way back
    assert cycles(import_graph(function_local=True)) == [["raylastic.c", "raylastic.sub.a",
                                                          "raylastic.sub.b", "raylastic.c"]]


# Imports each module with no raylastic module loaded yet (third-party modules stay
# cached: re-importing torch and Ray for each of ~80 modules would take minutes).
_IMPORT_EACH = r"""
import importlib, json, sys, traceback
out = {}
for name in json.loads(sys.argv[1]):
    for loaded in [m for m in sys.modules if m == "raylastic" or m.startswith("raylastic.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        out[name] = {"missing": e.name, "error": traceback.format_exc()}
    except BaseException:
        out[name] = {"missing": None, "error": traceback.format_exc()}
print(json.dumps(out))
"""


def test_every_module_imports_first_in_a_fresh_interpreter():
    names = sorted(modules())
    p = subprocess.run([sys.executable, "-c", _IMPORT_EACH, json.dumps(names)],
                       capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(PACKAGE_DIR))
    assert p.returncode == 0, p.stderr[-5000:]
    failed = json.loads(p.stdout.strip().splitlines()[-1])
    skipped = {n: f for n, f in failed.items()
               if f["missing"] and f["missing"].split(".")[0] in OPTIONAL}
    broken = {n: f["error"] for n, f in failed.items() if n not in skipped}
    assert not broken, "modules that fail to import on their own:\n" + "\n".join(
        f"--- {n}\n{err}" for n, err in broken.items())
    if skipped:
        pytest.skip("optional dependencies not installed: " + ", ".join(
            f"{n} needs {f['missing']} (raylastic[{OPTIONAL[f['missing'].split('.')[0]]}])"
            for n, f in skipped.items()))
