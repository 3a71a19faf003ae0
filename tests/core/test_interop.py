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


def _aligned(count: int, dtype: type, offset: int = 0) -> np.ndarray:
    """A writable array of `count` elements starting `offset` bytes past a 64-byte boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(count * itemsize + 128, np.uint8)
    start = (-raw.ctypes.data) % 64 + offset
    return raw[start : start + count * itemsize].view(dtype)


def test_jax_results_share_an_aligned_buffer_on_the_input_device():
    jax = pytest.importorskip("jax")
    source = jax.numpy.arange(4.0)
    buffer = _aligned(4, np.float32)
    buffer[:] = [1.0, 2.0, 3.0, 4.0]
    back = interop.take(source, CPU, "all_reduce").back(_result(buffer))
    assert isinstance(back, jax.Array) and back.dtype == np.float32
    assert back.devices() == source.devices()
    assert back.unsafe_buffer_pointer() == buffer.ctypes.data  # zero copy
    np.testing.assert_array_equal(np.asarray(back), [1.0, 2.0, 3.0, 4.0])


def test_jax_copies_what_it_cannot_take_and_the_values_stay():
    jax = pytest.importorskip("jax")
    back = interop.take(jax.numpy.arange(3.0), CPU, "all_reduce").back
    unaligned = _aligned(3, np.float32, offset=16)
    unaligned[:] = [5.0, 6.0, 7.0]
    in_flight = _aligned(3, np.float32)
    in_flight[:] = [1.0, 1.0, 1.0]
    in_flight.flags.writeable = False  # a result in flight (assume_resolved): JAX must not see it change
    strided = np.arange(6, dtype=np.float32)[::2]
    for array in (unaligned, in_flight, strided):
        expected = array.copy()
        result = back(_result(array))
        assert result.unsafe_buffer_pointer() != array.ctypes.data
        assert result.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(result), expected)


def test_jax_results_keep_their_dtype_rules():
    jax = pytest.importorskip("jax")
    ml_dtypes = pytest.importorskip("ml_dtypes")
    back = interop.take(jax.numpy.ones(2, jax.numpy.bfloat16), CPU, "all_reduce").back
    halves = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    got = back(_result(halves))
    assert got.dtype == jax.numpy.bfloat16 and np.asarray(got).tolist() == [1.5, -2.0]
    flags = back(_result(_aligned(2, np.bool_)))
    assert flags.dtype == np.bool_
    # Without x64, JAX keeps no float64: a MEAN of int32 comes back as JAX's float, as device_put gives it.
    wide = back(_result(np.array([0.5, 1.5])))
    assert wide.dtype == jax.dtypes.canonicalize_dtype(np.float64)
    np.testing.assert_array_equal(np.asarray(wide), [0.5, 1.5])


def test_jax_results_hold_the_pooled_buffer_while_they_live():
    jax = pytest.importorskip("jax")
    pool = HostPool(min_bytes=0)
    kept = [pool.empty((1024,), np.dtype(np.float32)) for _ in range(8)]
    buffer = kept[3]
    assert buffer.ctypes.data % 64 == 0  # every block is, so JAX takes it without a copy
    buffer[:] = 7.0
    address = buffer.ctypes.data
    del kept
    result = interop.take(jax.numpy.ones(1024), CPU, "all_reduce").back(_result(buffer))
    assert result.unsafe_buffer_pointer() == address
    del buffer
    gc.collect()
    assert pool.cached_bytes == 7 * 4096  # the other blocks came back; the JAX array holds its own
    again = [pool.empty((1024,), np.dtype(np.float32)) for _ in range(8)]
    for block in again:
        block.fill(0.0)
    assert address not in [a.ctypes.data for a in again]
    assert bool((result == 7.0).all())
    del result, again, block
    gc.collect()
    assert pool.cached_bytes == 9 * 4096  # only now is its block back in the pool


def test_small_concrete_jax_arrays_take_the_quick_way_and_tracers_do_not():
    jax = pytest.importorskip("jax")
    small = jax.numpy.arange(4, dtype=jax.numpy.int32)
    array, back = interop.take_quickly(small, 64)
    assert array.ctypes.data == small.unsafe_buffer_pointer()  # a view; the lanes copy it at the call
    assert isinstance(back(_result(np.arange(4, dtype=np.int32) * 2)), jax.Array)
    assert interop.take_quickly(jax.numpy.ones(32), 64) is None  # 128 bytes: the general path's
    seen = []
    jax.jit(lambda x: seen.append(interop.take_quickly(x, 64)) or x)(small)
    assert seen == [None]


@pytest.mark.parametrize("transform", ["jit", "grad", "vmap", "jvp"])
def test_jax_tracers_are_refused_with_a_pointer_to_mpitensor_jax(transform):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy

    def take(x):
        interop.take(x, CPU, "all_reduce")
        return x.sum()

    run = {
        "jit": lambda: jax.jit(take)(jnp.ones(3)),
        "grad": lambda: jax.grad(take)(jnp.ones(3)),
        "vmap": lambda: jax.vmap(take)(jnp.ones((2, 3))),
        "jvp": lambda: jax.jvp(take, (jnp.ones(3),), (jnp.ones(3),)),
    }[transform]
    with pytest.raises(mt.TracedArrayError, match=r"all_reduce got a traced JAX value \(\w+Tracer\)") as raised:
        run()
    assert isinstance(raised.value, TypeError) and isinstance(raised.value, mt.MpitensorError)
    assert "use mpitensor.jax's collectives inside jax.jit/grad/vmap" in str(raised.value)


def test_arrays_of_an_array_api_library_come_back_through_its_from_dlpack():
    class Array:
        def __init__(self, array):
            self.array = array

        def __dlpack__(self, **kwargs):
            return self.array.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.array.__dlpack_device__()

        def __array_namespace__(self, api_version=None):
            return namespace

    class Namespace:
        @staticmethod
        def from_dlpack(value):
            return Array(np.from_dlpack(value))

    namespace = Namespace()
    back = interop.take(Array(np.arange(3.0)), CPU, "all_reduce").back
    result = np.arange(3.0) * 2
    got = back(_result(result))
    assert type(got) is Array and np.shares_memory(got.array, result)  # zero copy
    in_flight = np.ones(2)
    in_flight.flags.writeable = False  # NumPy's DLPack export refuses read-only arrays: a copy
    copied = back(_result(in_flight))
    assert type(copied) is Array and not np.shares_memory(copied.array, in_flight)
    assert copied.array.tolist() == [1.0, 1.0] and back(None) is None
