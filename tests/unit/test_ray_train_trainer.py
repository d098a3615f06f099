"""raylastic.TorchTrainer: Ray Train's configs translated, or refused before Ray starts.

No Ray cluster: every case builds the trainer (that is where configs are checked) and
asserts that Ray was never initialised. Ray's config classes validate some values
themselves at construction (``ScalingConfig(num_workers=(3, 2))`` raises Ray's own
ValueError); they are plain mutable dataclasses, so the values only raylastic can catch
are set after construction, as user code or a config loader may do.
"""

import os
import threading

import pytest
import ray
import ray.train
from ray.air import ScalingConfig as RayV1ScalingConfig
from ray.train.constants import DEFAULT_STORAGE_PATH
from ray.train.torch import TorchConfig

import raylastic
from raylastic import ConfigError, TorchTrainer
from raylastic.ray_train import ResumeFrom, TorchTrainerResult


def train_func(config):
    return config


@pytest.fixture(autouse=True)
def no_ray():
    assert not ray.is_initialized(), "another test left Ray initialised: this module checks that it never starts"
    yield
    assert not ray.is_initialized(), "TorchTrainer(...) started Ray"


def _scaling(**kw):
    """A valid ray.train.ScalingConfig with ``kw`` set after construction (bypassing
    Ray's own checks, so raylastic's are what is tested)."""
    sc = ray.train.ScalingConfig(num_workers=2)
    for k, v in kw.items():
        setattr(sc, k, v)
    return sc


def _trainer(tmp_path, **kw):
    kw.setdefault("run_config", ray.train.RunConfig(name="t", storage_path=str(tmp_path)))
    return TorchTrainer(train_func, **kw)


# -- honoured --------------------------------------------------------------------------

def test_fixed_size_is_min_equals_max(tmp_path):
    t = _trainer(tmp_path, scaling_config=ray.train.ScalingConfig(num_workers=4))
    s = t.translation.scaling
    assert (s.min_workers, s.max_workers, s.use_gpu) == (4, 4, False)
    assert s.worker_resources() == {"CPU": 1}


def test_tuple_is_elastic(tmp_path):
    s = _trainer(tmp_path, scaling_config=ray.train.ScalingConfig(num_workers=(2, 5))).translation.scaling
    assert (s.min_workers, s.max_workers) == (2, 5)


@pytest.mark.parametrize("kw", [
    {},
    {"use_gpu": True},
    {"resources_per_worker": {"CPU": 2, "custom": 1}},
    {"use_gpu": True, "resources_per_worker": {"CPU": 4}},
    {"use_gpu": True, "resources_per_worker": {"CPU": 1, "GPU": 0.5}},
    {"accelerator_type": "A100", "use_gpu": True},
    {"resources_per_worker": {"CPU": 0, "memory": 1e9}},
])
def test_worker_resources_are_what_ray_train_reserves(tmp_path, kw):
    sc = ray.train.ScalingConfig(num_workers=2, **kw)
    s = _trainer(tmp_path, scaling_config=sc).translation.scaling
    reserved = {k: v for k, v in s.worker_resources().items() if v}  # a zero amount reserves nothing
    assert reserved == sc._resources_per_worker_not_none
    assert s.use_gpu == sc.use_gpu
    assert s.backend == ("nccl" if sc.use_gpu else "gloo")


def test_run_failure_and_checkpoint_configs(tmp_path):
    rc = ray.train.RunConfig(
        name="exp", storage_path=str(tmp_path),
        failure_config=ray.train.FailureConfig(max_failures=3, max_preemption_failures=2),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2))
    t = _trainer(tmp_path, run_config=rc)
    run = t.translation.run
    assert (run.name, run.storage_path) == ("exp", str(tmp_path))
    assert (run.failure_config.max_failures, run.failure_config.max_node_failures) == (3, 2)
    assert run.checkpoint_config.num_to_keep == 2
    assert t.translation.ignored == ()


def test_defaults_are_ray_trains(tmp_path):
    t = TorchTrainer(train_func)
    s, run = t.translation.scaling, t.translation.run
    assert (s.min_workers, s.max_workers) == (1, 1)
    assert run.storage_path == DEFAULT_STORAGE_PATH and run.name.startswith("ray_train_run-")
    assert run.failure_config.max_failures == 0
    assert run.failure_config.max_node_failures is None  # max_preemption_failures=-1: unlimited
    assert run.checkpoint_config.num_to_keep is None


