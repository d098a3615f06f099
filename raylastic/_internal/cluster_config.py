"""A Ray cluster config read into what ``raylastic check`` checks: node groups, installs, images.

Why a module of its own: a cluster-launcher YAML and a KubeRay manifest (a RayCluster, or a
RayJob's ``rayClusterSpec``) say the same things in different places: the head and worker
node types or groups, their resources and labels, whether they launch spot capacity, the
environment their ``ray start`` gets, what installs raylastic, which images run, and
whether Ray token auth is on. The readers here (``_launcher``, ``_kuberay``) bring both into
one :class:`Cluster` with a :class:`Group` per node type, so ``raylastic/check.py`` checks
either kind the same way. A part that cannot be read is a finding in the :class:`Report`,
never an exception the user sees: the YAML is untrusted, and ``raylastic check`` never
ends in a traceback.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from raylastic.policies.node_types import _kuberay_entries

SETUP_KEYS = ("initialization_commands", "setup_commands", "head_setup_commands", "worker_setup_commands")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
SPOT_KEYS = {
    "cloud.google.com/gke-spot": "gcp",
    "eks.amazonaws.com/capacityType": "aws",
    "karpenter.sh/capacity-type": "aws",
    "kubernetes.azure.com/scalesetpriority": "azure",
}
PIP_VALUE_OPTS = {
    "-r",
    "--requirement",
    "-c",
    "--constraint",
    "-e",
    "--editable",
    "-i",
    "--index-url",
    "-f",
    "--extra-index-url",
    "--find-links",
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--trusted-host",
    "--upgrade-strategy",
    "--cache-dir",
    "--only-binary",
    "--no-binary",
    "-C",
    "--config-settings",
}
README = "cluster-configs/README.md"


class Report(List[Tuple[str, str, str, str]]):  # (severity, where, problem, fix)
    """Findings in the order they are found: the readers here add theirs to the checks' own."""

    def error(self, where: str, problem: str, fix: str) -> None:
        self.append(("error", where, problem, fix))

    def warn(self, where: str, problem: str, fix: str) -> None:
        self.append(("warning", where, problem, fix))

    @property
    def errors(self) -> int:
        return sum(f[0] == "error" for f in self)


@dataclass
class Group:  # the head, or one worker node type (launcher) / worker group (KubeRay)
    where: str
    head: bool
    resources: Dict[str, Any]
    labels: Dict[str, Any]
    spot: Optional[bool]  # launches spot capacity; None: cannot tell
    env: Dict[str, str]  # what its `ray start`, and so its workers, get
    avoids_spot: bool = True  # KubeRay: an affinity keeps it off spot nodes


@dataclass
class Cluster:
    kind: str  # "launcher", "RayCluster" or "RayJob"
    cloud: Optional[str]  # aws / azure / gcp, where the config says
    groups: List[Group]
    installs: List[Tuple[str, str]]  # (where, shell command or runtime env)
    images: List[Tuple[str, str]]  # (where, image)
    auth: bool


def _m(x: Any) -> Dict[str, Any]:
    """A copy of a mapping, else ``{}``: untrusted YAML may put a list or a scalar anywhere."""
    return dict(x) if isinstance(x, Mapping) else {}


def _cmds(doc: Mapping[str, Any], key: str) -> List[str]:
    value = doc.get(key)  # Ray's own validation rejects anything but a list of strings
    return [c for c in value if isinstance(c, str)] if isinstance(value, list) else []


def _segments(cmd: str) -> List[List[str]]:
    out = []
    for seg in re.split(r"&&|\|\||;|\n", cmd):
        try:
            out.append(shlex.split(seg))
        except ValueError:
            out.append(seg.split())
    return out


