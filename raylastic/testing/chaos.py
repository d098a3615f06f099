"""Chaos: a seeded schedule of faults of every kind, and an injector that plays it
against a training run on a real local cluster.

Why a shipped module: the chaos test (``tests/integration/test_chaos.py``, a few faults,
correctness only) and the chaos benchmark (``benchmarks/chaos.py``, 20 faults, goodput
against Ray Train) must inject the *same* faults the same way, and users can replay a
schedule against their own train function. A schedule is a pure value drawn from a seed,
so a failing run is reproduced by its seed::

    from raylastic.testing.chaos import ChaosSchedule, ChaosInjector, FaultKind

    schedule = ChaosSchedule.from_seed(7, num_faults=20, interval_s=(20, 30))
    print(schedule.describe())
    injector = ChaosInjector(cluster, schedule, log_dir=cfg["log_dir"], storage=seaweed,
                             checkpoint_every=25)
    injector.run(t0=time.time())              # blocks until every fault was applied
    injector.applied                          # what was done, when, to which node/pid

Fault kinds (:class:`FaultKind`):

- ``kill_node``: a node of the training group is removed without notice (its raylet and
  every process on it die, the GCS declares it dead: a spot loss with no warning).
- ``drain_node``: the node gets a Ray drain request (reason preemption) with a 2-10 s
  deadline, the way the autoscaler / KubeRay pass on a spot termination notice, and is
  removed at the deadline.
- ``kill_worker``: one worker process is SIGKILLed; its node stays up (a crash).
- ``kill_during_upload``: when rank 0 reports the step whose checkpoint goes to storage
  (a multiple of ``checkpoint_every``), rank 0's node (the uploader) is removed at once.
- ``kill_two_nodes``: two nodes of the group are removed back to back.
- ``stop_storage``: the object store (a real server, e.g. SeaweedFS) is stopped for
  ``outage_s`` (10 s) and started again on the same ports and data.
- ``add_node``: a node is added back to the cluster.

The injector knows the group from the files the train functions of
:mod:`raylastic.testing.chaos_train` write (``members.jsonl``, ``steps.jsonl``): before each
fault it waits (bounded) until a whole group is training, so every fault hits a running
group, whichever framework runs it.

The schedule (:class:`FaultKind`, :class:`Fault`, :class:`ChaosSchedule`) is defined in
:mod:`raylastic.testing.chaos_schedule`, a pure value with no cluster behind it, and
re-exported here; this module is what touches the cluster.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, cast

from raylastic.testing.chaos_schedule import NODE_LOSS_KINDS, ChaosSchedule, Fault, FaultKind

__all__ = [
    "FaultKind",
    "Fault",
    "ChaosSchedule",
    "ChaosInjector",
    "GroupView",
    "NODE_LOSS_KINDS",
    "raylastic_upload_probe",
]


def raylastic_upload_probe(tmp_root: Optional[str] = None) -> Callable[[int], bool]:
    """``probe(step)``: True while a raylastic rank 0 on this machine holds the persisted
    ``ElasticState`` snapshot of report ``step`` in its upload staging directory
    (``<tmp>/raylastic-staging-*/e<epoch>-<step>-r0/``), i.e. from when it is serialised
    until its upload to storage ends (``checkpoint/uploader.py`` removes the staged copy
    then). Every node of a local cluster shares this machine's temp directory. Staging
    roots that existed when the probe was made (other runs) are not looked at."""
    import tempfile

    root = tmp_root or tempfile.gettempdir()
    before = {n for n in os.listdir(root) if n.startswith("raylastic-staging-")}

    def probe(step: int) -> bool:
        suffix = f"-{step}-r0"
        for name in os.listdir(root):
            if not name.startswith("raylastic-staging-") or name in before:
                continue
            try:
                for key in os.listdir(os.path.join(root, name)):
                    path = os.path.join(root, name, key, "elastic_state.pt")
                    if key.startswith("e") and key.endswith(suffix) and os.path.getsize(path) > 0:
                        return True
            except OSError:  # removed meanwhile: the upload is over
                pass
        return False

    return probe


# ---------------------------------------------------------------------------------------
def read_jsonl(path: str) -> List[Dict[str, Any]]:
    """Complete lines of a JSON-lines file (a half-written last line is skipped)."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.endswith("\n")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class GroupView:
    """The training group as the train functions log it (``members.jsonl``, ``steps.jsonl``)."""

    def __init__(self, log_dir: str):
        self.log_dir = log_dir

    def steps(self) -> List[Dict[str, Any]]:
        return read_jsonl(os.path.join(self.log_dir, "steps.jsonl"))

    def training_group(self, min_world: int = 1, recent_s: float = 5.0) -> Optional[List[Dict[str, Any]]]:
        """The members (sorted by rank) of the newest group whose ranks have all started and
        whose rank 0 completed a step in the last ``recent_s`` seconds, if it has at least
        ``min_world`` ranks."""
        members = read_jsonl(os.path.join(self.log_dir, "members.jsonl"))
        if not members:
            return None
        newest = max(members, key=lambda m: m["t"])["group"]
        rows = sorted((m for m in members if m["group"] == newest), key=lambda m: m["rank"])
        if len(rows) < rows[0]["world"] or rows[0]["world"] < min_world:
            return None
        steps = self.steps()
        # training: rank 0 of this group logged the newest step, recently, and every member
        # process is alive (a group a framework gave up on keeps its lines)
        if not steps or steps[-1]["group"] != newest or time.time() - steps[-1]["t"] > recent_s:
            return None
        if not all(_alive(m["pid"]) for m in rows):
            return None
        return rows

    def last_step(self) -> int:
        s = self.steps()
        return s[-1]["step"] if s else 0


