"""``raylastic check CLUSTER_CONFIG...``: will this cluster config run raylastic?

Why: a config whose node types no worker asks for, or that never installs raylastic, fails
only after the cloud has billed the first nodes. Offline and in well under a second this
reads a Ray cluster-launcher YAML or KubeRay manifests (RayCluster, RayJob, NetworkPolicy;
several documents per file) and checks node types and markets, the resources workers ask
for, preemption notice sources, Ray's health checks, raylastic on the nodes, prices, token
auth, pinned installs and images, and values to fill in (``EDIT``, documentation CIDRs).
One line per finding, ``PATH: SEVERITY: WHERE: PROBLEM; fix: FIX``; exit 2 on an ``error``
(the run cannot work as configured) or unreadable input, else 0. The YAML is untrusted:
``yaml.safe_load_all`` only, bounded in size and walk; never a traceback. Reading either
kind of config into node groups is ``raylastic/_internal/cluster_config.py``; the checks
are here.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import yaml

from raylastic._internal.cluster.notices import SOURCES_ENV, sources_from_env
from raylastic._internal.cluster_config import (
    README,
    Cluster,
    Group,
    Report,
    _kuberay,
    _launcher,
    _m,
    _pip_requirements,
)
from raylastic.policies.node_types import (
    MARKET_LABEL,
    NODE_TYPE_LABEL,
    RESOURCE_PREFIX,
    MissingPriceError,
    PriceTable,
    node_types_from_cluster_config,
    validate_node_type_name,
)

MAX_BYTES, MAX_VALUES = 4 * 2**20, 200_000
HEALTH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}
DEFAULT_NAMES = ("spot", "on_demand")  # CapacityPolicy's default node types
PLACEHOLDER = re.compile(r"(?<![A-Za-z])EDIT(?![A-Za-z])|\b(?:192\.0\.2|198\.51\.100|203\.0\.113)\.\d{1,3}/\d")


class CheckError(Exception):
    """Input that cannot be checked at all (unreadable, not YAML, too large)."""


def _num(x: Any) -> Optional[float]:
    try:
        v = float("nan") if isinstance(x, bool) else float(x[:-1]) / 1000 if str(x).endswith("m") else float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _clean(text: str) -> str:
    """Escape what a terminal would interpret: the text comes from untrusted YAML."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _walk(doc: Any, prefix: str, rep: Report) -> None:
    """Flag placeholders and open CIDRs; bounded, as aliases can make a small file huge."""
    budget = MAX_VALUES
    stack: List[Tuple[Any, str, Tuple[int, ...]]] = [(doc, prefix, ())]
    while stack:
        node, path, ancestors = stack.pop()
        budget -= 1
        if budget < 0:
            raise CheckError(f"more than {MAX_VALUES} values (YAML aliases?): not checked")
        if isinstance(node, (Mapping, list)):
            if id(node) in ancestors:
                raise CheckError(f"{path or 'a document'} contains itself (a recursive YAML alias)")
            items = list(node.items() if isinstance(node, Mapping) else enumerate(node))
            for k, v in reversed(items):
                sub = f"{path}[{k}]" if isinstance(node, list) else f"{path}.{k}" if path else str(k)
                stack.append((v, sub, ancestors + (id(node),)))
        elif isinstance(node, str):
            if PLACEHOLDER.search(node):
                rep.warn(path, f"{node[:100]!r} is a placeholder", f"fill in your value ({README})")
            if "0.0.0.0/0" in node or "::/0" in node:
                rep.warn(path, f"{node[:100]!r} admits the whole internet", "allow your own CIDR only")


