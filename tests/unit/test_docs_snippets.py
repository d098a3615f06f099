"""Every code block in README.md and docs/*.md is checked against the code.

- ```python blocks compile; ``raylastic`` names they import or use (``from raylastic.x
  import Y``, ``raylastic.Y``) exist. A block preceded by ``<!-- snippet: fragment -->`` is
  only checked for names (none is marked today); one preceded by
  ``<!-- snippet: run-train-func -->`` has its ``train_func`` run, in a subprocess, on one
  rank in a local session (no Ray cluster).
- ```bash / ```sh / ```shell / ```console blocks name commands and flags that exist:
  ``raylastic <sub>`` / ``python -m raylastic <sub>``: the subcommand is listed by
  ``raylastic --help`` and each ``--flag`` by ``raylastic <sub> --help``;
  ``python -m raylastic.<module>``: the module exists and names each flag;
  ``python <script>.py`` (also after ``torchrun`` and ``ray job submit ... --``): the script
  exists and names each flag after it; ``make <target>``: the Makefile has the target;
  any path under examples/, benchmarks/, tests/, cluster-configs/, raylastic/ or docs/
  exists.
- Inline code such as `raylastic.testing.cluster.LocalCluster` names something that exists.

No Ray, no torch in this process (the names are resolved by reading the source).
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Set

import pytest

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
SHELL_LANGS = {"bash", "sh", "shell", "console"}
REPO_DIRS = ("examples/", "benchmarks/", "tests/", "cluster-configs/", "raylastic/", "docs/")
MARKER = re.compile(r"<!--\s*snippet:\s*([\w-]+)\s*-->")


@dataclass
class Block:
    doc: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: Optional[str]

    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> Iterator[Block]:
    """Fenced code blocks, dedented (fences inside list items are indented)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,})([\w+-]*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        body = []
        while j < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        assert j < len(lines), f"{path.relative_to(REPO)}:{i + 1}: code block never closed"
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.search(lines[k]) if k >= 0 else None
        yield Block(path, i + 1, lang, "\n".join(body) + "\n", marker.group(1) if marker else None)
        i = j + 1


ALL_BLOCKS = [b for doc in DOC_FILES for b in blocks(doc)]
PYTHON_BLOCKS = [b for b in ALL_BLOCKS if b.lang in ("python", "py")]
SHELL_BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL_LANGS]


# -- resolving raylastic names from the source, without importing it -----------------------

def _module_file(dotted: str) -> Optional[Path]:
    base = REPO.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.lru_cache(maxsize=None)
def _top_level_names(dotted: str) -> Set[str]:
    """Names a module defines or imports at top level (plus raylastic's lazy exports)."""
    path = _module_file(dotted)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: Set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                for t in node.targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            names.add(n.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for a in node.names:
                    names.add((a.asname or a.name).split(".")[0])
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                for h in getattr(node, "handlers", []):
                    visit(h.body)

    visit(tree.body)
    if dotted == "raylastic":  # lazy exports: _EXPORTS keys and _SUBMODULES
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                    node.targets[0].id in ("_EXPORTS", "_SUBMODULES"):
                value = ast.literal_eval(node.value)
                names.update(value)
    return names


def unresolved(dotted: str) -> Optional[str]:
    """None if ``dotted`` (``raylastic.a.b.C.method``) names something that exists, else
    what is missing. Stops at the first name that is not a module (its attributes are not
    checked)."""
    parts = dotted.split(".")
    if parts[0] != "raylastic":
        return None
    module = "raylastic"
    for part in parts[1:]:
        sub = f"{module}.{part}"
        if _module_file(sub) is not None:
            module = sub
            continue
        if part in _top_level_names(module):
            return None
        return f"{sub} (no module {sub} and {module} defines no {part!r})"
    return None


def _python_names(tree: ast.AST) -> List[str]:
    """raylastic names a block imports or uses as attributes of ``raylastic``."""
    out: List[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "raylastic" \
                and node.level == 0:
            out += [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.split(".")[0] == "raylastic"]
        elif isinstance(node, ast.Attribute):
            chain = []
            n: ast.AST = node
            while isinstance(n, ast.Attribute):
                chain.append(n.attr)
                n = n.value
            if isinstance(n, ast.Name) and n.id == "raylastic":
                out.append(".".join(["raylastic"] + chain[::-1]))
    return out


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where() for b in PYTHON_BLOCKS])
def test_python_block(block: Block):
    try:
        tree = compile(block.code, block.where(), "exec", ast.PyCF_ONLY_AST)
    except SyntaxError as e:
        if block.marker == "fragment":
            return
        pytest.fail(f"{block.where()}: python block does not compile: {e}\n{block.code}")
    for name in _python_names(tree):
        problem = unresolved(name)
        assert problem is None, f"{block.where()}: {name} does not exist: {problem}"


