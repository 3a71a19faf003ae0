"""Which device each rank gets: the mapping from local rank to GPU, and the errors.

Everything here runs without a GPU: the mapping is a pure function of the local rank, the
number of visible GPUs and what was asked for; the context tests check what a machine
without a GPU does.
"""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest

import mpitensor as mt
from mpitensor._core.device import gpu_for_local_rank, local_rank_from_env, plan_device, probe_gpus, visible_gpu_count

HAVE_CUPY = importlib.util.find_spec("cupy") is not None
GPUS, NO_GPU_REASON = probe_gpus()
needs_no_gpu = pytest.mark.skipif(GPUS > 0, reason="this machine has a GPU; tests/gpu covers it")


@pytest.mark.parametrize(
    ("local_rank", "gpus", "expected"),
    [(0, 1, 0), (1, 1, 0), (3, 1, 0), (0, 4, 0), (3, 4, 3), (4, 4, 0), (5, 4, 1), (7, 2, 1)],
)
def test_local_rank_picks_gpu_round_robin(local_rank, gpus, expected):
    assert plan_device(local_rank, gpus) == ("cuda", expected)
    assert gpu_for_local_rank(local_rank, gpus) == expected


def test_ranks_of_a_node_share_its_gpus_evenly():
    used = Counter(plan_device(local_rank, 3)[1] for local_rank in range(8))
    assert used == {0: 3, 1: 3, 2: 2}


def test_no_gpu_or_no_cupy_gives_the_cpu():
    assert plan_device(2, 0) == ("cpu", 0)
    assert plan_device(2, 4, cupy_installed=False) == ("cpu", 0)


def test_forced_cpu_ignores_visible_gpus():
    assert plan_device(1, 4, kind="cpu") == ("cpu", 0)
    assert plan_device(1, 0, kind="cpu", cupy_installed=False) == ("cpu", 0)


def test_forced_cuda_maps_the_local_rank():
    assert plan_device(5, 2, kind="cuda") == ("cuda", 1)


def test_given_gpu_is_kept_whatever_the_local_rank():
    assert plan_device(3, 2, kind="cuda", index=1) == ("cuda", 1)


def test_gpu_without_cupy_says_how_to_install_it():
    with pytest.raises(mt.DeviceError) as info:
        plan_device(0, 0, kind="cuda", cupy_installed=False, rank=3)
    message = str(info.value)
    assert message.startswith("rank 3 was asked for a CUDA device, but CuPy is not installed")
    assert "pip install 'mpitensor[cuda]'" in message
    assert "'mpitensor[cuda13]'" in message
    assert "DistributedConfig(device='cpu')" in message


def test_gpu_without_a_visible_gpu_names_the_reason_and_cuda_visible_devices():
    with pytest.raises(mt.DeviceError) as info:
        plan_device(
            1,
            0,
            kind="cuda",
            rank=1,
            reason="CUDA_VISIBLE_DEVICES is empty, which hides every GPU",
            environ={"CUDA_VISIBLE_DEVICES": ""},
        )
    message = str(info.value)
    assert message.startswith(
        "rank 1 was asked for a CUDA device, but it sees no CUDA GPU "
        "(CUDA_VISIBLE_DEVICES is empty, which hides every GPU); CUDA_VISIBLE_DEVICES=''"
    )


def test_gpu_without_a_visible_gpu_when_cuda_visible_devices_is_unset():
    with pytest.raises(mt.DeviceError, match=r"sees no CUDA GPU; CUDA_VISIBLE_DEVICES is not set"):
        plan_device(0, 0, kind="cuda", environ={})


def test_given_gpu_that_does_not_exist_here():
    with pytest.raises(mt.DeviceError) as info:
        plan_device(0, 2, kind="cuda", index=2, rank=1, environ={"CUDA_VISIBLE_DEVICES": "4,5"})
    assert str(info.value) == (
        "rank 1 was given device cuda:2, but it sees 2 CUDA GPU(s), cuda:0 to cuda:1 "
        "(CUDA_VISIBLE_DEVICES='4,5')"
    )


