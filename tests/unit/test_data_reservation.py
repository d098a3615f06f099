"""How many worker bundles a run reserves against Ray Data (raylastic/data/reservation.py)."""

from raylastic.data.reservation import reservable_workers


def test_max_workers_are_reserved_when_the_cluster_leaves_ray_data_a_cpu():
    assert reservable_workers(3, {"CPU": 1}, cluster_cpus=6) == 3
    assert reservable_workers(3, {"CPU": 1}, cluster_cpus=4) == 3


def test_the_request_is_capped_so_ray_data_keeps_one_cpu():
    assert reservable_workers(3, {"CPU": 1}, cluster_cpus=3) == 2
    assert reservable_workers(3, {"CPU": 2}, cluster_cpus=6) == 2
    assert reservable_workers(3, {"CPU": 2, "GPU": 1}, cluster_cpus=2) == 0
    assert reservable_workers(2, {"CPU": 0.5}, cluster_cpus=1.5) == 1


def test_bundles_without_cpus_and_empty_runs():
    assert reservable_workers(4, {"GPU": 1}, cluster_cpus=0) == 4
    assert reservable_workers(0, {"CPU": 1}, cluster_cpus=8) == 0