def _env(texts: Sequence[str]) -> Dict[str, str]:
    """``K=V`` in front of a command (each is its own shell) and health checks in --system-config."""
    env: Dict[str, str] = {}
    for text in texts:
        for toks in _segments(text):
            for tok in toks:
                if not re.match(r"[A-Za-z_][A-Za-z0-9_]*=", tok):
                    break
                key, value = tok.split("=", 1)
                env[key] = value
        env.update((f"RAY_{k}", v) for k, v in re.findall(r'"(health_check_\w+)"\s*:\s*"?([\w.]+)', text))
    return env


def _pip_requirements(cmd: str) -> List[str]:
    reqs = []
    for toks in _segments(cmd):
        for i, tok in enumerate(toks[:-1]):
            if tok.rsplit("/", 1)[-1] in ("pip", "pip3") and toks[i + 1] == "install":
                args, j = toks[i + 2 :], 0
                while j < len(args):
                    if not args[j].startswith("-"):
                        reqs.append(args[j])
                    j += 2 if args[j] in PIP_VALUE_OPTS else 1
                break
    return reqs


def _vm_spot(cloud: Optional[str], nc: Mapping[str, Any]) -> Optional[bool]:
    if cloud == "aws":
        return _m(nc.get("InstanceMarketOptions")).get("MarketType") == "spot"
    if cloud == "azure":
        return _m(nc.get("azure_arm_parameters")).get("priority") in ("Spot", "Low")
    if cloud == "gcp":
        sched = nc.get("scheduling")
        return any(
            _m(s).get("provisioningModel") == "SPOT" or _m(s).get("preemptible") is True
            for s in (sched if isinstance(sched, list) else [sched])
        )
    return None


def _launcher(doc: Mapping[str, Any], rep: Report) -> Optional[Cluster]:
    provider = _m(doc.get("provider"))
    cloud = provider.get("type") if provider.get("type") in ("aws", "azure", "gcp") else None  # else: labels only
    types = doc.get("available_node_types")
    if not isinstance(types, Mapping) or not types:
        rep.error(
            "available_node_types",
            "missing or not a mapping of node types",
            "define a head and the spot / on_demand node types (cluster-configs/aws-spot.yaml)",
        )
        return None
    head = doc.get("head_node_type")
    if head not in types:
        rep.error("head_node_type", f"{head!r} is not one of available_node_types", "name the head's node type")
    head_env = _env(_cmds(doc, "head_start_ray_commands"))
    worker_env = _env(_cmds(doc, "worker_start_ray_commands"))
    groups = []
    for name, spec in types.items():
        where = f"available_node_types.{name}"
        if not isinstance(spec, Mapping):
            rep.error(where, "is not a mapping", "give it resources, labels and node_config")
            continue
        env = head_env if name == head else worker_env
        groups.append(
            Group(
                where,
                name == head,
                _m(spec.get("resources")),
                _m(spec.get("labels")),
                _vm_spot(cloud, _m(spec.get("node_config"))),
                env,
            )
        )
    docker = _m(doc.get("docker"))
    images = [(f"docker.{k}", str(docker[k])) for k in ("image", "head_image", "worker_image") if docker.get(k)]
    installs = [(key, c) for key in SETUP_KEYS for c in _cmds(doc, key)]
    return Cluster("launcher", cloud, groups, installs, images, head_env.get("RAY_AUTH_MODE") == "token")


def _spot_keys(pod: Mapping[str, Any]) -> Tuple[bool, bool]:
    """(selects spot nodes, has an affinity keeping it off them), on GKE, EKS, Karpenter, AKS."""
    terms = _m(
        _m(_m(pod.get("affinity")).get("nodeAffinity")).get("requiredDuringSchedulingIgnoredDuringExecution")
    ).get("nodeSelectorTerms")
    exprs = [_m(e) for t in (terms if isinstance(terms, list) else []) for e in _m(t).get("matchExpressions") or []]
    is_spot = ("true", "spot").__contains__
    sel = any(k in SPOT_KEYS and is_spot(str(v).lower()) for k, v in _m(pod.get("nodeSelector")).items()) or any(
        e.get("key") in SPOT_KEYS
        and e.get("operator") == "In"
        and any(is_spot(str(v).lower()) for v in e.get("values") or [])
        for e in exprs
    )
    avoid = all(
        any(e.get("key") == k and e.get("operator") in ("NotIn", "DoesNotExist") for e in exprs) for k in SPOT_KEYS
    )
    return sel, avoid


