"""Tensors of other libraries in, results in the same library out.

A collective takes torch tensors (parameters and tensors that require grad included: their
data is sent), JAX arrays, anything with ``__dlpack__``, ``__array_interface__`` or
``__cuda_array_interface__``, NumPy scalars and Python numbers. `take` turns such a value
into the NumPy or CuPy array to communicate and a *converter back*, which turns the
collective's result into the input's kind: a torch tensor on the input's device (bfloat16
included), a JAX array, a Python number (a list for a gathered vector), a NumPy scalar.
NumPy arrays, CuPy arrays and `Tensor`s never come here.

Zero copy where it is safe. A torch tensor's memory cannot be made read-only, so a CPU
tensor of `COW_BYTES` or more is sent through a copy-on-write clone (torch's lazy clone):
no copy while nobody writes, and a write to the tensor while the collective reads it gives
the tensor fresh memory (torch copies then) and leaves the data in flight as it was.
Smaller, non-contiguous tensors and tensors over NumPy memory (``torch.from_numpy``),
which torch cannot clone lazily, are copied at the call, as other foreign memory is
(`protect.foreign`). CUDA tensors are copied on the device. JAX arrays are immutable and
are read in place; a JAX tracer (a value inside ``jax.jit``, ``grad``, ``vmap``...) has no
data to read and is refused (`TracedArrayError`). A host result goes back to JAX without a
copy where JAX can take the buffer (through DLPack: C-contiguous, 64-byte aligned, a dtype
DLPack carries and JAX keeps): the JAX array then holds the buffer, and with it the pool's
lease, so the buffer is not reused while the array lives. An unaligned or strided buffer is
copied by JAX, and a result still in flight is copied first. torch and JAX are imported only
once a value of theirs is seen.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from .device import Device
from .errors import DeviceError, TracedArrayError
from .halfprec import bfloat16_dtype, is_bfloat16
from .jax_placement import Placement, placement
from .limits import COW_BYTES
from .pool import Private

__all__ = [
    "COW_BYTES",
    "Taken",
    "describe",
    "numpy_dtype",
    "structure_back",
    "take",
    "take_quickly",
    "to_array",
    "type_name",
]


Back = Callable[[Any], Any]


class Taken(NamedTuple):
    """A foreign value made ready to communicate.

    Attributes:
        array: the NumPy or CuPy array to send.
        back: turns a result (a `Tensor`, None, ...) into the input's kind; None keeps it.
        private: True when nobody can write `array` while it is sent (needs no protection).
    """

    array: Any
    back: Back | None
    private: bool


def _library(value: Any) -> str:
    """The top-level module of `value`'s type (``"torch"``, ``"jaxlib"``, ...)."""
    return type(value).__module__.partition(".")[0]


def _is_torch(value: Any) -> bool:
    if _library(value) != "torch":
        return False
    import torch

    return isinstance(value, torch.Tensor)


def _is_jax(value: Any) -> bool:
    if _library(value) not in ("jax", "jaxlib"):
        return False
    import jax

    return isinstance(value, jax.Array)


def type_name(value: Any) -> str:
    """How messages name `value`'s type: ``torch.Tensor on cuda:1``, ``jax.Array``, ``numpy.float64``."""
    if _is_torch(value):
        import torch

        name = "torch.nn.Parameter" if isinstance(value, torch.nn.Parameter) else "torch.Tensor"
        return f"{name} on {value.device}"
    if _is_jax(value):
        return "jax.Array"
    kind = type(value)
    module = kind.__module__
    if module == "builtins":
        return kind.__qualname__
    return f"{module.partition('.')[0]}.{kind.__qualname__}"


# -- dtypes ---------------------------------------------------------------------------------


def numpy_dtype(dtype: Any) -> np.dtype:
    """`dtype` as a NumPy dtype: NumPy and JAX dtypes, names, and torch dtypes.

    Raises:
        TypeError: a torch dtype NumPy has no equal of, or not a dtype at all.
    """
    if isinstance(dtype, np.dtype):
        return dtype
    if _library(dtype) == "torch":
        return _from_torch_dtype(dtype)
    return np.dtype(dtype)


