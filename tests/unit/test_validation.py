"""One validation pass over every user-facing field (issue 22, item 4), table-driven.

Each config class has one row per field (``dataclasses.fields`` is checked against the
table, so a new field without a row fails here) with values that must be refused, a
``ConfigError`` naming ``<Class>.<field>`` and the fix, and values that must be accepted.
Refused: wrong types (a bool is not an int, ``"yes"`` is not a flag, a numpy int is not an
int), out-of-range values, NaN and infinity, unsafe names, unsupported storage schemes.
No Ray is started: every check runs at construction.

The ``ElasticState`` half checks that what an attribute may hold is exactly what
``torch.load(weights_only=True)`` reads back: numpy scalars are converted, everything the
check refuses would have failed that load at a restore.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import io
import pathlib
import warnings
from typing import Any, Callable, Dict, NamedTuple, Tuple

import numpy as np
import pytest
import ray
import torch
from ray.train.torch import TorchConfig
from ray.train.v2.api.config import (
    CheckpointConfig as RayCheckpointConfig,
    FailureConfig as RayFailureConfig,
    LoggingConfig as RayLoggingConfig,
    RunConfig as RayRunConfig,
    ScalingConfig as RayScalingConfig,
)

import raylastic
from raylastic import CheckpointConfig, ConfigError, ElasticState, FailureConfig, RunConfig, ScalingConfig
from raylastic._internal.state_values import check_state_args, storable, storable_attr, storable_plain
from raylastic.checkpoint.storage import RetryPolicy
from raylastic.policies.capacity import CapacityPolicy
from raylastic.policies.node_types import NodeType, PriceTable
from raylastic.ray_train_config import translate

NAN, INF = float("nan"), float("inf")
_SETTABLE = object()  # marker: a value set after construction (bypasses the class's own checks)


class Row(NamedTuple):
    bad: Tuple[Any, ...]
    good: Tuple[Any, ...]
    base: Dict[str, Any] = {}


def _retry(**fields: Any) -> RetryPolicy:
    """A RetryPolicy holding ``fields`` whatever its own constructor accepts: RunConfig's
    check must stand on its own."""
    policy = RetryPolicy()
    for k, v in fields.items():
        object.__setattr__(policy, k, v)
    return policy


SPOT, OD = NodeType(name="spot", market="spot"), NodeType(name="on_demand", market="on_demand")

TABLE: Dict[type, Dict[str, Row]] = {
    ScalingConfig: {
        "min_workers": Row(bad=(0, -1, True, 1.0, "2", None, np.int64(2)), good=(1, 3)),
        "max_workers": Row(bad=(0, True, 2.0, "4", np.int64(4)), good=(None, 1, 8)),
        "resources_per_worker": Row(
            bad=({"CPU": 0}, {}.fromkeys(["CPU", "memory"], 0), {"CPU": NAN}, {"CPU": INF}, {"CPU": -1},
                 {"CPU": True}, {"CPU": "1"}, {"": 1}, {"a\nb": 1}, {3: 1}, ["CPU"], "CPU", {"GPU": 1}),
            good=(None, {}, {"CPU": 2}, {"CPU": 0.5}, {"CPU": 0, "slot": 1}, {"CPU": 1, "memory": 1e9})),
        "use_gpu": Row(bad=("yes", 1, None, np.bool_(True)), good=(True, False)),
        "max_wait_s": Row(bad=(0, -1, NAN, INF, 10 ** 400, True, "60"), good=(None, 30, 0.5)),
        "validate_resources": Row(bad=("no", 0, None), good=(True, False)),
        "keep_workers_s": Row(bad=(-1, NAN, INF, 10 ** 400, True, "30", 86401), good=(None, 0, 30, 0.5)),
        "capacity": Row(bad=("spot", {"prefer": "spot"}, CapacityPolicy(max_on_demand_workers=5)),
                        good=(None, CapacityPolicy(), CapacityPolicy(max_on_demand_workers=2)),
                        base={"max_workers": 2}),
    },
    FailureConfig: {
        "max_failures": Row(bad=(-2, True, 1.5, "3", None, NAN), good=(-1, 0, 5)),
        "max_node_failures": Row(bad=(-1, True, 2.0, INF, "1"), good=(None, 0, 3)),
    },
    CheckpointConfig: {
        "num_to_keep": Row(bad=(0, -1, True, 2.0, "2"), good=(None, 1, 5)),
        "async_upload": Row(bad=("no", 0, None), good=(True, False)),
        "persist_every": Row(bad=(0, -1, True, False, 1.5, NAN, "10"), good=(None, 1, 10)),
        "score_attribute": Row(bad=(3, "", " ", "a\nb", b"loss"), good=(None, "val_loss", "metrics/acc")),
        "score_order": Row(bad=("best", "MAX", None, 1), good=("max", "min")),
    },
    RunConfig: {
        "name": Row(bad=("a*b", "run?", "r[0]", "a]b", "a/b", "a\\b", "a\nb", "a\x00b", "a\x7fb", "..", ".",
                         "", "  ", "x" * 256, 3, b"run"),
                    good=(None, "my-run_2.v3", "a b", "raylastic_2026-01-02_03-04-05")),
        "storage_path": Row(
            bad=("", " ", 3, None, b"/tmp/x", "/tmp/a\x00b", "/tmp/a\nb", "ftp://host/x", "hdfs://nn/x",
                 "memory://x", "s3:/bucket/x", "gs:bucket", "s3://AKIAKEY:SECRETVALUE@bucket/x",
                 "s3://bucket/x?secret_key=SECRETVALUE", "s3://bucket/a/../b", "s3://bucket/x?bogus=1",
                 "s3://", "gs://bucket/run*", "abfs://c@acct.dfs.core.windows.net/r[1]"),
            good=("/tmp/runs", "~/raylastic_results", "relative/dir", pathlib.Path("/tmp/runs"),
                  "file:///tmp/runs", "s3://bucket/runs", "gs://bucket", "gcs://bucket/p",
                  "abfs://c@acct.dfs.core.windows.net/runs", "az://container/runs",
                  "s3://bucket/runs?endpoint_override=localhost:9000&scheme=http", "/tmp/exp[1]")),
        "failure_config": Row(bad=({"max_failures": 1}, None, RayFailureConfig()), good=(FailureConfig(),)),
        "checkpoint_config": Row(bad=({"num_to_keep": 1}, None, RayCheckpointConfig()), good=(CheckpointConfig(),)),
        "poll_interval_s": Row(bad=(0, -0.1, 11, NAN, INF, True, "0.1", None), good=(0.1, 1, 10)),
        "verbose": Row(bad=("yes", 1, None), good=(True, False)),
        "progress": Row(bad=("no", 0, None), good=(True, False)),
        "tensorboard": Row(bad=("yes", 1.0, None), good=(True, False)),
        "total_steps": Row(bad=(0, -5, True, 1.5, "10", INF), good=(None, 1, 1000)),
        "storage_retry": Row(bad=("fast", {"max_attempts": 3}, _retry(max_attempts=True), _retry(max_attempts=0),
                                  _retry(max_attempts=2.0), _retry(base_delay_s=NAN), _retry(max_delay_s=INF),
                                  _retry(base_delay_s=-1), _retry(max_delay_s="5")),
                             good=(None, RetryPolicy(max_attempts=3), RetryPolicy(base_delay_s=0, max_delay_s=0))),
        "lease_ttl_s": Row(bad=(0, 2, -1, 3601, NAN, INF, True, "30", None), good=(3, 30, 600.5)),
    },
    CapacityPolicy: {
        "prefer": Row(bad=("cheap", 3, None), good=("spot", "on_demand")),
        "objective": Row(bad=("cheap", 3, None), good=("cost", "time")),
        "deadline_s": Row(bad=(-5, 0, NAN, INF, True, "100"), good=(None, 3600, 0.5)),
        "deadline_margin": Row(bad=(1, 1.5, -0.1, NAN, True, None), good=(0, 0.1, 0.99)),
        "on_demand_boot_s": Row(bad=(-1, NAN, INF, True, None, "180"), good=(0, 180)),
        "fallback_after_s": Row(bad=(-1, NAN, INF, True, None), good=(0, 120)),
        "spot_wait_s": Row(bad=(-1, NAN, INF, True, "60"), good=(None, 0, 60)),
        "fixed_usd_per_hour": Row(bad=(-1, NAN, INF, True, None), good=(0, 2.5)),
        "max_on_demand_workers": Row(bad=(-2, True, 1.5, "2"), good=(None, 0, 2)),
        "return_to_spot": Row(bad=("yes", 1, None), good=(True, False)),
        "max_wait_s": Row(bad=(0, -1, NAN, INF, True, None, 60), good=(1800, 600.5), base={"spot_wait_s": 120}),
        "node_types": Row(bad=(3, "spot", (SPOT,), (SPOT, SPOT, OD), ("spot", "on_demand"), ()),
                          good=((SPOT, OD), [OD, SPOT])),
        "prices": Row(bad=({"spot": 1.0, "on_demand": 3.0}, 1.0),
                      good=(None, PriceTable.from_mapping({"spot": 1.0, "on_demand": 3.0}))),
    },
    # Ray Train's configs, through raylastic.TorchTrainer's translation (ray_train_config.py).
    RayScalingConfig: {
        "trainer_resources": Row(bad=({"CPU": 1},), good=(None,)),
        "num_workers": Row(bad=(0, -1, True, 1.5, "2", (3, 2), (0, 2), (1, 2, 3), (1, True)), good=(1, 4, (2, 4))),
        "use_gpu": Row(bad=("yes", 1, None), good=(False,)),
        "resources_per_worker": Row(bad=({"CPU": 0}, {"CPU": NAN}, {"CPU": -1}, {"CPU": True}, {"": 1}, ["CPU"]),
                                    good=(None, {"CPU": 2}, {"CPU": 0, "memory": 1e9})),
        "placement_strategy": Row(bad=("STRICT_PACK", "STRICT_SPREAD", 3), good=("PACK", "SPREAD")),
        "accelerator_type": Row(bad=(3, "", "A\n100"), good=(None, "A100")),
        "label_selector": Row(bad=({"zone": "a"},), good=(None, {})),
        "use_tpu": Row(bad=(True, "no", 1), good=(False,)),
        "topology": Row(bad=("2x2",), good=(None,)),
        "elastic_resize_monitor_interval_s": Row(bad=(NAN, INF, -1, 0, True, "60"), good=(60.0, 5)),
    },
    RayRunConfig: {
        "name": Row(bad=("a*b", "a/b", "a\nb"), good=("exp",)),
        "storage_path": Row(bad=("ftp://host/x", "s3:/bucket", "gs://bucket/run*", 3), good=("/tmp/ray_runs",)),
        "storage_filesystem": Row(bad=("s3://bucket",), good=(None, _SETTABLE)),
        "failure_config": Row(bad=(FailureConfig(), {"max_failures": 1}), good=(None, RayFailureConfig())),
        "checkpoint_config": Row(bad=(CheckpointConfig(), "keep"), good=(None, RayCheckpointConfig())),
        "callbacks": Row(bad=([object()],), good=(None, [])),
        "worker_runtime_env": Row(bad=({"env_vars": {"A": "1"}},), good=(None, {})),
        "logging_config": Row(bad=("DEBUG", {"log_level": "DEBUG"}), good=(None, RayLoggingConfig("DEBUG"))),
        "sync_config": Row(bad=("x",), good=()),
        "verbose": Row(bad=(1,), good=()),
        "stop": Row(bad=({"loss": 0.1},), good=()),
        "progress_reporter": Row(bad=("x",), good=()),
        "log_to_file": Row(bad=(True,), good=()),
    },
    RayFailureConfig: {
        "max_failures": Row(bad=(-2, True, 1.5, "3", NAN), good=(-1, 0, 3)),
        "fail_fast": Row(bad=(True, False),  good=()),
        "controller_failure_limit": Row(bad=(0, 3, True, -1.0), good=(-1,)),
        "max_preemption_failures": Row(bad=(-5, True, 2.0), good=(-1, 0, 2)),
        "relax_collectives_on_preemption": Row(bad=("yes", 1, None), good=(True, False)),
        "preemption_grace_s": Row(bad=(NAN, INF, -1, True, None), good=(0.0, 30)),
    },
    RayCheckpointConfig: {
        "num_to_keep": Row(bad=(0, True, 2.0, "2"), good=(None, 1, 3)),
        "checkpoint_score_attribute": Row(bad=(3, "", "a\nb"), good=(None, "loss", "val/acc")),
        "checkpoint_score_order": Row(bad=("bogus", None), good=("max", "min")),
        "checkpoint_frequency": Row(bad=(5,), good=()),
        "checkpoint_at_end": Row(bad=(True,), good=()),
    },
    TorchConfig: {
        "backend": Row(bad=("nccl", "mpi", 3), good=(None, "gloo")),
        "init_method": Row(bad=(3, None, ""), good=("env", "tcp")),
        "timeout_s": Row(bad=(3600, NAN, INF, True, "1800", 0), good=(1800, 60)),
    },
}

# ElasticState's own arguments; its other parameters take the user's objects (model, ...).
STATE_ARGS = {"persist_every": Row(bad=(0, -1, True, 2.0, "10"), good=(None, 1, 10)),
              "snapshot_every": Row(bad=(0, True, 1.5, None), good=(1, 4)),
              "async_snapshot": Row(bad=("yes", 1, None), good=(True, False)),
              "striped": Row(bad=("no", 0, None), good=(True, False)),
              "lean_snapshots": Row(bad=("yes", 1, None), good=(True, False))}
STATE_OBJECTS = {"model", "optimizer", "lr_scheduler", "loader", "engine", "stateful", "attrs"}
STATE_DEFAULTS = {"persist_every": None, "snapshot_every": 1, "async_snapshot": True, "striped": True,
                  "lean_snapshots": False}

_RAY = {RayScalingConfig: "scaling", RayRunConfig: "run", RayFailureConfig: "run", RayCheckpointConfig: "run",
        TorchConfig: "torch"}


def _value(v: Any) -> Any:
    if v is _SETTABLE:
        import pyarrow.fs as pafs

        return pafs.LocalFileSystem()
    return v


def _build(cls: type, field: str, value: Any) -> Any:
    """Construct ``cls`` with ``field=value`` the way a user reaches it."""
    value = _value(value)
    if cls not in _RAY:
        return cls(**{**TABLE[cls][field].base, field: value})
    # Ray's own objects, then the field set on them (Ray checks only a few fields itself,
    # and raylastic's check must hold for every value the user can put there).
    sc, rc, tc = RayScalingConfig(), RayRunConfig(storage_path="/tmp/ray_runs"), None
    if cls is RayFailureConfig:
        rc.failure_config = RayFailureConfig()
        target = rc.failure_config
    elif cls is RayCheckpointConfig:
        rc.checkpoint_config = RayCheckpointConfig()
        target = rc.checkpoint_config
    elif cls is TorchConfig:
        target = tc = TorchConfig()
    else:
        target = sc if cls is RayScalingConfig else rc
    setattr(target, field, value)
    return translate(sc, rc, tc)


def _label(v: Any) -> str:
    return repr(_value(v) if v is not _SETTABLE else "filesystem")[:40]


def _cases(kind: str):
    for cls, rows in TABLE.items():
        for field, row in rows.items():
            for v in getattr(row, kind):
                yield pytest.param(cls, field, v, id=f"{cls.__module__.split('.')[0]}.{cls.__name__}.{field}={_label(v)}")


def test_the_table_covers_every_field_of_every_class():
    for cls, rows in TABLE.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        assert set(rows) == fields, f"{cls.__name__}: rows missing for {sorted(fields - set(rows))}, " \
                                    f"rows for no field {sorted(set(rows) - fields)}"
        for field, row in rows.items():
            assert row.bad, f"{cls.__name__}.{field} has no bad value"
    params = set(inspect.signature(ElasticState.__init__).parameters) - {"self"}
    assert set(STATE_ARGS) == params - STATE_OBJECTS


@pytest.mark.parametrize("cls, field, value", list(_cases("bad")))
def test_bad_value_is_refused_naming_the_field_and_the_fix(cls, field, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError) as info:
            _build(cls, field, value)
    message = str(info.value)
    assert f"{cls.__name__}.{field}" in message, message
    assert "Fix:" in message, message
    assert "SECRETVALUE" not in message  # a credential in a URI is never echoed


@pytest.mark.parametrize("cls, field, value", list(_cases("good")))
def test_good_value_is_accepted(cls, field, value):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _build(cls, field, value)


def test_accepted_values_are_kept():
    assert ScalingConfig(min_workers=2, max_workers=None).max_workers == 2
    assert RunConfig(storage_path=pathlib.Path("/tmp/runs")).storage_path == "/tmp/runs"
    assert RunConfig(storage_path="s3://bucket/runs").storage_path == "s3://bucket/runs"
    assert ScalingConfig(resources_per_worker={"CPU": 0}, use_gpu=True).worker_resources() == {"CPU": 0, "GPU": 1.0}
    ScalingConfig(resources_per_worker={"CPU": 0}, capacity=CapacityPolicy())  # + a node-type slot each
    t = translate(RayScalingConfig(num_workers=(2, 4), use_gpu=False), RayRunConfig(name="exp", storage_path="/tmp/r"))
    assert (t.scaling.min_workers, t.scaling.max_workers, t.run.name) == (2, 4, "exp")


def test_messages_read_as_the_users_assignment():
    with pytest.raises(ConfigError, match=r"^ScalingConfig\.min_workers=True must be an int >= 1, not a bool\. Fix: "):
        ScalingConfig(min_workers=True)
    with pytest.raises(ConfigError, match=r"^ScalingConfig\.use_gpu='yes' must be True or False, not a str\."):
        ScalingConfig(use_gpu="yes")
    with pytest.raises(ConfigError, match=r"CheckpointConfig\.persist_every=-1 must be an int >= 1 or None"):
        CheckpointConfig(persist_every=-1)
    with pytest.raises(ConfigError, match=r"reserves nothing per worker"):
        ScalingConfig(resources_per_worker={"CPU": 0})
    with pytest.raises(ConfigError, match=r"ray\.train\.RunConfig\.name 'a\*b' is not a plain directory name"):
        translate(None, RayRunConfig(name="a*b", storage_path="/tmp/r"))


def test_nothing_here_starts_ray():
    assert not ray.is_initialized()


# -- ElasticState ---------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [(f, v) for f, row in STATE_ARGS.items() for v in row.bad])
def test_elastic_state_arguments_refused(field, value):
    with pytest.raises(ConfigError, match=rf"ElasticState\({field}=.*Fix:"):
        check_state_args(**{**STATE_DEFAULTS, field: value})
    with pytest.raises(ConfigError, match=rf"ElasticState\({field}="):  # before it needs a worker
        ElasticState(**{field: value})


@pytest.mark.parametrize("field, value", [(f, v) for f, row in STATE_ARGS.items() for v in row.good])
def test_elastic_state_arguments_accepted(field, value):
    check_state_args(**{**STATE_DEFAULTS, field: value})


class Point(NamedTuple):
    x: int


def _reload(value: Any) -> Any:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


KEPT = [None, True, 3, 2 ** 70, 1.5, NAN, INF, 1 + 2j, "s", b"b", bytearray(b"x"), torch.ones(2),
        torch.nn.Parameter(torch.ones(2)), torch.Size([2, 3]), torch.float16, torch.device("cpu"),
        [1, (2.0, "a")], {"a": {"b": [torch.zeros(1)]}, 3: None, (1, 2): "t"}, {1, 2},
        collections.OrderedDict(a=1), collections.Counter(a=2)]
CONVERTED = [(np.float64(1.5), 1.5), (np.float32(0.1), float(np.float32(0.1))), (np.float16(2), 2.0),
             (np.int64(7), 7), (np.uint8(255), 255), (np.bool_(True), True), (np.str_("a"), "a"),
             (np.complex128(1j), 1j), ([np.float64(1), {"k": np.int32(2)}], [1.0, {"k": 2}]),
             ({np.int64(1): np.float64(2)}, {1: 2.0}), ((np.int8(1),), (1,)),
             (collections.OrderedDict(a=np.int64(1)), collections.OrderedDict(a=1))]
REFUSED = [object(), np.zeros(3), np.array(1.0), collections.defaultdict(int), Point(1), frozenset({1}),
           range(3), slice(1), np.datetime64(1, "ns"), np.longdouble(1), [1, [2, object()]],
           {"a": {"b": np.zeros(1)}}, {"k": collections.defaultdict(list)}]


@pytest.mark.parametrize("value", KEPT, ids=lambda v: type(v).__name__)
def test_kept_values_round_trip_unchanged(value):
    assert storable_attr("x", value) is value
    back = _reload(value)
    assert type(back) is type(value)


@pytest.mark.parametrize("value, expected", CONVERTED, ids=lambda v: type(v).__name__)
def test_numpy_scalars_become_python_scalars_losslessly(value, expected):
    out = storable_attr("x", value)
    assert out == expected and type(out) is type(expected)
    if isinstance(value, np.generic):
        assert out == value.item()  # the same number
    assert _reload(out) == out  # and it loads back with weights_only


@pytest.mark.parametrize("value", REFUSED, ids=lambda v: type(v).__name__)
def test_refused_values_are_exactly_what_a_weights_only_load_refuses(value):
    with pytest.raises(ConfigError) as info:
        storable_attr("best_loss", value)
    message = str(info.value)
    assert "ElasticState attribute 'best_loss'" in message and "Fix:" in message
    with pytest.raises(Exception):  # what the user met before: a failed restore
        _reload(value)


def test_refusal_names_where_inside_the_attribute_and_the_fix():
    with pytest.raises(ConfigError, match=r"attribute 'hist'\[1\]\['w'\] is a numpy.ndarray.*torch.from_numpy"):
        storable_attr("hist", [{}, {"w": np.zeros(2)}])
    with pytest.raises(ConfigError, match=r"collections.defaultdict.*Fix: store dict\(x\)"):
        storable_attr("counts", collections.defaultdict(int))


def test_a_class_registered_as_safe_is_allowed():
    @dataclasses.dataclass
    class Safe:
        a: int = 1

    with pytest.raises(ConfigError):
        storable_attr("s", Safe())
    with torch.serialization.safe_globals([Safe]):
        assert isinstance(storable_attr("s", Safe()), Safe)


def test_elastic_state_checks_attributes_when_registered_and_when_set():
    # Construction refuses a bad attribute before it looks for the worker's session.
    with pytest.raises(ConfigError, match="ElasticState attribute 'rng'"):
        ElasticState(step=0, rng=np.random.default_rng(0))
    with pytest.raises(RuntimeError, match="inside a train function"):  # the check passed
        ElasticState(step=0, best=np.float64(1.0))
    state = ElasticState.__new__(ElasticState)  # no session: the attribute half only
    object.__setattr__(state, "_attrs", {"loss": 0.0, "step": 0})
    state.loss = np.float64(2.5)
    assert type(state.loss) is float and state.loss == 2.5
    with pytest.raises(ConfigError, match="ElasticState attribute 'step'.*Fix: store torch.from_numpy"):
        state.step = np.arange(3)
    assert state.step == 0  # unchanged


def test_commit_checks_the_snapshot_again():
    """A list attribute grows without __setattr__: commit() converts/refuses it then."""
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1), 2)
    plain = storable_plain({"attrs": {"losses": [np.float64(1.0), 2.0]}, "_objects": {"lr_scheduler": sched.state_dict()}})
    assert plain["attrs"]["losses"] == [1.0, 2.0] and type(plain["attrs"]["losses"][0]) is float
    assert _reload(plain)["attrs"] == {"losses": [1.0, 2.0]}
    with pytest.raises(ConfigError, match=r"ElasticState\(loader=...\).state_dict\(\)\['pos'\]"):
        storable_plain({"attrs": {}, "_objects": {"loader": {"pos": np.zeros(1)}}})


def test_torch_lr_schedulers_state_is_storable():
    m = torch.nn.Linear(2, 2)
    S = torch.optim.lr_scheduler

    def opt() -> torch.optim.Optimizer:
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

    makers: Tuple[Callable[[], Any], ...] = (
        lambda: S.StepLR(opt(), 2), lambda: S.OneCycleLR(opt(), max_lr=1, total_steps=10),
        lambda: S.CosineAnnealingWarmRestarts(opt(), 3), lambda: S.CyclicLR(opt(), 0.1, 1),
        lambda: S.LambdaLR(opt(), lambda e: 0.9 ** e), lambda: S.ReduceLROnPlateau(opt()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for make in makers:
            sd = make().state_dict()
            assert storable(sd, "lr_scheduler") is sd

