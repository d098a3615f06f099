"""raylastic.TorchTrainer as a drop-in for Ray Train's, end to end on a local cluster.

The train function is Ray's own shipped example
(``ray/train/examples/pytorch/torch_linear_example.py``: in-memory data, a
DataLoader through ``ray.train.torch.prepare_data_loader``, DDP through
``prepare_model``, ``ray.train.report`` with a checkpoint per epoch), imported from the
installed ray wheel and run unchanged, with Ray Train's own config objects.
"""

import os
import tempfile

import pyarrow.fs as pafs
import pytest
import ray
import ray.train
import torch
from ray.train.backend import Backend, BackendConfig
from ray.train.examples.pytorch.torch_linear_example import train_func as ray_linear_train_func

import raylastic
from raylastic.events import EventKind, load_events
from raylastic.testing.faults import FitThread, RunWatcher, kill_node_at

pytestmark = pytest.mark.timeout(300)

LINEAR = {"lr": 1e-2, "hidden_size": 1, "batch_size": 4}


def _checkpoint_dirs(run_path):
    return sorted(d for d in os.listdir(os.path.join(run_path, "checkpoints")) if d.startswith("checkpoint_"))


def test_ray_linear_example_runs_unchanged(local_cluster, run_dir):
    trainer = raylastic.TorchTrainer(
        ray_linear_train_func,
        train_loop_config={**LINEAR, "epochs": 3},
        scaling_config=ray.train.ScalingConfig(num_workers=(2, 3)),
        run_config=ray.train.RunConfig(name="linear", storage_path=run_dir,
                                       checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2)),
    )
    result = trainer.fit()

    assert isinstance(result, ray.train.Result)
    assert result.error is None
    assert result.world_sizes and all(2 <= w <= 3 for w in result.world_sizes)
    # return_value: rank 0's list of per-epoch results; metrics: the last report.
    losses = [r["loss"] for r in result.return_value]
    assert len(losses) == 3 and losses[-1] < losses[0]
    assert result.metrics == {"loss": losses[-1]}
    # path is the run directory on result.filesystem, as in Ray Train.
    assert result.path == os.path.join(run_dir, "linear")
    assert isinstance(result.filesystem, pafs.LocalFileSystem)
    assert result.filesystem.get_file_info(result.path).type == pafs.FileType.Directory
    # best_checkpoints: the kept checkpoints (num_to_keep=2), oldest first, with their metrics.
    assert [m["loss"] for _, m in result.best_checkpoints] == losses[-2:]
    assert [os.path.basename(c.path) for c, _ in result.best_checkpoints] == _checkpoint_dirs(result.path)
    assert result.checkpoint.path == result.best_checkpoints[-1][0].path
    assert list(result.metrics_dataframe["loss"]) == losses[-2:]
    assert result.get_best_checkpoint("loss", "min").path == result.checkpoint.path
    with result.checkpoint.as_directory() as d:
        state = torch.load(os.path.join(d, "model.pt"), weights_only=True)
    assert {k.split(".")[-1] for k in state} == {"weight", "bias"}


def test_ray_linear_example_survives_a_node_loss(local_cluster, restore_nodes, run_dir):
    """A fixed size (num_workers=3) survives too: the group shrinks to the survivors."""
    trainer = raylastic.TorchTrainer(
        ray_linear_train_func,
        # One report per epoch; epochs long enough that the node goes while training.
        train_loop_config={**LINEAR, "epochs": 4, "data_size": 3000},
        scaling_config=ray.train.ScalingConfig(num_workers=(2, 3)),
        run_config=ray.train.RunConfig(name="linear_loss", storage_path=run_dir),
    )
    th = FitThread(trainer)
    th.start()
    watcher = RunWatcher(os.path.join(run_dir, "linear_loss"))
    killed = kill_node_at(local_cluster, watcher, 1)
    result = th.wait(180)

    assert result.error is None
    events = load_events(result.path)
    lost = [e for e in events if e["kind"] == EventKind.WORKER_LOST.value and e["cause"] == "node_lost"]
    assert [e["node_id"] for e in lost] == [killed]
    assert result.world_sizes[0] == 3 and result.world_sizes[-1] == 2, result.world_sizes
    assert result.restarts >= 1
    # The example keeps no training state in its checkpoints, so after the restore it
    # trains its 4 epochs again: 4 results from the last attempt, loss going down.
    losses = [r["loss"] for r in result.return_value]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert result.metrics == {"loss": losses[-1]}