def test_ignored_fields_are_listed_with_a_reason(tmp_path):
    t = _trainer(
        tmp_path,
        scaling_config=ray.train.ScalingConfig(num_workers=2, elastic_resize_monitor_interval_s=5,
                                               placement_strategy="SPREAD"),
        torch_config=TorchConfig(init_method="tcp"),
        run_config=ray.train.RunConfig(
            name="t", storage_path=str(tmp_path),
            logging_config=ray.train.LoggingConfig(log_level="DEBUG"),
            failure_config=ray.train.FailureConfig(relax_collectives_on_preemption=True, preemption_grace_s=5),
            checkpoint_config=ray.train.CheckpointConfig(checkpoint_score_order="min")))
    fields = {i.field for i in t.translation.ignored}
    assert fields == {
        "ScalingConfig.elastic_resize_monitor_interval_s", "RunConfig.logging_config.log_level",
        "FailureConfig.relax_collectives_on_preemption", "FailureConfig.preemption_grace_s",
        "CheckpointConfig.checkpoint_score_order", "torch.TorchConfig.init_method"}
    assert all(len(i.reason) > 20 for i in t.translation.ignored)


def test_default_torch_config_is_accepted(tmp_path):
    _trainer(tmp_path, torch_config=TorchConfig())
    _trainer(tmp_path, torch_config=TorchConfig(backend="gloo"))
    _trainer(tmp_path, torch_config=TorchConfig(timeout_s=60))  # raylastic's own timeout
    _trainer(tmp_path, torch_config=TorchConfig(backend="nccl"),
             scaling_config=ray.train.ScalingConfig(num_workers=1, use_gpu=True))


def test_result_is_a_ray_train_result():
    assert issubclass(TorchTrainerResult, ray.train.Result)


# -- refused ----------------------------------------------------------------------------

@pytest.mark.parametrize("num_workers, needles", [
    ((3, 2), ["num_workers=(3, 2)", "min_workers (3) > max_workers (2)", "num_workers=(2, 3)"]),
    (-1, ["num_workers=-1", "negative"]),
    (2.5, ["num_workers must be an int", "float 2.5"]),
    (True, ["num_workers must be an int", "bool True"]),
    ((1, 2, 3), ["num_workers=(1, 2, 3)", "tuple of two ints"]),
    ((2.0, 3), ["num_workers=(2.0, 3)", "tuple of two ints"]),
    ((0, 2), ["num_workers=(0, 2)", "min_workers must be >= 1", "num_workers=(1, 2)"]),
    ([2, 3], ["num_workers must be an int", "list [2, 3]"]),
    ("4", ["num_workers must be an int", "str '4'"]),
])
def test_bad_num_workers(tmp_path, num_workers, needles):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, scaling_config=_scaling(num_workers=num_workers))
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize("scaling, needles", [
    (_scaling(trainer_resources={"CPU": 1}), ["ScalingConfig.trainer_resources", "remove trainer_resources"]),
    (_scaling(use_tpu=True), ["ScalingConfig.use_tpu", "gloo on CPU or NCCL on GPU"]),
    (ray.train.ScalingConfig(num_workers=2, topology="2x2"), ["ScalingConfig.topology"]),
    (ray.train.ScalingConfig(num_workers=2, label_selector={"zone": "a"}),
     ["ScalingConfig.label_selector", "custom resource"]),
    (ray.train.ScalingConfig(num_workers=2, placement_strategy="STRICT_PACK"),
     ["ScalingConfig.placement_strategy='STRICT_PACK'", "remove placement_strategy"]),
    (ray.train.ScalingConfig(num_workers=2, placement_strategy="STRICT_SPREAD"),
     ["placement_strategy='STRICT_SPREAD'"]),
    (_scaling(resources_per_worker={"CPU": -1}), ["resources_per_worker['CPU']"]),
])
def test_scaling_fields_refused(tmp_path, scaling, needles):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, scaling_config=scaling)
    for needle in needles:
        assert needle in str(e.value)


def _run(tmp_path, **kw):
    rc = ray.train.RunConfig(name="t", storage_path=str(tmp_path))
    for k, v in kw.items():
        setattr(rc, k, v)
    return rc


def _failure(**kw):
    fc = ray.train.FailureConfig()
    for k, v in kw.items():
        setattr(fc, k, v)
    return fc


def _ckpt_config(**kw):
    cc = ray.train.CheckpointConfig()
    for k, v in kw.items():
        setattr(cc, k, v)
    return cc