def _kube_group(where: str, group: Mapping[str, Any], head: bool) -> Tuple[Group, Dict[str, Any]]:
    """A KubeRay group (resources, labels as node_types_from_cluster_config reads them) and its pod."""
    pod = _m(_m(group.get("template")).get("spec"))
    entry = next(iter(_kuberay_entries({"spec": {"workerGroupSpecs": [group]}}, where).values()))
    cs = pod.get("containers")
    c = _m(cs[0]) if isinstance(cs, list) and cs else {}
    limits = {**_m(_m(c.get("resources")).get("requests")), **_m(_m(c.get("resources")).get("limits"))}
    res = {"CPU": limits.get("cpu"), **_m(entry["resources"])}
    env = _env([str(_m(group.get("rayStartParams")).get("system-config", ""))])
    env.update({str(_m(e).get("name")): str(_m(e).get("value", "<valueFrom>")) for e in c.get("env") or []})
    sel, avoid = _spot_keys(pod)
    return Group(where, head, res, _m(entry["labels"]), True if sel else None, env, avoid), pod


def _kuberay(doc: Mapping[str, Any], rep: Report) -> Optional[Cluster]:
    spec, where, images, installs = _m(doc.get("spec")), "spec", [], []
    if doc.get("kind") == "RayJob":
        if not isinstance(spec.get("rayClusterSpec"), Mapping):
            rep.error(
                "spec.rayClusterSpec",
                "missing: nothing to check (clusterSelector runs on an existing cluster)",
                "check that cluster's RayCluster manifest",
            )
            return None
        images += [
            ("spec.submitterPodTemplate", str(_m(c).get("image")))
            for c in _m(_m(spec.get("submitterPodTemplate")).get("spec")).get("containers") or []
        ]
        installs.append(("spec.runtimeEnvYAML", str(spec.get("runtimeEnvYAML") or "")))
        spec, where = spec["rayClusterSpec"], "spec.rayClusterSpec"
    version = str(spec.get("rayVersion", ""))
    if not version.startswith("2.60"):
        rep.warn(f"{where}.rayVersion", f"{version!r}: raylastic is tested with Ray 2.60", 'rayVersion: "2.60.0"')
    groups, pods = [], []
    raw_workers = spec.get("workerGroupSpecs")
    workers: List[Any] = raw_workers if isinstance(raw_workers, list) else []
    specs = [(f"{where}.headGroupSpec", _m(spec.get("headGroupSpec")), True)] + [
        (f"{where}.workerGroupSpecs[{i}]", _m(g), False) for i, g in enumerate(workers)
    ]
    for w, g, head in specs:
        if not head and not DNS_LABEL.fullmatch(str(g.get("groupName", ""))):
            rep.error(
                w,
                f"groupName {g.get('groupName')!r} is not a DNS label: pod names are built from it",
                "lowercase letters, digits and '-' (the node type name comes from the resource)",
            )
        try:
            grp, pod = _kube_group(w, g, head)
        except (ValueError, TypeError, AttributeError) as e:  # what node_types_from_cluster_config raises
            rep.error(w, f"raylastic cannot read this group: {e}", f"compare it with {README}")
            continue
        groups.append(grp)
        pods.append(pod)
        images += [(w, str(_m(c).get("image"))) for c in pod.get("containers") or []]
    cloud = next((SPOT_KEYS[k] for p in pods for k in _m(p.get("nodeSelector")) if k in SPOT_KEYS), None)
    auth = _m(spec.get("authOptions")).get("mode") == "token" or any(
        g.head and g.env.get("RAY_AUTH_MODE") == "token" for g in groups
    )
    return Cluster(str(doc.get("kind")), cloud, groups, installs, images, auth)