def test_resume_from_checkpoint_until_the_run_has_its_own(local_cluster, run_dir, tmp_path):
    given = tmp_path / "given"
    given.mkdir()
    (given / "count.txt").write_text("41")

    def count_up(config):  # Ray Train style; nested, so Ray ships it by value
        with ray.train.get_checkpoint().as_directory() as d:
            start = int(open(os.path.join(d, "count.txt")).read())
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None  # Ray Train 2.x's pattern: rank 0 alone saves and passes one
            if ray.train.get_context().get_world_rank() == 0:
                with open(os.path.join(d, "count.txt"), "w") as fh:
                    fh.write(str(start + 1))
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"count": start + 1}, checkpoint=checkpoint)
        return start

    trainer = raylastic.TorchTrainer(
        count_up, scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name="resume", storage_path=run_dir),
        resume_from_checkpoint=ray.train.Checkpoint.from_directory(str(given)))
    first = trainer.fit()
    assert (first.return_value, first.metrics) == (41, {"count": 42})
    # fit() again on the same run: its committed checkpoint wins over resume_from_checkpoint.
    second = trainer.fit()
    assert (second.return_value, second.metrics) == (42, {"count": 43})
    assert [m["count"] for _, m in second.best_checkpoints] == [42, 43]


def test_reported_checkpoints_errors_and_result_from_path_are_ray_trains(local_cluster, run_dir):
    """Ray Train's contract on two ranks: ``get_all_reported_checkpoints()`` on every rank
    (rank 1 reports no files and still sees rank 0's, waiting for their commit), retention
    by a score attribute, a user error raised as ``ray.train.WorkerGroupError`` with the
    worker's error first, and ``Result.from_path`` reading the run afterwards."""

    def train_fn(config):  # nested, so Ray ships it by value
        rank = ray.train.get_context().get_world_rank()
        seen = []
        for i in range(4):
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    with open(os.path.join(d, "i.txt"), "w") as fh:
                        fh.write(str(i))
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report({"score": i, "rank": rank}, checkpoint=checkpoint)
            seen.append(sorted(c.metrics["score"] for c in ray.train.get_all_reported_checkpoints()))
        assert seen == [[0], [0, 1], [1, 2], [2, 3]], seen  # num_to_keep=2 by max score
        if rank == 1:
            raise ValueError("bad batch on rank 1")

    trainer = raylastic.TorchTrainer(
        train_fn, scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(
            name="contract", storage_path=run_dir,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score",
                                                         checkpoint_score_order="max")))
    with pytest.raises(ray.train.WorkerGroupError) as info:
        trainer.fit()
    err = info.value
    assert isinstance(err, ray.train.TrainingFailedError) and isinstance(err, raylastic.TrainingFailedError)
    assert str(err).startswith("Training failed due to worker errors:\n[Rank 1]: error: ValueError: bad batch on rank 1")
    assert list(err.worker_failures) == [1] and "bad batch" in str(err.worker_failures[1])

    result = ray.train.Result.from_path(os.path.join(run_dir, "contract"))
    assert [m["score"] for _, m in result.best_checkpoints] == [2, 3]
    with result.get_best_checkpoint("score", "max").as_directory() as d:
        assert open(os.path.join(d, "i.txt")).read() == "3"
    assert len(_checkpoint_dirs(result.path)) == 2


# -- Ray Train's Backend hooks and UserCallbacks (DataParallelTrainer(backend_config=...)) --

def _append(path, line):
    with open(path, "a") as fh:  # one line per write: the controller and test read it
        fh.write(line + "\n")


def _lines(path):
    return open(path).read().splitlines() if os.path.exists(path) else []


def _set_env(name, value):
    os.environ[name] = value
    return os.getpid()


def _get_env(name):  # not os.environ.get: that pickles the caller's os.environ with it
    return os.environ.get(name)