def _from_torch_dtype(dtype: Any) -> np.dtype:
    name = str(dtype).removeprefix("torch.")
    if name == "bfloat16":
        found = bfloat16_dtype()
        if found is None:
            raise TypeError("torch.bfloat16 needs the ml_dtypes package: pip install 'mpitensor[bf16]'")
        return found
    try:
        return np.dtype(name)
    except TypeError:
        raise TypeError(f"dtype {dtype} cannot be communicated: it has no NumPy equivalent") from None


# -- values in ------------------------------------------------------------------------------


def take(value: Any, device: Device, what: str, argument: str = "input") -> Taken:
    """The array to communicate for a foreign `value`, and how to give the result back.

    Args:
        value: a torch tensor, JAX array, DLPack or array-interface object, NumPy scalar
            or Python number.
        device: this rank's device (a CUDA tensor must be on it).
        what: the calling collective, for messages.
        argument: the argument's name, for messages.

    Raises:
        TypeError: a value of no kind mpitensor can read.
        DeviceError: a GPU tensor on a device other than this rank's.
    """
    kind = type(value)
    if kind is int:
        return Taken(python_int_array(value, what), _python_back, True)
    if kind in (float, bool, complex):
        return Taken(np.asarray(value), _python_back, True)
    if isinstance(value, np.generic):
        return Taken(np.asarray(value), _numpy_scalar_back, True)
    if _is_torch(value):
        return _take_torch(value, device, what)
    if _is_jax(value):
        return _take_jax(value, device, what)
    return Taken(to_array(value, device, what, argument), _namespace_back_of(value), False)


_INT64 = 1 << 63
_QUICK_INT = 1 << 31  # no sum of fewer than 2**32 ranks of such ints leaves int64


def python_int_array(value: int, what: str) -> np.ndarray:
    """A Python int as the 0-d int64 array it travels as.

    Raises:
        OverflowError: `value` is outside int64's range (NumPy would make it uint64, or an
            object array, which no peer's int64 would match).
    """
    if not -_INT64 <= value < _INT64:
        raise OverflowError(
            f"{what}: the Python int {value} is outside int64's range [-2**63, 2**63); Python ints travel "
            "as int64: pass a NumPy array of another dtype (np.uint64, np.float64), or use the object "
            "collectives (all_gather_object) for arbitrary precision"
        )
    return np.asarray(value, np.int64)


def refuse_int_overflow(value: int, op_name: str, size: int, what: str) -> None:
    """Refuse a SUM, MEAN or PROD of Python ints whose result could leave int64's range.

    The bound is this rank's own value: with every rank's magnitude at most ``|value|``, a
    sum of `size` of them stays within ``size * |value|`` and a product within
    ``|value| ** size``. A rank whose value passes cannot overflow the result alone, and
    one whose value fails raises, so no result wraps silently.

    Args:
        value: this rank's Python int.
        op_name: the reduction's name (``"SUM"``, ...); others are not checked.
        size: the group's size.
        what: the collective's name, for messages.

    Raises:
        OverflowError: the result could leave int64's range.
    """
    magnitude = abs(value)
    if op_name in ("SUM", "MEAN"):
        bound = magnitude * size
    elif op_name == "PROD":
        bound = magnitude ** size if magnitude > 1 else magnitude
    else:
        return
    if bound >= _INT64:
        raise OverflowError(
            f"{what}: a {op_name} over {size} ranks of Python ints of magnitude up to {magnitude} can leave "
            f"int64's range (this rank passed {value}); Python ints travel as int64: pass np.float64 values, "
            "or gather them (all_gather_object) and reduce them in Python for arbitrary precision"
        )


