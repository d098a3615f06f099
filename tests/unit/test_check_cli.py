"""`raylastic check CLUSTER_CONFIG`: passes every shipped config, explains a broken one.

Broken variants are built here from the shipped configs; each must give exit 2 and a line
naming the problem and its fix (blockers), or exit 0 with a warning (what a run survives).
Unreadable or hostile input (bad YAML, a list, aliases that explode, Python tags, binary)
gives exit 2 and one error line, never a traceback.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from raylastic.__main__ import main as raylastic_main
from raylastic.check import main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "cluster-configs").glob("*.yaml"))


def run(capsys, *paths):
    code = main([str(p) for p in paths])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out.splitlines()


def shipped(name):
    return yaml.safe_load((REPO / "cluster-configs" / name).read_text())


def write(tmp_path, doc, name="cluster.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(doc) if isinstance(doc, list) else yaml.safe_dump(doc))
    return path


def test_the_shipped_configs_are_there():
    assert {p.name for p in CONFIGS} >= {"aws-spot.yaml", "azure-spot.yaml", "gcp-spot.yaml",
                                        "kuberay-raycluster.yaml", "kuberay-rayjob.yaml",
                                        "kuberay-networkpolicy.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_passes(capsys, path):
    """Exit 0, and the only findings are the values the user fills in (EDIT placeholders)."""
    code, lines = run(capsys, path)
    assert code == 0, lines
    assert lines[-1].startswith(f"{path}: ok: nothing blocks a run (0 error(s)")
    findings = lines[:-1]
    assert all(": warning: " in line and "is a placeholder; fix: fill in your value" in line
               for line in findings), findings


def test_the_cli_runs_all_shipped_configs_in_seconds():
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "raylastic", "check", *map(str, CONFIGS)],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == "" and proc.stdout.count(": ok: nothing blocks a run") == len(CONFIGS)
    assert time.monotonic() - start < 30


def test_raylastic_main_dispatches_check(capsys):
    assert raylastic_main(["check", str(CONFIGS[0])]) == 0
    assert "nothing blocks a run" in capsys.readouterr().out
    assert raylastic_main(["check", "--help"]) == 0
    assert "CLUSTER_CONFIG" in capsys.readouterr().out
    assert raylastic_main(["check"]) == 2  # argparse's usage error, as a return code


def aws():
    return shipped("aws-spot.yaml")


def kuberay():
    return shipped("kuberay-raycluster.yaml")


def _head_on_spot(c):
    c["available_node_types"]["head"]["node_config"]["InstanceMarketOptions"] = {"MarketType": "spot"}


def _market_label_lies(c):
    c["available_node_types"]["on_demand"]["node_config"]["InstanceMarketOptions"] = {"MarketType": "spot"}


def _no_raylastic(c):
    c["head_setup_commands"] = c["worker_setup_commands"] = ["pip install --no-cache-dir torch==2.13.0"]


def _bad_sources(c):
    c["worker_start_ray_commands"][1] = c["worker_start_ray_commands"][1].replace(
        "RAYLASTIC_PREEMPTION_SOURCES=aws", "RAYLASTIC_PREEMPTION_SOURCES=ec2")


def _two_spot_types(c):
    c["available_node_types"]["on_demand"]["labels"]["raylastic.io/market"] = "spot"


def _slots_without_cpus(c):
    c["available_node_types"]["spot"]["resources"]["node_type:spot"] = 16


def _no_market_label(c):
    del c["available_node_types"]["spot"]["labels"]["raylastic.io/market"]


def _head_worker_slot(c):
    c["available_node_types"]["head"]["resources"] = {"node_type:spot": 1}


def _negative_price(c):
    c["metadata"]["raylastic"]["prices_usd_per_hour"]["spot"] = -1


def _no_node_types(c):
    c["available_node_types"] = ["spot", "on_demand"]


@pytest.mark.parametrize("breaks, expect", [
    (_head_on_spot, "the head runs on spot"),
    (_market_label_lies, "labelled on_demand but launches spot capacity"),
    (_no_raylastic, "nothing installs raylastic on the nodes"),
    (_bad_sources, "unknown source(s) ec2"),
    (_two_spot_types, "CapacityPolicy needs exactly one of each"),
    (_slots_without_cpus, "8 CPU for 16 worker slot(s)"),
    (_no_market_label, "label raylastic.io/market=None"),
    (_head_worker_slot, "the head carries 'node_type:spot'"),
    (_negative_price, "price for 'spot' is -1"),
    (_no_node_types, "available_node_types: missing or not a mapping"),
], ids=lambda x: getattr(x, "__name__", "")[1:])
def test_a_broken_launcher_config_is_blocked_with_the_fix(capsys, tmp_path, breaks, expect):
    config = aws()
    breaks(config)
    code, lines = run(capsys, write(tmp_path, config))
    assert code == 2, lines
    line, *_ = [line for line in lines if expect in line]  # one line per node type it touches
    assert ": error: " in line and "; fix: " in line.split(expect, 1)[1]
    assert lines[-1].endswith(" warning(s))") and ": blocked: " in lines[-1]


def _old_names(c):
    """The configs before issue 25: node types spot-gpu / on-demand-gpu."""
    for old, new in (("spot", "spot-gpu"), ("on_demand", "on-demand-gpu")):
        spec = c["available_node_types"].pop(old)
        spec["resources"] = {**{k: v for k, v in spec["resources"].items() if not k.startswith("node_type:")},
                             f"node_type:{new}": 1}
        spec["labels"]["raylastic.io/node-type"] = new
        c["available_node_types"][new] = spec
        prices = c["metadata"]["raylastic"]["prices_usd_per_hour"]
        prices[new] = prices.pop(old)


def _ray_defaults(c):
    """Ray's own start commands: no token auth, default health checks, no notices."""
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        del c[key]