def test_there_are_blocks_to_check():
    assert len(PYTHON_BLOCKS) > 10 and len(SHELL_BLOCKS) > 10
    assert any(b.doc.name == "README.md" for b in PYTHON_BLOCKS + SHELL_BLOCKS)


# -- inline code in prose -----------------------------------------------------------------

INLINE = re.compile(r"(?<![\w`])`([^`\n]+)`")
DOTTED = re.compile(r"\braylastic(?:\.[A-Za-z_]\w*)+")


def _prose(path: Path) -> Iterator[tuple]:
    """(line number, text) of lines outside fenced blocks."""
    inside = None
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = re.match(r"^\s*(`{3,})", line)
        if m:
            inside = None if inside == m.group(1) else (inside or m.group(1))
            continue
        if inside is None:
            yield n, line


@pytest.mark.parametrize("doc", DOC_FILES, ids=[d.name for d in DOC_FILES])
def test_inline_code_names_exist(doc: Path):
    missing = []
    for n, line in _prose(doc):
        for span in INLINE.findall(line):
            for m in DOTTED.finditer(span):
                rest = span[m.end():]
                if rest.startswith(("/", "-", ":")):  # a label (raylastic.io/market) or a file name
                    continue
                problem = unresolved(m.group(0))
                if problem:
                    missing.append(f"{doc.relative_to(REPO)}:{n}: `{span}`: {problem}")
    assert not missing, "\n".join(missing)


# -- shell blocks -------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _cli_help(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "raylastic", *args, "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"raylastic {' '.join(args)} --help failed:\n{proc.stdout}{proc.stderr}"
    return proc.stdout


@functools.lru_cache(maxsize=None)
def _subcommands() -> Set[str]:
    text = _cli_help()
    body = text.split("commands:", 1)[1] if "commands:" in text else ""
    subs = set()
    for line in body.splitlines():
        m = re.match(r"^\s{2,}([a-z][\w-]*)\b", line)
        if m:
            subs.add(m.group(1))
    return subs


@functools.lru_cache(maxsize=None)
def _make_targets() -> Set[str]:
    targets = set()
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+(?:\s+[A-Za-z0-9_.-]+)*)\s*:(?!=)", line)
        if m and not line.startswith(("\t", " ")):
            targets.update(m.group(1).split())
    return targets


def _flags(tokens: List[str]) -> List[str]:
    return [t.split("=", 1)[0] for t in tokens if t.startswith("--") and len(t) > 2]


def _source_has_flag(path: Path, flag: str) -> bool:
    text = path.read_text(encoding="utf-8")
    return f'"{flag}"' in text or f"'{flag}'" in text


def _commands(code: str) -> Iterator[List[str]]:
    """Commands of a shell block as token lists (continuations joined, comments dropped,
    ``<placeholders>`` kept as one token, split at ``&&``, ``||``, ``;``, ``|``)."""
    text = re.sub(r"\\\n", " ", code)
    for raw in text.splitlines():
        line = re.sub(r"<[^<>\n]*>", "PLACEHOLDER", raw)
        line = re.sub(r"\[(--[\w-]+)\]", r"\1", line)  # [--dry-run]: an optional flag
        if line.lstrip().startswith("$ "):
            line = line.lstrip()[2:]
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        try:
            tokens = list(lex)
        except ValueError:  # an unbalanced quote in prose-like text
            tokens = line.split("#", 1)[0].split()
        cmd: List[str] = []
        for t in tokens:
            if t in ("&&", "||", ";", "|", "&"):
                if cmd:
                    yield cmd
                cmd = []
            else:
                cmd.append(t)
        if cmd:
            yield cmd


