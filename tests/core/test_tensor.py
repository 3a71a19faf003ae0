"""Tensor: factories, delegation to NumPy, interop, and moving between devices."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import mpitensor as mt


def test_factories_follow_numpy():
    assert mt.zeros((2, 3)).dtype == np.float64
    assert mt.ones(4, dtype=np.int8).numpy().tolist() == [1, 1, 1, 1]
    assert mt.full((2,), 7).numpy().tolist() == [7, 7]
    assert mt.arange(5).numpy().tolist() == [0, 1, 2, 3, 4]
    assert mt.arange(2, 8, 2, dtype=np.float32).numpy().tolist() == [2.0, 4.0, 6.0]
    assert mt.empty((0, 2)).shape == (0, 2)
    assert mt.tensor([[1, 2], [3, 4]]).shape == (2, 2)
    assert mt.tensor(3.5).ndim == 0 and mt.tensor(3.5).item() == 3.5
    assert mt.tensor([1, 2], dtype=np.complex64).dtype == np.complex64


def test_tensor_copies_and_from_numpy_shares():
    data = np.arange(3.0)
    copied, shared = mt.tensor(data), mt.from_numpy(data)
    data[0] = 9.0
    assert copied.numpy()[0] == 0.0 and shared.numpy()[0] == 9.0
    assert shared.numpy() is data
    with pytest.raises(TypeError, match=r"from_numpy expects a numpy\.ndarray, got list"):
        mt.from_numpy([1, 2])


def test_operators_and_reductions_delegate_and_return_tensors():
    a, b = mt.tensor([[1.0, 2.0], [3.0, 4.0]]), mt.tensor([[1.0, 0.0], [0.0, 1.0]])
    for result in (a + b, a - 1, 2 * a, a / 2, a @ b, -a, abs(a), a**2, a // 2, a % 2):
        assert isinstance(result, mt.Tensor)
    np.testing.assert_array_equal((a @ b).numpy(), a.numpy())
    assert (a > 2).numpy().tolist() == [[False, False], [True, True]]
    assert (a == a).numpy().all()
    assert a.sum().item() == 10.0 and a.mean().item() == 2.5
    assert a.max().item() == 4.0 and a.min().item() == 1.0 and a.prod().item() == 24.0
    np.testing.assert_array_equal(a.sum(axis=0).numpy(), [4.0, 6.0])
    assert a.reshape(4).shape == (4,) and a.T.numpy()[0, 1] == 3.0
    assert isinstance(np.exp(a), mt.Tensor)
    assert a.std().item() == pytest.approx(np.std(a.numpy()))
    assert float(a[1, 1]) == 4.0 and len(a) == 2 and [r.shape for r in a] == [(2,), (2,)]


def test_in_place_operators_and_item_assignment():
    a = mt.zeros(3)
    a += 1
    a[1] = 5.0
    a[mt.tensor([0, 2])] = mt.tensor([7.0, 8.0])
    assert a.numpy().tolist() == [7.0, 5.0, 8.0]


def test_zero_copy_interop():
    a = mt.arange(6, dtype=np.float32)
    assert np.asarray(a) is a.numpy()
    via_dlpack = np.from_dlpack(a)
    assert np.shares_memory(via_dlpack, a.numpy())
    assert a.__dlpack_device__() == (1, 0)
    assert not hasattr(a, "__cuda_array_interface__")


def test_to_the_same_device_is_the_same_tensor_and_cuda_needs_cupy_or_a_gpu():
    a = mt.ones(2)
    assert a.to("cpu") is a
    assert a.to(mt.Device("cpu")) is a
    assert a.cpu() is a
    with pytest.raises(mt.DeviceError, match=r"CuPy|no CUDA GPU|failed to import"):
        a.to("cuda:0").numpy()


@pytest.mark.mpi(min_size=1)
def test_to_another_ranks_device_is_rejected(ctx):
    with pytest.raises(mt.DeviceError, match=f"device cpu:0@rank12345 belongs to rank 12345; this is rank {ctx.rank}"):
        mt.ones(2).to(mt.Device("cpu", 0, 12345))
    assert mt.ones(2).device == ctx.device


def test_pickle_and_copy():
    a = mt.tensor([1, 2, 3])
    assert pickle.loads(pickle.dumps(a)).numpy().tolist() == [1, 2, 3]
    b = copy.deepcopy(a)
    b[0] = 9
    assert a.numpy()[0] == 1


def test_non_arrays_are_rejected():
    with pytest.raises(TypeError, match="Tensor wraps a NumPy or CuPy ndarray, got list"):
        mt.Tensor([1, 2])