def _unpinned(c):
    c["setup_commands"].append("pip install -U torch pyarrow 'boto3>=1.4'")
    c["docker"]["image"] = "rayproject/ray:latest-gpu"
    c["docker"]["head_image"] = "rayproject/ray:2.40.0-py311"


def _open_ssh(c):
    c["metadata"]["ssh_from"] = "0.0.0.0/0"


def _no_prices(c):
    del c["metadata"]


@pytest.mark.parametrize("changes, expect", [
    (_old_names, ["named 'spot-gpu' / 'on-demand-gpu'",
                  'node_types=node_types_from_cluster_config("']),
    (_ray_defaults, ["RAY_health_check_period_ms", "Ray token auth is off",
                     "RAYLASTIC_PREEMPTION_SOURCES not set", "RAYLASTIC_PREEMPTION_SOURCES=aws"]),
    (_unpinned, ["pip install 'torch' is not pinned", "pip install 'boto3>=1.4' is not pinned",
                 "'rayproject/ray:latest-gpu' is not pinned", "'rayproject/ray:2.40.0-py311' is not pinned"]),
    (_open_ssh, ["admits the whole internet"]),
    (_no_prices, ["prices: none in the config"]),
], ids=lambda x: getattr(x, "__name__", "")[1:])
def test_what_a_run_survives_is_a_warning_with_the_fix(capsys, tmp_path, changes, expect):
    config = aws()
    changes(config)
    code, lines = run(capsys, write(tmp_path, config))
    assert code == 0, lines
    for text in expect:
        assert any(text in line and ": warning: " in line and "; fix: " in line for line in lines), (text, lines)