def _check_paths(tokens: List[str], cwd: Path) -> List[str]:
    problems = []
    for t in tokens:
        t = t.split("=", 1)[1] if t.startswith("--") and "=" in t else t
        if not t.startswith(REPO_DIRS) or "PLACEHOLDER" in t or "$" in t:
            continue
        path = t.rstrip(",.:)")
        if any(ch in path for ch in "*?["):
            if not glob.glob(str(REPO / path)):
                problems.append(f"no file matches {path}")
        elif not (REPO / path).exists() and not (cwd / path).exists():
            problems.append(f"{path} does not exist")
    return problems


def _check_python(args: List[str], cwd: Path) -> List[str]:
    """``args`` follow the interpreter."""
    if not args:
        return []
    if args[0] == "-m" and len(args) > 1:
        module, rest = args[1], args[2:]
        if module == "raylastic":
            return _check_raylastic_cli(rest)
        if module.startswith("raylastic."):
            path = _module_file(module)
            if path is None:
                return [f"python -m {module}: no such module"]
            return [f"python -m {module}: no flag {f}" for f in _flags(rest) if not _source_has_flag(path, f)]
        return []
    if args[0] == "-c":
        return []
    script = args[0]
    if script.endswith(".py") and "PLACEHOLDER" not in script:
        path = cwd / script if (cwd / script).exists() else REPO / script
        if not path.is_file():
            return [f"{script} does not exist"]
        return [f"{script}: no flag {f}" for f in _flags(args[1:]) if not _source_has_flag(path, f)]
    return []


def _check_raylastic_cli(args: List[str]) -> List[str]:
    if not args or args[0].startswith("-"):
        return [f"raylastic: no flag {f}" for f in _flags(args) if f not in ("--help", "--version")]
    sub = args[0]
    if sub not in _subcommands():
        return [f"raylastic {sub}: no such subcommand (raylastic --help lists {sorted(_subcommands())})"]
    text = _cli_help(sub)
    return [f"raylastic {sub}: no flag {f}" for f in _flags(args[1:]) if f not in text]


def check_command(tokens: List[str], cwd: Path = REPO) -> List[str]:
    while tokens and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", tokens[0]):  # VAR=value cmd
        tokens = tokens[1:]
    while tokens and tokens[0] in ("sudo", "time", "setsid", "nohup", "exec"):
        tokens = tokens[1:]
    if not tokens:
        return []
    prog, args = tokens[0], tokens[1:]
    problems = []
    if prog in ("export", "echo", "cd", "mkdir"):
        return []
    if os.path.basename(prog) in ("python", "python3"):
        problems += _check_python(args, cwd)
    elif prog == "raylastic":
        problems += _check_raylastic_cli(args)
    elif prog == "make":
        targets = [a for a in args if not a.startswith("-") and "=" not in a]
        problems += [f"make {t}: no such target in the Makefile" for t in targets if t not in _make_targets()]
    elif prog == "torchrun":
        scripts = [i for i, a in enumerate(args) if a.endswith(".py")]
        if scripts:
            problems += _check_python(args[scripts[0]:], cwd)
    elif prog == "ray" and args[:2] == ["job", "submit"] and "--" in args:
        split = args.index("--")
        workdir = cwd
        for i, a in enumerate(args[:split]):
            if a == "--working-dir" and i + 1 < split:
                workdir = REPO / args[i + 1]
            elif a.startswith("--working-dir="):
                workdir = REPO / a.split("=", 1)[1]
        return _check_paths(args[:split], cwd) + check_command(args[split + 1:], workdir)
    return problems + _check_paths(args, cwd)


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=[b.where() for b in SHELL_BLOCKS])
def test_shell_block(block: Block):
    problems = []
    for tokens in _commands(block.code):
        problems += [f"{block.where()}: `{' '.join(tokens)}`: {p}" for p in check_command(tokens)]
    assert not problems, "\n".join(problems)