def _check_group(g: Group, c: Cluster, types: Dict[str, str], rep: Report) -> None:
    slots = [k for k in g.resources if isinstance(k, str) and k.startswith(RESOURCE_PREFIX)]
    if g.head:
        if g.spot:
            rep.error(g.where, "the head runs on spot: losing it loses the run", "put it on on-demand capacity")
        elif not g.avoids_spot:
            rep.warn(g.where, "nothing keeps the head off spot nodes", "add the shipped manifests' affinity")
        if slots:
            rep.error(g.where, f"the head carries {slots[0]!r}: workers would land on it", "drop it")
        return
    if not slots:
        return rep.warn(
            g.where,
            "no node_type:<name> resource: raylastic never places a worker here",
            f"add {{'node_type:<name>': 1}} and the raylastic.io labels ({README})",
        )
    name, market = slots[0][len(RESOURCE_PREFIX) :], g.labels.get(MARKET_LABEL)
    try:
        validate_node_type_name(name, f"resource {slots[0]!r}")
    except ValueError as e:
        return rep.error(g.where, str(e).split(": use")[0], "rename the node type (1-63 letters, digits, - _ .)")
    if market not in ("spot", "on_demand"):
        return rep.error(g.where, f"label {MARKET_LABEL}={market!r}", f"set {MARKET_LABEL} to spot or on_demand")
    if g.labels.get(NODE_TYPE_LABEL, name) != name:
        rep.error(
            g.where,
            f"label {NODE_TYPE_LABEL}={g.labels[NODE_TYPE_LABEL]!r} but resource {slots[0]!r}",
            "make them name the same node type",
        )
    if g.spot is not None and g.spot != (market == "spot"):
        rep.error(
            g.where,
            f"labelled {market} but launches {'spot' if g.spot else 'on-demand'} capacity",
            "make node_config / node selectors and the market label agree",
        )
    elif g.spot is None and market == "spot" and c.kind != "launcher":
        rep.warn(g.where, "labelled spot but selects no spot nodes", "add your cloud's spot nodeSelector")
    elif market == "on_demand" and not g.avoids_spot:
        rep.warn(g.where, "nothing keeps these on-demand pods off spot nodes", "add the node affinity")
    n, cpu = _num(g.resources[slots[0]]), _num(g.resources.get("CPU"))
    if n is None or n <= 0:
        rep.error(g.where, f"{slots[0]}={g.resources[slots[0]]!r}", "one unit per worker slot: a number > 0")
    elif cpu is not None and cpu < n:
        rep.error(
            g.where, f"{cpu:g} CPU for {n:g} worker slot(s): each worker asks for 1 CPU", "at least one CPU per slot"
        )
    types[name] = market
    raw = g.env.get(SOURCES_ENV)
    if market == "spot" and raw is None:
        rep.warn(
            g.where,
            f"{SOURCES_ENV} not set: spot preemption notices are ignored and steps lost",
            f"set {SOURCES_ENV}={c.cloud or 'aws|azure|gcp'} in the workers' environment",
        )
    elif raw is not None:
        try:
            names = [s.name for s in sources_from_env({SOURCES_ENV: raw})]
        except ValueError as e:
            return rep.error(g.where, str(e), "fit() refuses this value")
        if market == "spot" and c.cloud and c.cloud not in names:
            rep.warn(g.where, f"{SOURCES_ENV}={raw!r} on {c.cloud}", f"set {SOURCES_ENV}={c.cloud}")


def _check(c: Cluster, doc: Mapping[str, Any], path: str, rep: Report) -> None:
    types: Dict[str, str] = {}
    errors = rep.errors
    for g in c.groups:
        _check_group(g, c, types, rep)
    spot = [n for n, m in types.items() if m == "spot"]
    od = [n for n, m in types.items() if m == "on_demand"]
    if len(spot) != 1 or len(od) != 1:
        rep.error(
            "node types",
            f"spot {spot}, on-demand {od}: CapacityPolicy needs exactly one of each",
            f"define one spot and one on_demand node type ({README})",
        )
    else:
        if rep.errors == errors:
            try:
                node_types_from_cluster_config(doc)
            except Exception as e:  # noqa: BLE001 - what the user's own call would raise
                rep.error("node types", f"node_types_from_cluster_config fails: {e}", "follow the message")
        if (spot[0], od[0]) != DEFAULT_NAMES:
            rep.warn(
                "node types",
                f"named {spot[0]!r} / {od[0]!r}: CapacityPolicy's defaults ask for "
                "node_type:spot / node_type:on_demand, which no node here offers",
                f'pass CapacityPolicy(node_types=node_types_from_cluster_config("{path}"))',
            )
    _check_prices(doc, types, rep)
    missing = [k for k in HEALTH if k not in next((g.env for g in c.groups if g.head), {})]
    if missing:
        rep.warn(
            "head",
            f"{', '.join(missing)} not set: Ray notices a lost node after ~14 s",
            " ".join(f"{k}={v}" for k, v in HEALTH.items()) + " in the head's environment (~3 s)",
        )
    if not c.auth:
        rep.warn(
            "auth",
            "Ray token auth is off: whoever reaches the Ray ports runs code",
            "RAY_AUTH_MODE=token in front of every ray start (KubeRay: authOptions: {mode: token})",
        )
    _check_installs(c, rep)


def _check_prices(doc: Mapping[str, Any], types: Mapping[str, str], rep: Report) -> None:
    try:
        prices = PriceTable.from_cluster_config(doc).usd_per_hour
    except MissingPriceError:
        return rep.warn(
            "prices",
            "none in the config: the cost objective then assumes spot is cheaper",
            "add metadata.raylastic.prices_usd_per_hour (KubeRay: the prices annotation)",
        )
    except Exception as e:  # noqa: BLE001 - what PriceTable would refuse
        return rep.error("prices", str(e), "one finite number >= 0 of USD per hour per node type")
    if any(n not in prices for n in types):
        rep.warn("prices", f"no price for {sorted(n for n in types if n not in prices)}", "add USD per hour")