def test_bad_arguments_are_value_errors():
    with pytest.raises(ValueError, match=r"device kind must be 'cpu', 'cuda' or None, got 'tpu'"):
        plan_device(0, 1, kind="tpu")
    with pytest.raises(ValueError, match=r"local rank must be >= 0, got -1"):
        plan_device(-1, 1)
    with pytest.raises(ValueError, match=r"GPU index must be >= 0, got -2"):
        plan_device(0, 1, kind="cuda", index=-2)


def test_gpu_for_local_rank_without_gpus():
    with pytest.raises(mt.DeviceError, match=r"no CUDA GPU is visible to this rank"):
        gpu_for_local_rank(0, 0)


def test_launcher_variables_mpi_first_slurm_last():
    env = {"SLURM_LOCALID": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
    assert local_rank_from_env(env) == (1, "OMPI_COMM_WORLD_LOCAL_RANK")
    assert local_rank_from_env({"MPI_LOCALRANKID": "2", "SLURM_LOCALID": "0"}) == (2, "MPI_LOCALRANKID")
    assert local_rank_from_env({"SLURM_LOCALID": "3"}) == (3, "SLURM_LOCALID")
    assert local_rank_from_env({"OMPI_COMM_WORLD_LOCAL_RANK": "x"}) is None
    assert local_rank_from_env({}) is None


def test_empty_cuda_visible_devices_hides_every_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpu_count() == 0
    assert probe_gpus() == (0, "CUDA_VISIBLE_DEVICES is empty, which hides every GPU")


@pytest.mark.skipif(HAVE_CUPY, reason="CuPy is installed here")
def test_probe_without_cupy():
    assert probe_gpus() == (0, "CuPy is not installed")


@pytest.mark.skipif(HAVE_CUPY, reason="CuPy is installed here")
def test_tensor_to_cuda_without_cupy_says_how_to_install_it():
    with pytest.raises(mt.DeviceError, match=r"needs CuPy, which is not installed: pip install 'mpitensor\[cuda\]'"):
        mt.tensor([1.0, 2.0]).to("cuda")
    with pytest.raises(mt.DeviceError, match=r"needs CuPy, which is not installed"):
        mt.zeros(3, device="cuda:0")


@pytest.mark.skipif(not HAVE_CUPY or GPUS > 0, reason="needs CuPy installed on a machine without a GPU")
def test_tensor_to_cuda_with_cupy_but_no_gpu():
    assert NO_GPU_REASON is not None
    with pytest.raises(mt.DeviceError) as info:
        mt.tensor([1.0, 2.0]).to("cuda")
    expected = f"this rank was asked for device cuda:0, but it sees no CUDA GPU ({NO_GPU_REASON})"
    assert str(info.value).startswith(expected)


def test_import_does_not_import_cupy():
    import subprocess
    import sys

    code = "import sys, mpitensor; print('cupy' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "False"


# -- contexts on this machine -------------------------------------------------------------------


@needs_no_gpu
@pytest.mark.mpi
def test_init_uses_the_cpu_when_no_gpu_is_visible(ctx):
    assert [d.kind for d in ctx.devices] == ["cpu"] * ctx.size
    assert ctx.device == mt.Device("cpu", 0, ctx.devices[ctx.rank].rank)


@pytest.mark.mpi
def test_init_forced_cpu():
    with mt.DistributedContext.init(config=mt.DistributedConfig(device="cpu")) as ctx:
        assert ctx.device.kind == "cpu"
        assert all(d.kind == "cpu" for d in ctx.devices)


@needs_no_gpu
@pytest.mark.mpi
def test_init_forced_cuda_without_a_gpu_raises_a_clear_error():
    from mpitensor._core.mpi import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    with pytest.raises(mt.DeviceError) as info:
        mt.DistributedContext.init(config=mt.DistributedConfig(device="cuda"))
    message = str(info.value)
    assert message.startswith(f"rank {rank} was asked for a CUDA device, but ")
    assert ("CuPy is not installed" if not HAVE_CUPY else "sees no CUDA GPU") in message


@needs_no_gpu
@pytest.mark.mpi
def test_init_given_gpu_devices_this_machine_lacks():
    from mpitensor._core.mpi import MPI

    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    devices = [mt.Device("cuda", 0, r) for r in range(size)]
    with pytest.raises(mt.DeviceError, match=rf"^rank {rank} was asked for device cuda:0, but "):
        mt.DistributedContext.init(devices)