@pytest.mark.parametrize("make, needles", [
    (lambda p: ray.train.RunConfig(storage_path=str(p), worker_runtime_env={"env_vars": {"A": "1"}}),
     ["RunConfig.worker_runtime_env", "ray.init(runtime_env=...)"]),
    (lambda p: _run(p, verbose=1), ["RunConfig.verbose", "remove verbose"]),
    (lambda p: _run(p, stop={"loss": 0.1}), ["RunConfig.stop"]),
    (lambda p: _run(p, failure_config=ray.train.FailureConfig(controller_failure_limit=3)),
     ["FailureConfig.controller_failure_limit=3", "remove controller_failure_limit"]),
    (lambda p: _run(p, failure_config=ray.train.FailureConfig(controller_failure_limit=0)),
     ["FailureConfig.controller_failure_limit=0"]),
    (lambda p: _run(p, failure_config=_failure(fail_fast=True)), ["FailureConfig.fail_fast"]),
    (lambda p: _run(p, failure_config=ray.train.FailureConfig(max_failures=-2)),
     ["FailureConfig.max_failures must be an int >= -1"]),
    (lambda p: _run(p, failure_config=ray.train.FailureConfig(max_preemption_failures=-5)),
     ["FailureConfig.max_preemption_failures must be an int >= -1"]),
    (lambda p: _run(p, checkpoint_config=_ckpt_config(checkpoint_score_attribute="")),
     ["CheckpointConfig.checkpoint_score_attribute=''", "name of a metric"]),
    (lambda p: _run(p, checkpoint_config=_ckpt_config(checkpoint_score_attribute="loss", checkpoint_score_order="low")),
     ["CheckpointConfig.checkpoint_score_order='low'", "'max' or 'min'"]),
    (lambda p: _run(p, checkpoint_config=_ckpt_config(checkpoint_at_end=True)), ["CheckpointConfig.checkpoint_at_end"]),
    (lambda p: _run(p, checkpoint_config=_ckpt_config(checkpoint_frequency=5)),
     ["CheckpointConfig.checkpoint_frequency"]),
    (lambda p: _run(p, checkpoint_config=_ckpt_config(num_to_keep=True)), ["CheckpointConfig.num_to_keep"]),
    (lambda p: _run(p, checkpoint_config=_ckpt_config(num_to_keep=0)), ["CheckpointConfig.num_to_keep", "got 0"]),
    (lambda p: _run(p, failure_config=raylastic.FailureConfig(max_failures=1)),
     ["RunConfig.failure_config must be Ray Train's ray.train.FailureConfig", "raylastic.config.FailureConfig"]),
    (lambda p: _run(p, checkpoint_config=raylastic.CheckpointConfig(num_to_keep=1)),
     ["RunConfig.checkpoint_config must be Ray Train's ray.train.CheckpointConfig"]),
    (lambda p: _run(p, name="a/b"), ["RunConfig.name"]),
])
def test_run_fields_refused(tmp_path, make, needles):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, run_config=make(tmp_path))
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize("torch_config, use_gpu, needles", [
    (TorchConfig(backend="nccl"), False, ["TorchConfig.backend='nccl'", "gloo on CPU"]),
    (TorchConfig(backend="gloo"), True, ["TorchConfig.backend='gloo'", "nccl with use_gpu=True"]),
    (TorchConfig(timeout_s=3600), False, ["TorchConfig.timeout_s=3600", "60 s"]),
    ({"backend": "gloo"}, False, ["torch_config", "ray.train.torch.TorchConfig"]),
])
def test_torch_config_refused(tmp_path, torch_config, use_gpu, needles):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, torch_config=torch_config,
                 scaling_config=ray.train.ScalingConfig(num_workers=1, use_gpu=use_gpu))
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize("kw, needles", [
    ({"datasets": [1, 2]}, ["datasets must be a dict", "datasets={'train': ds}"]),
    ({"datasets": {"train": [1, 2]}}, ["datasets['train'] is a builtins.list", "ray.data.from_items"]),
    # A dataset factory (Ray Train accepts Callable[[], Dataset]; it is called at fit()).
    ({"datasets": {"train": lambda: None},
      "dataset_config": ray.train.DataConfig(datasets_to_split=["train", "valid"])},
     ["datasets_to_split=['train', 'valid']", "['valid']", "names: ['train']"]),
    ({"dataset_config": object()}, ["dataset_config must be a ray.train.DataConfig"]),
    ({"validation_config": object()}, ["validation_config", "not supported"]),
    ({"metadata": {"a": 1}}, ["metadata", "train_loop_config"]),
    ({"scaling_config": raylastic.ScalingConfig(min_workers=2)},
     ["scaling_config", "raylastic.config.ScalingConfig", "ray.train.ScalingConfig", "ElasticTrainer"]),
    ({"scaling_config": RayV1ScalingConfig(num_workers=2)}, ["scaling_config", "ray.train.ScalingConfig"]),
    ({"run_config": raylastic.RunConfig()}, ["run_config", "ray.train.RunConfig", "ElasticTrainer"]),
    ({"resume_from_checkpoint": "/tmp/ckpt"}, ["resume_from_checkpoint must be a ray.train.Checkpoint"]),
    ({"train_loop_config": {"lock": threading.Lock()}}, ["train_loop_config cannot be pickled"]),
])
def test_trainer_arguments_refused(tmp_path, kw, needles):
    with pytest.raises(ConfigError) as e:
        _trainer(tmp_path, **kw)
    for needle in needles:
        assert needle in str(e.value)


