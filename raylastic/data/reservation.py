"""Keep Ray Data off the CPUs the training workers need, as Ray Train does.

Why: Ray Data sizes its executions from what Ray's autoscaling coordinator reserves for it
(``get_total_resources`` in Ray Data's cluster autoscalers), and the coordinator gives
every requester a share of the cluster by priority. A trainer that never tells it about its
workers leaves Ray Data free to take the whole cluster: a streaming dataset's tasks and
actor pools can then hold the CPU a replacement or added worker needs after a node loss,
and the group waits for a worker that cannot be placed while the dataset waits for a
consumer. Ray Train 2.60 registers its workers with the coordinator at ``HIGH`` priority
(``TrainAutoscalingCoordinatorClient``); this does the same for a raylastic run with
``datasets=``, for ``max_workers`` workers (what the run may grow to), refreshed every
``REQUEST_INTERVAL_S`` (requests expire) and cancelled when ``fit()`` returns.

One difference from Ray Train: the request is capped so that Ray Data keeps at least one
CPU of the cluster as it is now (``reservable_workers``): a cluster no bigger than the
training group would otherwise leave Ray Data no CPU at all, and the run would stall on
its own input.

The coordinator also forwards the merged requests to the Ray autoscaler
(``request_resources``), as it already does for Ray Data's own requests; on a cluster where
raylastic's capacity driver asks the autoscaler for typed nodes, the two requests replace
each other (see docs/status.md).
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Dict, Optional

logger = logging.getLogger(__name__)

REQUEST_INTERVAL_S = 20.0  # as Ray Train's AUTOSCALING_REQUESTS_INTERVAL_S
EXPIRE_S = 180.0  # a request outlives a dead driver by this much at most
GET_TIMEOUT_S = 5.0


def reservable_workers(wanted: int, bundle: Dict[str, float], cluster_cpus: float) -> int:
    """How many worker bundles to reserve: ``wanted``, but leaving Ray Data one CPU of the
    ``cluster_cpus`` there are (a bundle without CPUs is never capped)."""
    cpu = float(bundle.get("CPU", 0.0))
    if wanted <= 0:
        return 0
    if cpu <= 0:
        return wanted
    return max(0, min(wanted, math.floor((cluster_cpus - 1.0) / cpu + 1e-9)))


class TrainingReservation:
    """Context manager: the run's worker bundles reserved against Ray Data while it runs."""

    def __init__(self, requester_id: str, bundle: Dict[str, float], workers: int):
        self.requester_id = requester_id
        self.bundle = dict(bundle)
        self.workers = workers
        self.reserved = 0  # bundles in the last request sent
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._coordinator = None

    def __enter__(self) -> "TrainingReservation":
        self.send()
        self._thread = threading.Thread(target=self._refresh, daemon=True, name="raylastic-data-reservation")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(GET_TIMEOUT_S + 1)
        self.cancel()

    def _refresh(self) -> None:
        while not self._stop.wait(REQUEST_INTERVAL_S):
            self.send()

    def _actor(self):
        if self._coordinator is None:
            from ray.data._internal.cluster_autoscaler.default_autoscaling_coordinator import (
                get_or_create_autoscaling_coordinator,
            )

            self._coordinator = get_or_create_autoscaling_coordinator()
        return self._coordinator

    def send(self) -> None:
        """(Re)send the request, sized for the cluster as it is now. Failures are logged,
        not raised: a missing reservation costs Ray Data's manners, never the run."""
        import ray
        from ray.data._internal.cluster_autoscaler.base_autoscaling_coordinator import ResourceRequestPriority

        try:
            n = reservable_workers(self.workers, self.bundle, float(ray.cluster_resources().get("CPU", 0.0)))
            ray.get(
                self._actor().request_resources.remote(
                    requester_id=self.requester_id,
                    resources=[dict(self.bundle)] * n,
                    expire_after_s=EXPIRE_S,
                    priority=ResourceRequestPriority.HIGH,
                ),
                timeout=GET_TIMEOUT_S,
            )
            self.reserved = n
        except Exception as e:  # noqa: BLE001 - best effort, as Ray Train's client
            logger.warning("could not reserve the training workers' resources against Ray Data: %s", e)

    def cancel(self) -> None:
        import ray

        if self._coordinator is None:
            return
        try:
            ray.get(self._coordinator.cancel_request.remote(requester_id=self.requester_id), timeout=GET_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the request expires after EXPIRE_S anyway
            logger.warning(
                "could not cancel the Ray Data reservation %s (it expires in %.0f s): %s",
                self.requester_id,
                EXPIRE_S,
                e,
            )
