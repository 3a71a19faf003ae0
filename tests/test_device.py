"""Device values, local-rank variables and the GPU mapping (pure logic, no MPI)."""

from __future__ import annotations

import pytest

import mpitensor as mt
from mpitensor._core.device import gpu_for_local_rank, local_rank_from_env, visible_gpu_count


def test_devices_are_values_ordered_by_rank():
    a, b, c = mt.Device("cuda", 1, 0), mt.Device("cpu", 0, 1), mt.Device("cuda", 0, 1)
    assert sorted([c, b, a]) == [a, b, c]
    assert mt.Device("cpu", 0, 2) == mt.Device("cpu", 0, 2)
    assert len({mt.Device("cpu", 0, 2), mt.Device("cpu", 0, 2)}) == 1
    assert str(mt.Device("cuda", 3, 5)) == "cuda:3@rank5"
    assert str(mt.Device("cpu")) == "cpu:0"
    assert mt.Device("cuda", 1).same_place(mt.Device("cuda", 1, 4))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (("gpu",), ValueError, "device kind must be 'cpu' or 'cuda', got 'gpu'"),
        (("cuda", -1), ValueError, "device index must be >= 0, got -1"),
        (("cuda", 0, -2), ValueError, "device rank must be >= 0, got -2"),
        (("cuda", "0"), TypeError, "device index must be an int, got str"),
        (("cpu", 1), ValueError, "a rank has one CPU device, index 0; got index 1"),
    ],
)
def test_bad_devices(args, error, message):
    with pytest.raises(error, match=message):
        mt.Device(*args)


@pytest.mark.parametrize(("local", "count", "gpu"), [(0, 4, 0), (3, 4, 3), (5, 4, 1), (2, 1, 0), (7, 3, 1)])
def test_local_rank_maps_round_robin_onto_visible_gpus(local, count, gpu):
    assert gpu_for_local_rank(local, count) == gpu


def test_no_visible_gpu_is_a_clear_error():
    with pytest.raises(mt.DeviceError, match="no CUDA GPU is visible to this rank"):
        gpu_for_local_rank(0, 0)


def test_launcher_variables_in_order_of_trust():
    assert local_rank_from_env({}) is None
    assert local_rank_from_env({"SLURM_LOCALID": "3"}) == (3, "SLURM_LOCALID")
    env = {"SLURM_LOCALID": "3", "MPI_LOCALRANKID": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    assert local_rank_from_env(env) == (2, "OMPI_COMM_WORLD_LOCAL_RANK")
    assert local_rank_from_env({"MPI_LOCALRANKID": "x", "PMI_LOCAL_RANK": "4"}) == (4, "PMI_LOCAL_RANK")


def test_an_empty_cuda_visible_devices_hides_every_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_count() == 0