def test_kuberay_problems(capsys, tmp_path):
    m = kuberay()
    m["spec"]["workerGroupSpecs"][1]["groupName"] = "on_demand"  # pods are named after it
    m["spec"]["headGroupSpec"]["template"]["spec"]["nodeSelector"] = {"cloud.google.com/gke-spot": "true"}
    del m["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]
    del m["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["env"]
    m["spec"].pop("authOptions")
    code, lines = run(capsys, write(tmp_path, m))
    assert code == 2
    text = "\n".join(lines)
    assert "groupName 'on_demand' is not a DNS label" in text
    assert ": error: spec.headGroupSpec: the head runs on spot" in text
    assert "workerGroupSpecs[0]: labelled spot but selects no spot nodes" in text
    assert "workerGroupSpecs[0]: RAYLASTIC_PREEMPTION_SOURCES not set" in text
    assert "Ray token auth is off" in text


def test_rayjob_without_its_own_cluster_is_explained(capsys, tmp_path):
    job = shipped("kuberay-rayjob.yaml")
    del job["spec"]["rayClusterSpec"]
    job["spec"]["clusterSelector"] = {"ray.io/cluster": "raylastic"}
    code, lines = run(capsys, write(tmp_path, job))
    assert code == 2
    assert any(": error: spec.rayClusterSpec: missing" in line and "RayCluster manifest" in line for line in lines)


def test_a_multi_document_manifest_is_read_whole(capsys, tmp_path):
    """RayCluster + NetworkPolicy in one file (kubectl's usual form)."""
    docs = [kuberay(), *yaml.safe_load_all((REPO / "cluster-configs" / "kuberay-networkpolicy.yaml").read_text())]
    code, lines = run(capsys, write(tmp_path, [d for d in docs if d]))
    assert code == 0, lines
    assert any(line.startswith(f"{tmp_path / 'cluster.yaml'}: warning: NetworkPolicy raylastic-raycluster.spec")
               for line in lines)


HOSTILE = {
    "not-yaml.yaml": ("a: [1, 2\n", "not valid YAML"),
    "list.yaml": ("- 1\n- 2\n", "document 1 is a list, not a mapping"),
    "second-doc.yaml": ("a: 1\n---\n42\n", "document 2 is a int, not a mapping"),
    "empty.yaml": ("", "empty: no YAML document"),
    "recursive.yaml": ("a: &a [*a]\n", "recursive YAML alias"),
    "laughs.yaml": ("a: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"b{i}: &b{i} [{', '.join(['*' + ('a' if i == 0 else f'b{i - 1}')] * 10)}]\n" for i in range(8)),
        "more than 200000 values"),
    "python-tag.yaml": ("x: !!python/object/apply:os.system ['echo pwned']\n", "not valid YAML"),
    "bad-date.yaml": ("x: 2001-13-45\n", "not valid YAML"),
    "secret.yaml": ("apiVersion: v1\nkind: Secret\n", "neither a Ray cluster-launcher config nor"),
    "scalar-fields.yaml": ("provider: 7\navailable_node_types: {head: 3}\nhead_node_type: head\n",
                           "available_node_types.head: is not a mapping"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_unreadable_or_hostile_input_is_one_error_and_exit_2(capsys, tmp_path, name):
    text, expect = HOSTILE[name]
    path = tmp_path / name
    path.write_text(text)
    code, lines = run(capsys, path)
    assert code == 2, lines
    assert any(expect in line and ": error: " in line for line in lines), lines


def test_binary_missing_and_directory_paths(capsys, tmp_path):
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00")
    code, lines = run(capsys, tmp_path / "bin.yaml", tmp_path / "missing.yaml", tmp_path)
    assert code == 2
    assert sum(": error: file: cannot read it" in line for line in lines) == 3


def test_control_characters_from_the_file_are_escaped(capsys, tmp_path):
    config = aws()
    config["available_node_types"]["evil\x1b[2Jnode"] = {"resources": {}, "node_config": {}}
    code, lines = run(capsys, write(tmp_path, config))
    assert code == 0
    assert any("evil\\x1b[2Jnode" in line for line in lines)
    assert not any("\x1b" in line for line in lines)


def test_one_blocked_file_among_good_ones_fails_the_run(capsys, tmp_path):
    bad = copy.deepcopy(aws())
    _no_raylastic(bad)
    code, lines = run(capsys, CONFIGS[0], write(tmp_path, bad), CONFIGS[1])
    assert code == 2
    assert sum(": ok: nothing blocks a run" in line for line in lines) == 2
