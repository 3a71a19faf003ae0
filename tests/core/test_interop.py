"""Reading tensors of other libraries and giving results back in them (no MPI)."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core import interop
from mpitensor._core.device import Device
from mpitensor._core.pool import HostPool
from mpitensor._core.protect import foreign
from mpitensor._core.tensor import wrap_array

CPU = Device("cpu", 0, 0)


def _result(array: np.ndarray) -> mt.Tensor:
    return wrap_array(array, CPU)


def test_python_numbers_come_back_as_python_numbers():
    for value, kind in ((0.25, float), (3, int), (True, bool), (1 + 2j, complex)):
        taken = interop.take(value, CPU, "all_reduce")
        assert taken.array.shape == () and taken.private
        back = taken.back(_result(np.asarray(value)))
        assert type(back) is kind and back == value
    gathered = interop.take(0.5, CPU, "all_gather").back(_result(np.array([0.5, 1.5])))
    assert gathered == [0.5, 1.5]


def test_numpy_scalars_come_back_as_numpy_scalars():
    taken = interop.take(np.float32(2.5), CPU, "all_reduce")
    back = taken.back(_result(np.asarray(np.float32(5.0))))
    assert type(back) is np.float32 and back == 5.0


def test_dtypes_of_every_library_become_numpy_dtypes():
    torch = pytest.importorskip("torch")
    assert interop.numpy_dtype(torch.float32) == np.float32
    assert interop.numpy_dtype(torch.int64) == np.int64
    assert interop.numpy_dtype(torch.bool) == np.bool_
    assert interop.numpy_dtype(torch.complex64) == np.complex64
    assert interop.numpy_dtype(torch.bfloat16).name == "bfloat16"
    assert interop.numpy_dtype("float16") == np.float16
    with pytest.raises(TypeError, match=r"torch\.quint8 cannot be communicated"):
        interop.numpy_dtype(torch.quint8)
    jnp = pytest.importorskip("jax.numpy")
    assert interop.numpy_dtype(jnp.float32) == np.float32
    assert interop.numpy_dtype(jnp.bfloat16).name == "bfloat16"


def test_type_names_say_the_library():
    torch = pytest.importorskip("torch")
    assert interop.type_name(torch.ones(2)) == "torch.Tensor on cpu"
    assert interop.type_name(torch.nn.Parameter(torch.ones(2))) == "torch.nn.Parameter on cpu"
    assert interop.type_name(np.float64(1)) == "numpy.float64"
    assert interop.type_name(object()) == "object"
    jnp = pytest.importorskip("jax.numpy")
    assert interop.type_name(jnp.ones(2)) == "jax.Array"


def test_small_torch_tensors_are_views_the_collective_copies():
    torch = pytest.importorskip("torch")
    tensor = torch.arange(8, dtype=torch.float32)
    taken = interop.take(tensor, CPU, "all_reduce")
    assert not taken.private and foreign(taken.array)  # protect.foreign: copied at the call
    np.testing.assert_array_equal(taken.array, np.arange(8, dtype=np.float32))


def test_large_torch_tensors_are_sent_through_a_copy_on_write_clone():
    torch = pytest.importorskip("torch")
    tensor = torch.ones(interop.COW_BYTES // 4)
    taken = interop.take(tensor, CPU, "all_reduce")
    assert taken.private and not taken.array.flags.writeable
    assert not foreign(taken.array)  # protected in flight, not copied
    assert taken.array.ctypes.data == tensor.const_data_ptr()  # no copy
    tensor.add_(1)  # a write in flight: the tensor gets fresh memory, the data sent is unchanged
    assert float(tensor[0]) == 2.0
    assert np.all(taken.array == 1.0)


def test_torch_over_numpy_memory_is_copied_at_the_call():
    torch = pytest.importorskip("torch")
    tensor = torch.from_numpy(np.ones(interop.COW_BYTES // 4, np.float32))
    taken = interop.take(tensor, CPU, "all_reduce")
    assert not taken.private and foreign(taken.array)


def test_tensors_that_require_grad_and_parameters_give_their_data():
    torch = pytest.importorskip("torch")
    for value in (torch.ones(3, requires_grad=True), torch.nn.Parameter(torch.full((3,), 2.0))):
        taken = interop.take(value, CPU, "all_reduce")
        np.testing.assert_array_equal(taken.array, value.detach().numpy())
        back = taken.back(_result(np.asarray(taken.array) * 2))
        assert isinstance(back, torch.Tensor) and not back.requires_grad


def test_bfloat16_torch_tensors_travel_as_bfloat16_and_come_back():
    torch = pytest.importorskip("torch")
    tensor = torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)
    taken = interop.take(tensor, CPU, "all_reduce")
    assert taken.array.dtype.name == "bfloat16"
    back = taken.back(_result(np.asarray(taken.array).copy()))
    assert back.dtype == torch.bfloat16 and torch.equal(back, tensor)


def test_torch_results_share_the_pooled_buffer_and_keep_it():
    torch = pytest.importorskip("torch")
    pool = HostPool(min_bytes=0)
    buffer = pool.empty((1024,), np.dtype(np.float32))
    buffer[:] = 7.0
    back = interop.take(torch.ones(1024), CPU, "all_reduce").back
    result = back(_result(buffer))
    assert result.data_ptr() == buffer.ctypes.data  # zero copy
    del buffer
    gc.collect()
    assert pool.cached_bytes == 0  # the torch tensor still holds the block
    again = pool.empty((1024,), np.dtype(np.float32))
    again[:] = 0.0
    assert torch.all(result == 7.0)
    del result
    gc.collect()
    assert pool.cached_bytes > 0  # only now is the block back in the pool


def test_jax_arrays_are_read_in_place_and_come_back_as_jax():
    jax = pytest.importorskip("jax")
    array = jax.numpy.arange(4.0)
    taken = interop.take(array, CPU, "all_reduce")
    assert taken.private
    back = taken.back(_result(np.asarray(taken.array) * 2))
    assert isinstance(back, jax.Array)
    np.testing.assert_array_equal(np.asarray(back), [0.0, 2.0, 4.0, 6.0])


def test_dlpack_and_array_interface_objects_are_read():
    class Interface:
        def __init__(self, array):
            self.__array_interface__ = array.__array_interface__
            self.keep = array

    array = np.arange(3.0)
    assert np.shares_memory(interop.to_array(Interface(array), CPU, "all_reduce"), array)
    torch = pytest.importorskip("torch")

    class Capsule:  # only the DLPack protocol
        def __init__(self, tensor):
            self.tensor = tensor

        def __dlpack__(self, **kwargs):
            return self.tensor.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.tensor.__dlpack_device__()

    taken = interop.take(Capsule(torch.arange(3.0)), CPU, "all_reduce")
    assert taken.back is None
    np.testing.assert_array_equal(taken.array, [0.0, 1.0, 2.0])


def test_unknown_values_are_named_in_the_error():
    with pytest.raises(TypeError, match=r"all_reduce expects input to be .* got object"):
        interop.take(object(), CPU, "all_reduce")


def test_cuda_tensors_on_a_cpu_rank_are_refused_with_their_device():
    torch = pytest.importorskip("torch")
    meta = torch.ones(2, device="meta")
    with pytest.raises(mt.DeviceError, match=r"got torch.Tensor on meta.*tensor.cpu\(\)"):
        interop.take(meta, CPU, "all_reduce")


def test_describe_reads_shapes_and_dtypes_of_any_library():
    torch = pytest.importorskip("torch")
    assert interop.describe(torch.nn.Parameter(torch.ones(2, 3))) == ((2, 3), np.dtype(np.float32))
    assert interop.describe(np.ones(2, np.int8)) == ((2,), np.dtype(np.int8))
    assert interop.describe("abc") is None


def test_structures_come_back_with_each_leaf_in_its_kind():
    back = interop.structure_back(["a", "b"], [interop.take(1.0, CPU, "x").back, None], dict)
    plain = _result(np.ones(2))
    result = back({"a": _result(np.asarray(2.0)), "b": plain})
    assert result == {"a": 2.0, "b": plain}
    assert interop.structure_back([0, 1], [None, None], list) is None


def test_factories_take_foreign_data_and_dtypes():
    torch = pytest.importorskip("torch")
    jnp = pytest.importorskip("jax.numpy")
    source = torch.arange(3.0)
    shared = mt.as_tensor(source)
    source.add_(1)
    np.testing.assert_array_equal(shared.numpy(), [1.0, 2.0, 3.0])  # shares memory
    assert mt.tensor(jnp.ones(2)).dtype == np.float32
    assert mt.tensor(torch.ones(2, dtype=torch.bfloat16)).dtype.name == "bfloat16"
    assert mt.zeros(2, dtype=torch.float16).dtype == np.float16
    assert mt.ones(2, dtype=jnp.int32).dtype == np.int32
    assert mt.arange(3, dtype=torch.int64).dtype == np.int64
    assert mt.tensor([1, 2], dtype=torch.float32).dtype == np.float32
    with pytest.raises(TypeError, match=r"as_tensor expects data to be .* got object"):
        mt.as_tensor(object())