def take_quickly(value: Any, max_bytes: int) -> tuple[np.ndarray, Back] | None:
    """The array and converter back of a small input of a common foreign kind, or None.

    For the lanes of repeated small calls (``_collectives/lane.py``): a Python number, a
    NumPy scalar, a torch tensor of exactly ``torch.Tensor``'s type on the CPU, of at
    most `max_bytes`, whose memory NumPy can view (dense, no conjugate or negative bit, not
    requiring grad, of a dtype NumPy has), or a concrete JAX array on one CPU device of at
    most `max_bytes` (tracers are of other types). The array and converter are those `take` gives
    such a value; the array may be a view of the tensor's memory, which the lanes copy at
    the call. None for every other value, which `take` handles with its checks and messages
    (a larger torch tensor is not even viewed: `take` sends it through a lazy clone, which
    a mutable access such as ``numpy()`` would make torch copy).
    """
    kind = type(value)
    # Larger ints go to `take`, and their sums to `all_reduce`'s check of int64's range.
    if kind is float or (kind is int and -_QUICK_INT <= value < _QUICK_INT):
        return np.asarray(value), _python_back
    if kind.__module__ == "torch" and kind.__name__ == "Tensor":
        if not value.is_cpu or value.nbytes > max_bytes:
            return None
        try:
            # numpy() refuses what a plain view cannot show (grad, layout, bits, dtype).
            return value.numpy(), _torch_cpu_back
        except (TypeError, RuntimeError):
            return None
    if isinstance(value, np.generic):
        return np.asarray(value), _numpy_scalar_back
    if kind.__name__ == "ArrayImpl" and kind.__module__.startswith("jaxlib"):  # a concrete JAX array
        return _jax_quickly(value, max_bytes)
    return None


def to_array(value: Any, device: Device | None, what: str, argument: str = "input") -> Any:
    """`value` as a NumPy or CuPy array sharing its memory where the library allows.

    Raises:
        TypeError: `value` exposes no array data.
        DeviceError: a GPU array on another device than this rank's.
    """
    if _is_jax(value):
        refuse_tracer(value, what)
    if _is_torch(value):
        value = value.detach().resolve_conj().resolve_neg()
        if value.device.type == "cuda":
            return _from_cuda(value, device, what, "torch.Tensor")
        _check_torch_cpu(value, what)
        return _torch_numpy(value)
    if hasattr(value, "__cuda_array_interface__"):
        return _from_cuda(value, device, what, type_name(value))
    if hasattr(value, "__array_interface__") or isinstance(value, (np.generic, int, float, complex)):
        return np.asarray(value)
    if hasattr(value, "__dlpack__") and hasattr(value, "__dlpack_device__"):
        device_type = value.__dlpack_device__()[0]
        if device_type == 1:  # kDLCPU
            return np.from_dlpack(value)
        if device_type == 2:  # kDLCUDA
            return _from_cuda(value, device, what, type_name(value))
    raise TypeError(
        f"{what} expects {argument} to be a mpitensor.Tensor, an array (NumPy, CuPy, torch, JAX, or "
        f"any object with __dlpack__ or __array_interface__) or a number, got {type_name(value)}"
    )


def _check_torch_cpu(tensor: Any, what: str) -> None:
    if tensor.device.type != "cpu":
        raise DeviceError(
            f"{what} got torch.Tensor on {tensor.device}: mpitensor carries CPU and CUDA tensors; "
            "move it with tensor.cpu()"
        )
    import torch

    if tensor.layout != torch.strided:
        raise TypeError(f"{what} got a torch tensor of layout {tensor.layout}; use a dense (strided) tensor")


def _torch_numpy(tensor: Any) -> np.ndarray:
    """A NumPy view of a CPU torch tensor (bfloat16 viewed through its 16-bit words)."""
    import torch

    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(numpy_dtype(tensor.dtype))
    return tensor.numpy()