@dataclass
class Applied:
    """What the injector did for one fault (the JSON the benchmark records)."""

    fault: Fault
    started_at_s: float = 0.0
    done_at_s: float = 0.0
    world: Optional[int] = None
    nodes: List[str] = field(default_factory=list)
    pids: List[int] = field(default_factory=list)
    at_step: Optional[int] = None
    skipped: Optional[str] = None
    note: Optional[str] = None

    def to_json(self) -> Dict[str, Any]:
        out = {
            "fault": self.fault.to_json(),
            "started_at_s": round(self.started_at_s, 2),
            "done_at_s": round(self.done_at_s, 2),
            "world": self.world,
            "nodes": self.nodes,
            "pids": self.pids,
            "at_step": self.at_step,
        }
        if self.skipped:
            out["skipped"] = self.skipped
        if self.note:
            out["note"] = self.note
        return out


class ChaosInjector:
    """Plays a :class:`ChaosSchedule` against a run on a ``raylastic.testing.LocalCluster``.

    ``storage``: the object-store server (``stop()``/``start()``, e.g.
    :class:`raylastic.testing.seaweedfs.SeaweedS3`) for ``stop_storage``; ``checkpoint_every``:
    the step cadence of storage checkpoints, for ``kill_during_upload``; ``group_timeout_s``:
    how long a fault waits for a training group; ``strict=False`` records a fault that
    could not be applied (no training group in time, ...) as skipped instead of raising;
    ``upload_probe(step)``: True while the checkpoint of ``step`` is being uploaded (e.g.
    :func:`raylastic_upload_probe`); without one, ``kill_during_upload`` kills as soon as
    rank 0 logs the step (a framework that uploads inside ``report()``, like Ray Train).
    Must run on the main thread (Ray adds nodes only there): run ``fit()`` in a
    :class:`raylastic.testing.faults.FitThread`.
    """

    def __init__(
        self,
        cluster,
        schedule: ChaosSchedule,
        *,
        log_dir: str,
        storage=None,
        checkpoint_every: Optional[int] = None,
        group_timeout_s: float = 120.0,
        strict: bool = True,
        on_fault: Optional[Callable[[Applied], None]] = None,
        alive: Callable[[], bool] = lambda: True,
        upload_probe: Optional[Callable[[int], bool]] = None,
    ):
        needs = {f.kind for f in schedule.faults}
        if FaultKind.STOP_STORAGE in needs and storage is None:
            raise ValueError("schedule has stop_storage faults: pass storage=<server with stop()/start()>")
        if FaultKind.KILL_DURING_UPLOAD in needs and not checkpoint_every:
            raise ValueError("schedule has kill_during_upload faults: pass checkpoint_every=<storage cadence>")
        self.cluster, self.schedule, self.storage = cluster, schedule, storage
        self.view = GroupView(log_dir)
        self.checkpoint_every = checkpoint_every
        self.group_timeout_s, self.strict = group_timeout_s, strict
        self.on_fault, self.alive, self.upload_probe = on_fault, alive, upload_probe
        self.applied: List[Applied] = []
        self.t0 = 0.0

    def wait_for_training(self, timeout_s: float) -> None:
        """Until the run's first group has completed a step (call before :meth:`run`)."""
        from raylastic.testing.cluster import wait_until

        wait_until(
            lambda: self.view.training_group() is not None,
            timeout_s,
            interval_s=0.1,
            what=f"the first training step in {self.view.log_dir}",
        )

    def run(self, t0: Optional[float] = None) -> List[Applied]:
        """Apply every fault at its time after ``t0`` (default: now); a fault whose time
        has passed (the previous one took long) is applied at once."""
        self.t0 = time.time() if t0 is None else t0
        for fault in self.schedule.faults:
            delay = self.t0 + fault.at_s - time.time()
            if delay > 0:
                self._sleep(delay)
            rec = Applied(fault, started_at_s=time.time() - self.t0)
            try:
                self._apply(fault, rec)
            except Exception as exc:  # noqa: BLE001 - strict: raise; else recorded as skipped
                if self.strict:
                    raise
                rec.skipped = f"{type(exc).__name__}: {exc}"
            rec.done_at_s = time.time() - self.t0
            self.applied.append(rec)
            if self.on_fault:
                self.on_fault(rec)
        return self.applied

    # -- one fault --------------------------------------------------------------------------
    def _sleep(self, seconds: float) -> None:
        """The schedule's own clock (not a synchronisation): stops early if the run died."""
        end = time.time() + seconds
        while time.time() < end:
            if not self.alive():
                raise RuntimeError("the run ended while faults were still scheduled")
            time.sleep(min(0.2, max(0.0, end - time.time())))

    def _group(self, min_world: int) -> List[Dict[str, Any]]:
        from raylastic.testing.cluster import wait_until

        def ready():
            if not self.alive():
                raise RuntimeError("the run ended while faults were still scheduled")
            g = self.view.training_group(min_world)
            # every member's node must still be up (a removed node's group is not training)
            live = {n.node_id for n in self.cluster.worker_nodes}
            return g if g and all(m["node_id"] in live for m in g) else None

        return wait_until(
            ready,
            self.group_timeout_s,
            interval_s=0.1,
            what=f"a training group of >= {min_world} worker(s) in {self.view.log_dir}",
        )

    def _pids_on(self, node_ids: Sequence[str]) -> List[int]:
        """Worker pids of the current group on those nodes (after a drain the group moved)."""
        g = self.view.training_group() or []
        return [m["pid"] for m in g if m["node_id"] in node_ids]

    def _pick(self, group: List[Dict[str, Any]], fault: Fault, count: int) -> List[Dict[str, Any]]:
        rng = random.Random(fault.pick)
        return rng.sample(group, count)

    def _remove(self, node_ids: Sequence[str], pids: Sequence[int] = ()) -> None:
        """Kill the group's processes on those nodes first (removing a node stops its raylet
        first, and a worker can go on for a moment), then the nodes: everything at once."""
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for nid in node_ids:
            self.cluster.remove_node(self.cluster.node_by_id(nid))

    def _apply(self, fault: Fault, rec: Applied) -> None:
        kind = fault.kind
        if kind is FaultKind.ADD_NODE:
            node = self.cluster.add_node()
            rec.nodes = [node.node_id]
            return
        if kind is FaultKind.STOP_STORAGE:
            rec.at_step = self.view.last_step()
            self.storage.stop()
            try:
                self._sleep(float(fault.outage_s or 10.0))
            finally:
                self.storage.start()
            return
        group = self._group(2 if kind is FaultKind.KILL_TWO_NODES else 1)
        rec.world = len(group)
        if kind is FaultKind.KILL_DURING_UPLOAD:
            every = int(cast(int, self.checkpoint_every))  # set: __init__ checks it for kill_during_upload
            target = (self.view.last_step() // every + 1) * every
            from raylastic.testing.cluster import wait_until

            rec.at_step = wait_until(
                lambda: self.view.last_step() >= target and self.view.last_step(),
                self.group_timeout_s,
                interval_s=0.01,
                what=f"step {target}",
            )
            if self.upload_probe is not None:
                try:
                    wait_until(
                        lambda: self.upload_probe(target),
                        10.0,
                        interval_s=0.005,
                        what=f"the upload of checkpoint {target}",
                    )
                    rec.note = f"killed while checkpoint {target} was staged for upload"
                except TimeoutError:
                    rec.note = f"checkpoint {target}'s upload was not seen in flight"
            victims = [group[0]]  # rank 0 uploads
        else:
            victims = self._pick(group, fault, 2 if kind is FaultKind.KILL_TWO_NODES else 1)
            rec.at_step = self.view.last_step()
        rec.nodes = [v["node_id"] for v in victims]
        rec.pids = [v["pid"] for v in victims]
        if kind is FaultKind.KILL_WORKER:
            rec.nodes = []
            try:
                os.kill(victims[0]["pid"], signal.SIGKILL)
            except ProcessLookupError:  # the group failed between the check and now
                rec.note = "the process was already gone"
        elif kind is FaultKind.DRAIN_NODE:
            from ray._raylet import GcsClient  # type: ignore[attr-defined]  # not in Ray's partial _raylet.pyi
            from ray.core.generated import autoscaler_pb2

            deadline = time.time() + float(fault.deadline_s or 5.0)
            GcsClient(address=self.cluster.address).drain_node(
                rec.nodes[0],
                autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "chaos: spot termination notice",
                int(deadline * 1000),
            )
            self._sleep(max(0.0, deadline - time.time()))  # the cloud keeps its word
            self._remove(rec.nodes, self._pids_on(rec.nodes))
        else:
            self._remove(rec.nodes, rec.pids)