# -- the checker itself -------------------------------------------------------------------

@pytest.mark.parametrize("command, problem", [
    ("raylastic report RUN --json", None),
    ("python -m raylastic report RUN --no-such-flag", "no flag --no-such-flag"),
    ("raylastic nosuchcommand x", "no such subcommand"),
    ("make test", None),
    ("make no-such-target", "no such target"),
    ("python examples/elastic_script.py --steps 40", None),
    ("python examples/elastic_script.py --no-such-flag", "no flag --no-such-flag"),
    (".venv/bin/python benchmarks/no_such_benchmark.py", "does not exist"),
    ("torchrun --nnodes=2:4 examples/torchrun_azure/train.py --checkpoint /tmp/x", None),
    ("ray job submit --working-dir examples/job_submit -- python elastic_script.py --steps 4", None),
    ("python -m raylastic.rendezvous.cleanup --endpoint E --older-than 7d", None),
    ("python -m raylastic.no_such_module", "no such module"),
])
def test_command_checker(command, problem):
    found = [p for tokens in _commands(command) for p in check_command(tokens)]
    if problem is None:
        assert found == []
    else:
        assert any(problem in p for p in found), found


def test_name_checker():
    assert unresolved("raylastic.testing.cluster.LocalCluster") is None
    assert unresolved("raylastic.ElasticState") is None
    assert unresolved("raylastic.sim.SpotCloud.start_trace") is None
    assert unresolved("raylastic.testing.LocalCluster") is not None
    assert unresolved("raylastic.policies.CapacityPolicy") is not None


# -- runnable blocks ----------------------------------------------------------------------

RUN_ONE_RANK = textwrap.dedent("""
    import runpy, sys, tempfile
    from raylastic import session as session_mod
    from raylastic.checkpoint.storage import Storage
    from raylastic.session import GroupSpec, RestoreInfo, Session

    ns = runpy.run_path(sys.argv[1], run_name="snippet")  # not __main__: fit() is not called
    spec = GroupSpec(epoch=0, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                     master_addr="127.0.0.1", master_port=0, backend="gloo")
    sess = Session(spec=spec, storage=Storage(tempfile.mkdtemp()), run_rel="snippet", run_name="snippet",
                   restore=RestoreInfo())
    session_mod._set_session(sess)
    ns["train_func"]({"steps": 200})
    reports = [r.metrics for r in sess._records]
    assert len(reports) == 200, len(reports)
    assert reports[-1]["step"] == 200 and reports[-1]["loss"] < 1e-6, reports[-1]
    print("SNIPPET_OK", reports[-1])
""")

RUNNABLE = [b for b in PYTHON_BLOCKS if b.marker == "run-train-func"]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where() for b in RUNNABLE])
def test_train_func_block_runs_on_one_rank(block: Block, tmp_path):
    """The README quickstart's train function, run on one rank in a local session: the
    ElasticState / ElasticDataLoader calls work and the loss reaches what the README
    shows (world size 1; no Ray cluster, no fit())."""
    snippet = tmp_path / "snippet.py"
    snippet.write_text(block.code, encoding="utf-8")
    runner = tmp_path / "run_one_rank.py"
    runner.write_text(RUN_ONE_RANK, encoding="utf-8")
    proc = subprocess.run([sys.executable, str(runner), str(snippet)], cwd=REPO, capture_output=True,
                          text=True, timeout=400)
    assert proc.returncode == 0 and "SNIPPET_OK" in proc.stdout, f"{block.where()}:\n{proc.stdout}{proc.stderr}"


def test_the_readme_quickstart_is_run():
    assert [b.doc.name for b in RUNNABLE] == ["README.md"]