def _from_cuda(value: Any, device: Device | None, what: str, name: str) -> Any:
    """A CuPy view of a CUDA array of another library, checked to be on this rank's GPU."""
    index = _cuda_index(value)
    if device is not None and (device.kind != "cuda" or device.index != index):
        raise DeviceError(
            f"{what} got {name} on cuda:{index}, but this rank's device is {device}; "
            f"move it to {device} first"
        )
    from .backend import require_cupy

    cupy = require_cupy()
    if hasattr(value, "__dlpack__"):
        return cupy.from_dlpack(value)
    return cupy.asarray(value)


def _cuda_index(value: Any) -> int:
    if hasattr(value, "__dlpack_device__"):
        return int(value.__dlpack_device__()[1])
    return int(getattr(value, "device", None).id)


def _take_torch(tensor: Any, device: Device, what: str) -> Taken:
    import torch

    data = tensor.detach().resolve_conj().resolve_neg()
    back = functools.partial(_torch_back, data.device, data.dtype)
    if data.device.type == "cuda":
        if data.dtype == torch.bfloat16:
            raise TypeError(f"{what}: bfloat16 CUDA tensors are not supported (CuPy has no bfloat16); use .float()")
        # torch can write the tensor on its own stream at any time: send a device copy.
        return Taken(_from_cuda(data, device, what, type_name(tensor)).copy(), back, True)
    _check_torch_cpu(data, what)
    if data.is_contiguous() and data.numel() * data.element_size() >= COW_BYTES:
        clone = _lazy_clone(data)
        if clone is not None:
            return Taken(_view_of_clone(clone, data), back, True)
    # A view: the collective copies it at the call (memory torch owns, see `protect.foreign`).
    return Taken(_torch_numpy(data), back, False)


def _lazy_clone(tensor: Any) -> Any:
    """A copy-on-write clone of `tensor`, or None where this torch cannot make one."""
    import torch

    clone = getattr(torch, "_lazy_clone", None)
    if clone is None:
        return None
    try:
        return clone(tensor)
    except RuntimeError:  # memory torch does not own (torch.from_numpy) cannot be shared lazily
        return None


def _view_of_clone(clone: Any, tensor: Any) -> np.ndarray:
    """A read-only NumPy view of a lazy clone's memory, keeping the clone alive.

    Built from ``const_data_ptr()``: a mutable access (``data_ptr()``, ``numpy()``) would
    make torch copy the memory at once.
    """
    nbytes = tensor.numel() * tensor.element_size()
    block = (ctypes.c_char * nbytes).from_address(clone.const_data_ptr())
    block.clone = clone  # the clone, and with it the shared memory, lives as long as the view
    # Over a `Private` array (made straight on the block, so NumPy keeps it as the base, as
    # the pool does with its leases): the collective protects it instead of copying it.
    private = np.ndarray.__new__(Private, tuple(tensor.shape), numpy_dtype(tensor.dtype), block)
    array = private.view(np.ndarray)
    array.flags.writeable = False
    return array


def _take_jax(array: Any, device: Device, what: str) -> Taken:
    refuse_tracer(array, what)
    where = _jax_device(array, what)
    back = _jax_back_to(where)
    if where.platform == "gpu":
        # JAX arrays are immutable: read in place.
        return Taken(_from_cuda(array, device, what, "jax.Array"), back, True)
    return Taken(np.asarray(array), back, True)


def _jax_quickly(array: Any, max_bytes: int) -> tuple[np.ndarray, Back] | None:
    """`take_quickly` of a concrete JAX array: a small one on one CPU device, else None."""
    sharding = array.sharding
    back = _quick_backs.get(sharding)
    if back is None:
        if len(_quick_backs) >= _MAX_QUICK_SHARDINGS:
            _quick_backs.clear()
        back = _quick_backs[sharding] = _quick_back(sharding)
    if back is False:
        return None
    host = np.asarray(array)  # a view of the array's buffer (NumPy's nbytes costs less than JAX's)
    return None if host.nbytes > max_bytes else (host, back)


