"""One benchmark second stands for ``real_s_per_sim_s`` real seconds.

A local spot cloud must compress a real one: a job of hours into minutes. Compressing
only some phases distorts the answer (a 60 s idle timeout next to 2 s boots makes a
released node look far costlier than it is on a cloud, where boots take minutes). So the
simulator derives every cloud duration from one real-world value and one scale:

======================  =================  ===================================================
duration                real world         source (docs/simulator.md has the links)
======================  =================  ===================================================
node boot to Ray joined 90 s               EC2/GCE/Azure VM start ~30-60 s plus Ray start on a
                                           pre-built image; ``ray up`` with setup commands is
                                           slower (minutes)
idle node terminated    3 s + 2 s loop     the shipped cluster configs: ``idle_timeout_minutes:
                                           0.05``, ``AUTOSCALER_UPDATE_INTERVAL_S=2``
                                           (docs/release.md)
preemption notice       AWS 120 s; Azure   AWS spot interruption notice; Azure Scheduled
                        and GCP 30 s       Events (Preempt); GCP preemption notice
======================  =================  ===================================================

Trace files keep their meaning (times and notices in benchmark seconds); a report gives
both units through :meth:`TimeScale.real`. What cannot be scaled is said where it is
measured: a raylet starts in ~1.1-2.3 s here (boots shorter than that cannot be
simulated), Ray's autoscaler loop runs at most once a second (1 s floor on the idle
timeout's effect), and training, restarts and recoveries take what they take (they are
not stretched: at 10x, a 2 s resize stands for 20 s, which overstates every system's
recovery alike).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping

RAYLET_START_S = 1.5  # measured here: a local raylet needs 1.1-2.3 s to register
AUTOSCALER_LOOP_FLOOR_S = 1.0  # AUTOSCALER_UPDATE_INTERVAL_S is an integer: 1 s at least


@dataclass(frozen=True, kw_only=True)
class RealWorld:
    """Real-world durations in seconds (see the module docstring for sources)."""

    boot_s: float = 90.0
    idle_timeout_s: float = 3.0
    autoscaler_interval_s: float = 2.0
    notice_s: Mapping[str, float] = field(default_factory=lambda: {"aws": 120.0, "azure": 30.0, "gcp": 30.0})


@dataclass(frozen=True)
class TimeScale:
    """``real_s_per_sim_s`` real seconds per benchmark second (10: a 2-minute local run
    stands for 20 minutes of a real cloud)."""

    real_s_per_sim_s: float = 10.0
    world: RealWorld = field(default_factory=RealWorld)

    def __post_init__(self) -> None:
        v = self.real_s_per_sim_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(
                f"time_scale={v!r} must be a finite number > 0 (real seconds per benchmark second, e.g. 10)"
            )

    def sim(self, real_s: float) -> float:
        """Benchmark seconds that stand for ``real_s`` real seconds."""
        return real_s / self.real_s_per_sim_s

    def real(self, sim_s: float) -> float:
        """Real seconds that ``sim_s`` benchmark seconds stand for."""
        return sim_s * self.real_s_per_sim_s

    @property
    def launch_delay_s(self) -> float:
        """Added before a node's raylet starts, so launch -> node up is the scaled boot."""
        return max(0.0, self.sim(self.world.boot_s) - RAYLET_START_S)

    @property
    def idle_timeout_s(self) -> float:
        return self.sim(self.world.idle_timeout_s)

    def notice_s(self, cloud: str) -> float:
        return self.sim(self.world.notice_s[cloud])

    def to_record(self) -> Dict[str, Any]:
        """What one benchmark second stands for, and each derived duration (both units)."""
        w = self.world
        return {
            "real_s_per_sim_s": self.real_s_per_sim_s,
            "boot": {
                "real_s": w.boot_s,
                "sim_s": round(self.sim(w.boot_s), 3),
                "sim_launch_delay_s": round(self.launch_delay_s, 3),
                "sim_raylet_start_s": RAYLET_START_S,
            },
            "idle_timeout": {
                "real_s": w.idle_timeout_s,
                "sim_s": round(self.idle_timeout_s, 3),
                "real_autoscaler_interval_s": w.autoscaler_interval_s,
                "sim_autoscaler_interval_s": AUTOSCALER_LOOP_FLOOR_S,
            },
            "notice": {c: {"real_s": s, "sim_s": round(self.sim(s), 3)} for c, s in w.notice_s.items()},
        }