def test_empty_datasets_are_fine(tmp_path):
    _trainer(tmp_path, datasets={})


def test_train_loop_per_worker_must_be_callable(tmp_path):
    with pytest.raises(ConfigError, match="train_loop_per_worker must be a callable"):
        TorchTrainer(42, resume_from_checkpoint=ray.train.Checkpoint.from_directory(str(tmp_path)))


def test_resume_from_a_missing_directory_is_refused(tmp_path):
    missing = ray.train.Checkpoint(path=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no directory at"):
        _trainer(tmp_path, resume_from_checkpoint=missing)


# -- resume_from_checkpoint inside a worker's session (no cluster: the session is local) --

def _session(tmp_path, checkpoint_rel=None):
    from raylastic.checkpoint.storage import Storage
    from raylastic.session import GroupSpec, RestoreInfo, Session

    spec = GroupSpec(epoch=0, rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
                     master_addr="127.0.0.1", master_port=0, backend="gloo")
    return Session(spec=spec, storage=Storage(str(tmp_path)), run_rel="run", run_name="run",
                   restore=RestoreInfo(checkpoint_rel=checkpoint_rel))


def _seen_checkpoint(config):
    """A Ray Train style function: what ray.train.get_checkpoint() gives it."""
    ckpt = ray.train.get_checkpoint()
    return None if ckpt is None else os.path.basename(ckpt.path)


@pytest.mark.parametrize("run_has_checkpoint", [False, True])
def test_resume_from_checkpoint_until_the_run_has_its_own(tmp_path, run_has_checkpoint):
    from raylastic import session as _session_mod
    from raylastic._internal import ray_train_compat

    (tmp_path / "given").mkdir()
    given = ray.train.Checkpoint.from_directory(str(tmp_path / "given"))
    rel = "run/checkpoints/checkpoint_00000007-e0" if run_has_checkpoint else None
    sess = _session(tmp_path, rel)
    _session_mod._set_session(sess)
    ray_train_compat.install(sess)
    try:
        seen = ResumeFrom(_seen_checkpoint, given)({})
        own = raylastic.get_checkpoint()
    finally:
        _session_mod._set_session(None)
    if run_has_checkpoint:
        assert seen == "checkpoint_00000007-e0" and own.path == sess.storage.path(rel)
    else:
        assert seen == "given" and own is given


def test_resume_wrapper_keeps_zero_argument_functions(tmp_path):
    from raylastic import session as _session_mod

    _session_mod._set_session(_session(tmp_path))
    try:
        assert ResumeFrom(lambda: "no-arg", ray.train.Checkpoint.from_directory(str(tmp_path)))({"x": 1}) == "no-arg"
        assert ResumeFrom(train_func, ray.train.Checkpoint.from_directory(str(tmp_path)))({"x": 1}) == {"x": 1}
    finally:
        _session_mod._set_session(None)


def test_get_all_reported_checkpoints_lists_the_kept_ones_up_to_this_rank(tmp_path):
    """One rank, no process group: the committed checkpoints with index <= this rank's
    reports, ranked and trimmed by the run's retention (what the shim's wrapper sets)."""
    from raylastic import session as _session_mod
    from raylastic._internal import ray_train_compat
    from raylastic._internal.ray_train_checkpoints import Retention
    from raylastic.checkpoint.manager import CheckpointManager
    from raylastic.events import EventLog
    from raylastic.session import ReportRecord, checkpoint_rel

    sess = _session(tmp_path)
    mgr = CheckpointManager(sess.storage, "run", None, EventLog(sess.storage, "run", verbose=False))
    mgr.begin_epoch(0, 1)
    for index, loss in [(1, 0.9), (2, 0.2), (3, 0.5), (4, 0.1)]:
        (tmp_path / f"src{index}").mkdir()
        (tmp_path / f"src{index}" / "w").write_bytes(b"x")
        rel = checkpoint_rel("run", index, 0)
        mgr.on_records([ReportRecord(index=index, rank=0, epoch=0, ts=0.0, metrics={"loss": loss},
                                     checkpoint_rel=rel, files=sess.storage.upload_dir(str(tmp_path / f"src{index}"), rel))])
    _session_mod._set_session(sess)
    ray_train_compat.install(sess)
    try:
        for _ in range(3):
            ray.train.report({"loss": 0.0})  # this rank is at report 3: checkpoint 4 is not its yet
        ray_train_compat.set_retention(Retention(num_to_keep=1, score_attribute="loss", score_order="min"))
        got = ray.train.get_all_reported_checkpoints()
        ray_train_compat.set_retention(Retention())
        by_age = ray.train.get_all_reported_checkpoints()
    finally:
        _session_mod._set_session(None)
    # min loss: 2 (0.2) is best; 3 is kept for being the newest (up to report 3), worst first.
    assert [c.metrics["loss"] for c in got] == [0.5, 0.2]
    assert got[1].checkpoint.path == sess.storage.path(checkpoint_rel("run", 2, 0))
    assert [c.metrics["loss"] for c in by_age] == [0.9, 0.2, 0.5]


def test_a_module_workers_cannot_import_is_shipped_by_value(tmp_path, monkeypatch):
    """A top-level module outside the driver's working directory, PYTHONPATH and the
    installed packages is pickled by value (a fresh interpreter without its directory
    on sys.path runs the function); installed and package modules are left alone."""
    import subprocess
    import sys

    from ray import cloudpickle

    from raylastic.ray_train import ship_by_value

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "my_train_mod.py").write_text(
        "SCALE = 3\n\ndef train_fn(config):\n    return config['x'] * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    monkeypatch.chdir(tmp_path)
    import my_train_mod

    try:
        assert ship_by_value(my_train_mod.train_fn)
        blob = cloudpickle.dumps(my_train_mod.train_fn)
    finally:
        cloudpickle.unregister_pickle_by_value(my_train_mod)
        sys.modules.pop("my_train_mod", None)
    code = "import sys, pickle; f = pickle.loads(sys.stdin.buffer.read()); print(f({'x': 2}))"
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, cwd=str(tmp_path), timeout=400)
    assert out.stdout.strip() == b"6", out.stderr.decode()[-2000:]
    assert not ship_by_value(os.path.join)  # the standard library
    assert not ship_by_value(ray.train.report)  # an installed package's module
    assert not ship_by_value(raylastic.session.report)  # a package's module: imported by its name