# The converter back of the arrays of each sharding met by `_jax_quickly` (False: not one CPU
# device): a lookup by sharding costs half of asking the array for its devices each call.
_quick_backs: dict[Any, Back | bool] = {}
_MAX_QUICK_SHARDINGS = 64


def _quick_back(sharding: Any) -> Back | bool:
    """The converter back of arrays of `sharding` if it is one CPU device, else False."""
    devices = sharding.device_set
    if len(devices) != 1:  # sharded over several devices: the general path says what to do
        return False
    (where,) = devices
    return _jax_back_to(where) if where.platform == "cpu" else False


def refuse_tracer(value: Any, what: str) -> None:
    """Refuse a JAX tracer, which has no data to communicate.

    Raises:
        TracedArrayError: `value` is a tracer (inside ``jax.jit``, ``grad``, ``vmap``...).
    """
    import jax

    if isinstance(value, jax.core.Tracer):
        raise TracedArrayError(
            f"{what} got a traced JAX value ({type(value).__name__}): it is called inside jax.jit, jax.grad, "
            "jax.vmap or another JAX transformation, where arrays have no data yet, and mpitensor's eager "
            "collectives send data when called; use mpitensor.jax's collectives inside jax.jit/grad/vmap, "
            "or call this one outside the transformation on concrete arrays"
        )


def _jax_device(array: Any, what: str) -> Any:
    """The one JAX device `array` is on.

    Raises:
        TypeError: the array is sharded over several devices.
    """
    devices = array.devices()
    if len(devices) != 1:
        raise TypeError(
            f"{what} got a jax.Array sharded over {len(devices)} devices; mpitensor communicates one "
            "device's array per rank: pass a single-device array (a shard's data, or "
            "jax.device_put(array, device))"
        )
    (where,) = devices
    return where


# -- results out ----------------------------------------------------------------------------


def _namespace_back_of(value: Any) -> Back | None:
    """The converter back of an array of an Array API library, through its ``from_dlpack``.

    Any other object that only speaks DLPack or an array interface has no library to go
    back to: its result stays a `Tensor` (which speaks both), and None is returned.
    """
    get_namespace = getattr(value, "__array_namespace__", None)
    convert = getattr(get_namespace(), "from_dlpack", None) if callable(get_namespace) else None
    return None if convert is None else functools.partial(_namespace_back, convert)


def _namespace_back(convert: Back, result: Any) -> Any:
    """`result` (a `Tensor`; None stays None) in the input's library, sharing its memory."""
    if result is None:
        return None
    array = result.array
    # A host result in flight is read-only, which DLPack (as NumPy exports it) cannot say: a copy.
    return convert(array if getattr(array.flags, "writeable", True) else array.copy())


def _python_back(result: Any) -> Any:
    return None if result is None else result.array.tolist()


def _numpy_scalar_back(result: Any) -> Any:
    if result is None or result.ndim:
        return result
    return result.array[()]


def _torch_back(device: Any, dtype: Any, result: Any) -> Any:
    """`result` (a `Tensor`) as a torch tensor on `device`, sharing its memory."""
    if result is None or device.type != "cuda":
        return _torch_cpu_back(result)
    import torch

    return torch.from_dlpack(result.array)


def _torch_cpu_back(result: Any) -> Any:
    """`result` (a host `Tensor`) as a CPU torch tensor sharing its memory; None stays None."""
    if result is None:
        return None
    import torch

    array = result.array
    if is_bfloat16(array.dtype):
        return _from_numpy(torch, array.view(np.int16)).view(torch.bfloat16)
    return _from_numpy(torch, array)


def _from_numpy(torch: Any, array: np.ndarray) -> Any:
    # The tensor holds the array, and through it the pool's lease: the buffer is not
    # reused while the tensor (or any view of it) lives.
    if array.flags.writeable:
        return torch.from_numpy(array)
    import warnings

    with warnings.catch_warnings():  # a result still in flight (assume_resolved) is read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