def _check_installs(c: Cluster, rep: Report) -> None:
    found = any("raylastic" in img.lower() for _, img in c.images) or any(
        "raylastic" in text and "pip" in text for where, text in c.installs if where == "spec.runtimeEnvYAML"
    )
    for where, cmd in c.installs:
        for req in _pip_requirements(cmd):
            found = found or "raylastic" in req.lower()
            if not (any(s in req for s in ("==", "@", "/")) or req.split("[")[0].endswith((".whl", ".tar.gz"))):
                rep.warn(where, f"pip install {req!r} is not pinned", "name==version, a wheel, a URL at a commit")
    if not found:
        (rep.error if c.kind == "launcher" else rep.warn)(
            "install",
            "nothing installs raylastic on the nodes (setup commands, image, runtime env)",
            "pip install the raylastic wheel in the setup commands, or use an image that has it",
        )
    for where, img in c.images:
        name, _, tag = img.rpartition(":") if ":" in img.rsplit("/", 1)[-1] else (img, "", "")
        if "@sha256:" not in img and tag in ("", "latest") or name == "rayproject/ray" and tag[:5] != "2.60.":
            rep.warn(where, f"image {img!r} is not pinned to Ray 2.60", "a tag like rayproject/ray:2.60.0-py311")


def _load(path: Path) -> List[Mapping[str, Any]]:
    try:
        if path.stat().st_size > MAX_BYTES:
            raise CheckError(f"larger than {MAX_BYTES} bytes")
        docs = [d for d in yaml.safe_load_all(path.read_bytes().decode("utf-8")) if d is not None]
    except (OSError, UnicodeDecodeError) as e:
        raise CheckError(f"cannot read it: {e}") from None
    except (yaml.YAMLError, ValueError, TypeError, OverflowError, RecursionError) as e:
        raise CheckError(f"not valid YAML: {' '.join(str(e).split())[:300]}") from None
    if not docs:
        raise CheckError("empty: no YAML document")
    for i, d in enumerate(docs):
        if not isinstance(d, Mapping):
            raise CheckError(f"document {i + 1} is a {type(d).__name__}, not a mapping (a cluster config)")
    return docs


def check_file(path: str) -> Report:
    """Every finding for one file (see the module docstring); never raises."""
    rep, p = Report(), Path(path)
    try:
        docs = _load(p)
        for d in docs:
            _walk(d, f"{d.get('kind')} {_m(d.get('metadata')).get('name')}" if len(docs) > 1 else "", rep)
        recognised = False
        for d in docs:
            kind, cluster = d.get("kind"), None
            if kind in ("RayCluster", "RayJob"):
                cluster = _kuberay(d, rep)
            elif kind is None and ("available_node_types" in d or "provider" in d):
                cluster = _launcher(d, rep)
            elif kind != "NetworkPolicy":
                continue
            recognised = True
            if cluster is not None:
                _check(cluster, d, path, rep)
        if not recognised:
            rep.error(
                "file",
                "neither a Ray cluster-launcher config nor a KubeRay RayCluster / RayJob manifest",
                "pass a cluster config (see cluster-configs/)",
            )
    except CheckError as e:
        rep.error("file", str(e), "pass a readable YAML cluster config")
    except Exception as e:  # noqa: BLE001 - untrusted input must never end in a traceback
        rep.error("file", f"cannot be checked: {type(e).__name__}: {str(e)[:200]}", "see cluster-configs/")
    return rep


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="raylastic check",
        description="Check Ray cluster configs (launcher YAML, KubeRay manifests) "
        "against what raylastic needs, offline. Exit 0: nothing blocks a run; 2: an error does.",
    )
    parser.add_argument("configs", nargs="+", metavar="CLUSTER_CONFIG")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return 0 if e.code in (0, None) else 2
    worst = 0
    for path in args.configs:
        rep = check_file(path)
        for severity, where, problem, fix in rep:
            print(_clean(f"{path}: {severity}: {where}: {problem}; fix: {fix}"))
        verdict = "blocked: fix the errors above" if rep.errors else "ok: nothing blocks a run"
        print(_clean(f"{path}: {verdict} ({rep.errors} error(s), {len(rep) - rep.errors} warning(s))"))
        worst = 2 if rep.errors else worst
    return worst


if __name__ == "__main__":
    sys.exit(main())