def test_get_all_reported_checkpoints_waits_for_the_commit_of_its_own_checkpoint(tmp_path):
    """A rank that reported checkpoint files waits until the controller's manifest for
    that index is written (here by a thread 0.3 s later), then lists it."""
    import threading
    import time

    from raylastic import session as _session_mod
    from raylastic._internal import ray_train_compat
    from raylastic.checkpoint.manager import CheckpointManager
    from raylastic.events import EventLog

    sess = _session(tmp_path)
    sess.uploader = None  # report() below is replayed by hand: no upload machinery
    adapter = ray_train_compat.RayTrainAdapter(sess)
    src = tmp_path / "src"
    src.mkdir()
    (src / "w").write_bytes(b"x")
    record = sess._next_record({"loss": 1.0})  # what report(checkpoint=...) makes
    sess.last_files_index = record.index  # (its checkpoint carried files)
    adapter._progress.after_report(sess)
    rel = raylastic.session.checkpoint_rel("run", record.index, 0)
    record.checkpoint_rel, record.files = rel, sess.storage.upload_dir(str(src), rel)
    mgr = CheckpointManager(sess.storage, "run", None, EventLog(sess.storage, "run", verbose=False))
    mgr.begin_epoch(0, 1)
    threading.Timer(0.3, mgr.on_records, args=([record],)).start()
    _session_mod._set_session(sess)
    try:
        start = time.monotonic()
        got = adapter.get_all_reported_checkpoints(timeout_s=30)
    finally:
        _session_mod._set_session(None)
    assert 0.2 < time.monotonic() - start < 10
    assert [c.metrics for c in got] == [{"loss": 1.0}]