def test_backend_hooks_and_user_callbacks_run_around_every_group(local_cluster, restore_nodes, run_dir, tmp_path):
    """A custom BackendConfig: its hooks run in the controller once per group formed (two
    here: a node is lost and the group re-forms smaller), ``worker_group.execute`` reaches
    every member before the train function runs, ``train_func_context`` wraps the train
    function. A UserCallback gets every rank's metrics per report and the lost rank."""
    hooks_log, cb_log = str(tmp_path / "hooks.log"), str(tmp_path / "callbacks.log")

    class ValidationBackend(Backend):
        def on_start(self, worker_group, backend_config):
            pids = worker_group.execute(_set_env, "RAYLASTIC_TEST_HOOKED", "on_start")
            assert len(set(pids)) == len(worker_group)  # one worker process each
            _append(hooks_log, f"on_start {len(worker_group)}")

        def on_training_start(self, worker_group, backend_config):
            seen = ray.get(worker_group.execute_async(_get_env, "RAYLASTIC_TEST_HOOKED"))
            rank0 = worker_group.execute_single(0, os.getpid)
            assert ray.get(worker_group.execute_single_async(0, os.getpid)) == rank0
            assert worker_group.get_resources_per_worker() == {"CPU": 1}
            _append(hooks_log, f"on_training_start {len(worker_group)} {','.join(seen)}")

        def on_shutdown(self, worker_group, backend_config):
            _append(hooks_log, f"on_shutdown {len(worker_group)}")

    class ValidationConfig(BackendConfig):
        @property
        def backend_cls(self):
            return ValidationBackend

        @property
        def train_func_context(self):
            import contextlib

            @contextlib.contextmanager
            def context():
                os.environ["RAYLASTIC_TEST_CONTEXT"] = "entered"
                yield

            return context

    class Recorder(ray.train.UserCallback):  # called in the controller actor: it writes to a file
        def after_report(self, run_context, metrics, checkpoint):
            steps = sorted({m["step"] for m in metrics})
            _append(cb_log, f"report {run_context.get_run_config().name} {len(metrics)} {steps} {checkpoint}")
            assert all(m["hooked"] == "on_start" and m["context"] == "entered" for m in metrics), metrics

        def after_exception(self, run_context, worker_exceptions):
            _append(cb_log, "exception " + " ".join(f"{r}:{e}" for r, e in worker_exceptions.items()))

    def train_fn():
        import time

        for step in range(20):
            ray.train.report({"step": step, "hooked": os.environ.get("RAYLASTIC_TEST_HOOKED"),
                              "context": os.environ.get("RAYLASTIC_TEST_CONTEXT")})
            # only the group of 3 must outlast the kill at report 3: the group of 2 redoes 20 steps
            time.sleep(0.5 if ray.train.get_context().get_world_size() == 3 else 0.05)

    trainer = raylastic.TorchTrainer(
        train_fn, torch_config=ValidationConfig(),
        scaling_config=ray.train.ScalingConfig(num_workers=(2, 3)),
        run_config=ray.train.RunConfig(name="hooks", storage_path=run_dir, callbacks=[Recorder()],
                                       failure_config=ray.train.FailureConfig(max_failures=0)))
    th = FitThread(trainer)
    th.start()
    kill_node_at(local_cluster, RunWatcher(os.path.join(run_dir, "hooks")), 3)
    result = th.wait(180)

    assert result.world_sizes == [3, 2]
    assert result.metrics == {"step": 19, "hooked": "on_start", "context": "entered"}
    assert _lines(hooks_log) == ["on_start 3", "on_training_start 3 on_start,on_start,on_start", "on_shutdown 3",
                                 "on_start 2", "on_training_start 2 on_start,on_start", "on_shutdown 2"]
    reports = [line for line in _lines(cb_log) if line.startswith("report ")]
    exceptions = [line for line in _lines(cb_log) if line.startswith("exception ")]
    # the second group redid every step (no checkpoints): 20 complete reports of 2 ranks
    assert reports[-20:] == [f"report hooks 2 [{s}] None" for s in range(20)]
    assert reports[:-20] and all(line.startswith("report hooks 3 [") for line in reports[:-20])
    assert len(exceptions) == 1 and exceptions[0].startswith("exception 2:"), exceptions


def test_user_callback_errors_are_ray_trains(local_cluster, run_dir, tmp_path):
    """Ray's own test_user_callback, plus a checkpoint: rank 0 raises after its report
    (the run fails with WorkerGroupError, after_exception sees rank 0 only); then a
    callback that raises ends a run with ControllerError carrying its exception."""
    cb_log = str(tmp_path / "callbacks.log")

    class Recorder(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            _append(cb_log, f"report {len(metrics)} {os.path.basename(checkpoint.path) if checkpoint else None}")

        def after_exception(self, run_context, worker_exceptions):
            _append(cb_log, f"exception {sorted(worker_exceptions)} {worker_exceptions[0]}")

    def train_fn():
        rank = ray.train.get_context().get_world_rank()
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                open(os.path.join(d, "x"), "w").close()
                checkpoint = ray.train.Checkpoint.from_directory(d)
            ray.train.report({"rank": rank}, checkpoint=checkpoint)
        if rank == 0:
            import time

            time.sleep(1)  # rank 1's report reaches the controller first
            raise ValueError("error")

    with pytest.raises(ray.train.WorkerGroupError) as info:
        raylastic.TorchTrainer(train_fn, scaling_config=ray.train.ScalingConfig(num_workers=2),
                               run_config=ray.train.RunConfig(name="cb", storage_path=run_dir,
                                                              callbacks=[Recorder()])).fit()
    assert list(info.value.worker_failures) == [0]
    assert _lines(cb_log) == ["report 2 checkpoint_00000001-e1", "exception [0] ValueError: error"]

    class Broken(ray.train.UserCallback):
        def after_report(self, run_context, metrics, checkpoint):
            raise KeyError("callback bug")

    with pytest.raises(ray.train.ControllerError) as info:
        raylastic.TorchTrainer(lambda: ray.train.report({"x": 1}), scaling_config=ray.train.ScalingConfig(num_workers=2),
                               run_config=ray.train.RunConfig(name="broken", storage_path=run_dir,
                                                              callbacks=[Broken()])).fit()
    assert isinstance(info.value.controller_failure, KeyError)
    assert "Broken.after_report raised KeyError" in str(info.value)