@functools.lru_cache(maxsize=64)
def _jax_back_to(device: Any) -> Back:
    """The converter back of JAX arrays on `device` (one per device, made once)."""
    return functools.partial(_jax_back, device, placement(device) if device.platform == "cpu" else None)


def _jax_back(device: Any, place: Placement | None, result: Any) -> Any:
    """`result` (a `Tensor`; None stays None) as a JAX array on `device`, sharing its memory where JAX can."""
    if result is None:
        return None
    array = result.array
    if isinstance(array, np.ndarray):
        if not array.flags.writeable:  # a result still in flight (assume_resolved): no JAX array may see it change
            array = array.copy()
        if array.flags.c_contiguous and _jax_keeps(array.dtype):
            if place is not None:
                try:
                    return place(array)
                except (TypeError, ValueError, RuntimeError):
                    pass  # jaxlib's entry changed: the DLPack import says the same, a little slower
            imported = _jax_import(array, device)
            if imported is not None:
                return imported
    import jax

    if not isinstance(array, np.ndarray):
        return jax.numpy.from_dlpack(array)
    # Where JAX can, this too takes an aligned buffer without a copy (at 35 us more per call).
    return jax.device_put(array, device)


@functools.lru_cache(maxsize=64)
def _jax_keeps(dtype: np.dtype) -> bool:
    """Whether JAX takes `dtype` through DLPack as it is (not bfloat16; float64 only with x64)."""
    import jax

    return dtype.kind in "biufc" and np.dtype(jax.dtypes.canonicalize_dtype(dtype)) == dtype


def _jax_import(array: np.ndarray, device: Any) -> Any:
    """`array` as a JAX array on the CPU `device` through DLPack (JAX copies it if unaligned); None if it cannot."""
    importer = _dlpack_importer()
    if importer is not None:
        try:
            return importer(array.__dlpack__(), device)
        except (TypeError, ValueError, RuntimeError, BufferError):
            pass  # jaxlib's entry changed: the public one says the same, more slowly
    import jax

    try:
        return jax.dlpack.from_dlpack(array, device=device)
    except (TypeError, ValueError, RuntimeError, BufferError):
        return None


@functools.cache
def _dlpack_importer() -> Callable[[Any, Any], Any] | None:
    """The DLPack import of jaxlib that ``jax.dlpack.from_dlpack`` calls; None where it is not found.

    ``from_dlpack`` itself costs 15-20 us of Python around a 3 us import at 8 bytes (looking
    up the backend and stream, then ``jnp.asarray`` and a placement); an all-reduce of 8
    bytes costs 1-3 us. Its arguments are those ``from_dlpack`` passes for a CPU buffer:
    no stream, ``copy=None`` (a copy only where the buffer is not aligned), kDLCPU.
    """
    try:
        from jax._src.lib import _jax, jaxlib_extension_version
    except ImportError:
        return None
    convert = getattr(_jax, "dlpack_managed_tensor_to_buffer", None)
    if convert is None:
        return None
    if jaxlib_extension_version >= 467:
        return lambda capsule, device: convert(capsule, device, None, None, 1)
    return lambda capsule, device: convert(capsule, device, None, None)


def structure_back(keys: list[Any], backs: list[Back | None], container: type) -> Back | None:
    """A converter back for a list, tuple or dict of results; None if no leaf needs one."""
    if all(back is None for back in backs):
        return None

    def back(result: Any) -> Any:
        values = result.values() if isinstance(result, dict) else result
        converted = [value if fn is None else fn(value) for fn, value in zip(backs, values)]
        if container is dict:
            return dict(zip(keys, converted))
        return container(converted)

    return back


def describe(value: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    """The shape and NumPy dtype of a tensor or array of any library, without reading its data.

    Returns:
        None for a value that is not a tensor or array.
    """
    if _is_torch(value):
        return tuple(value.shape), numpy_dtype(value.dtype)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        try:
            return tuple(int(d) for d in value.shape), numpy_dtype(value.dtype)
        except TypeError:
            return None
    return None
