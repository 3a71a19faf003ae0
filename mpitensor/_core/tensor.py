"""`Tensor`: a device-aware array, backed by NumPy on CPU devices and CuPy on GPUs.

A `Tensor` delegates to its array: operators, reductions, indexing and any array method
(``t.reshape(...)``, ``t.clip(...)``) run on the array and come back as tensors. It adds
the device it lives on, `to(device)`, and protection while a collective uses it: writing a
tensor that a collective in flight reads or writes raises `TensorInFlightError`.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from . import state as _state
from .backend import array_module, is_cupy_array, is_supported_array, require_cuda_device, require_cupy
from .device import Device
from .errors import DeviceError, TensorInFlightError
from .interop import numpy_dtype, to_array
from .mpi import world_rank
from .records import TensorRecord

__all__ = [
    "Tensor",
    "arange",
    "array_of",
    "as_tensor",
    "empty",
    "from_numpy",
    "full",
    "tensors_in_flight",
    "ones",
    "tensor",
    "unwrap_leaves",
    "wrap_array",
    "wrap_arrays",
    "zeros",
]

ShapeLike = int | Sequence[int]

# The tensors a collective in flight reads or writes: id(tensor) -> [tensor, how many
# collectives]. Only `Protection` (in protect.py) changes it, under its lock. The tensor is
# held, so its id cannot become another tensor's while it is listed.
tensors_in_flight: dict[int, list[Any]] = {}


def _this_rank() -> int | None:
    ctx = _state.current_or_none()
    return ctx.device.rank if ctx is not None else world_rank()


def default_device() -> Device:
    """The device new tensors go to: the current context's, else this rank's CPU."""
    ctx = _state.current_or_none()
    if ctx is not None:
        return ctx.device
    return Device("cpu", 0, world_rank())


def resolve_device(device: Device | str | None) -> Device:
    """Turn a factory's `device` argument into a concrete device of this rank.

    Raises:
        TypeError: `device` is not a Device, a string or None.
        DeviceError: the device belongs to another rank, or is a GPU this process does
            not have (or CuPy is missing).
    """
    if device is None:
        return default_device()
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        device = Device(kind, int(index) if index else 0)
    if not isinstance(device, Device):
        raise TypeError(
            f"device must be a mpitensor.Device, a string such as 'cuda:0', or None; got {type(device).__name__}"
        )
    rank = _this_rank()
    if device.rank is not None and rank is not None and device.rank != rank:
        raise DeviceError(f"device {device} belongs to rank {device.rank}; this is rank {rank}")
    if device.rank is None:
        device = Device(device.kind, device.index, rank)
    if device.kind == "cuda":
        require_cuda_device(device.index)
    return device


def _place(array: Any, device: Device) -> Any:
    """`array` as an array of `device`'s kind and index (copying only if needed)."""
    if device.kind == "cpu":
        if is_cupy_array(array):
            return array.get()
        return array
    cupy = require_cupy()
    with cupy.cuda.Device(device.index):
        if is_cupy_array(array):
            return array if array.device.id == device.index else _onto_current_gpu(array)
        return cupy.asarray(array)


def _onto_current_gpu(array: Any) -> Any:
    """A copy of CuPy `array` (of another GPU) on the current GPU.

    `cupy.asarray` returns an array of another GPU unchanged, which would leave a tensor
    labelled with one GPU holding memory of another; `ndarray.copy` is CuPy's documented
    copy onto the current device.
    """
    return array.copy()


def _device_of_array(array: Any) -> Device:
    if is_cupy_array(array):
        return Device("cuda", int(array.device.id), _this_rank())
    return Device("cpu", 0, _this_rank())


def _unwrap(value: Any) -> Any:
    # The class's own module reads the slot of another Tensor (an operand): every
    # operator and ufunc on tensors comes here, and the `array` property would add a call.
    return value._array if isinstance(value, Tensor) else value


def _wrap(result: Any, device: Device) -> Any:
    if is_supported_array(result):
        return Tensor(result, device)
    if isinstance(result, tuple):
        return tuple(_wrap(item, device) for item in result)
    return result


class Tensor(TensorRecord):
    """A tensor on one device of this rank: NumPy-backed on CPU, CuPy-backed on CUDA.

    Build tensors with the factories (`tensor`, `zeros`, `from_numpy`, ...) rather than
    this constructor.

    Args:
        array: the NumPy or CuPy array to wrap (not copied).
        device: the device the array lives on; derived from the array when None.

    Raises:
        TypeError: `array` is not a NumPy or CuPy ndarray.
    """

    __slots__ = ("__weakref__",)  # _array and _device: the record's (see records.py)

    __array_priority__ = 1000

    def __init__(self, array: Any, device: Device | None = None) -> None:
        if not is_supported_array(array):
            raise TypeError(f"Tensor wraps a NumPy or CuPy ndarray, got {type(array).__name__}")
        self._array = array
        self._device = device if device is not None else _device_of_array(array)

    # -- what the tensor is -------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape, as a tuple of ints."""
        return tuple(self._array.shape)

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype of the elements."""
        return self._array.dtype

    @property
    def ndim(self) -> int:
        """The number of dimensions."""
        return self._array.ndim

    @property
    def size(self) -> int:
        """The number of elements."""
        return int(self._array.size)

    @property
    def nbytes(self) -> int:
        """The number of bytes of the elements."""
        return int(self._array.nbytes)

    @property
    def device(self) -> Device:
        """The device the tensor lives on."""
        return self._device

    @property
    def array(self) -> Any:
        """The underlying NumPy or CuPy array (shared, not copied)."""
        return self._array

    @property
    def in_flight(self) -> bool:
        """True while a collective reads or writes this tensor."""
        return id(self) in tensors_in_flight

    @property
    def T(self) -> Tensor:  # noqa: N802 - NumPy's name
        """The transpose (a view)."""
        return Tensor(self._array.T, self._device)

    def __repr__(self) -> str:
        body = repr(self._array) if self._array.size <= 64 else f"shape={self.shape}"
        return f"Tensor({body}, device={self._device})"

    def __str__(self) -> str:
        return str(self._array)

    def __len__(self) -> int:
        return len(self._array)

    def __iter__(self) -> Iterator[Tensor]:
        for row in self._array:
            yield _wrap(row, self._device)

    def __bool__(self) -> bool:
        return bool(self._array)

    def __float__(self) -> float:
        return float(self._array)

    def __int__(self) -> int:
        return int(self._array)

    def __complex__(self) -> complex:
        return complex(self._array)

    def __index__(self) -> int:
        return operator.index(self._array)

    __hash__ = None  # type: ignore[assignment]  # == is elementwise, as for arrays

    # -- moving data out and between devices ---------------------------------------------

    def numpy(self) -> np.ndarray:
        """The data as a NumPy array: the array itself on CPU (no copy), a copy from GPU."""
        return self._array.get() if is_cupy_array(self._array) else self._array

    def item(self) -> Any:
        """The single element as a Python scalar.

        Raises:
            ValueError: the tensor has more than one element.
        """
        return self._array.item()

    def tolist(self) -> Any:
        """The data as nested Python lists."""
        return self._array.tolist()

    def to(self, device: Device | str) -> Tensor:
        """The tensor on `device`: itself if already there, else a copy.

        Args:
            device: a `Device` of this rank, or a string such as ``"cpu"`` or ``"cuda:0"``.

        Raises:
            DeviceError: the device belongs to another rank, or CuPy/a GPU is missing.
        """
        target = resolve_device(device)
        if target.kind == self._device.kind and target.index == self._device.index:
            return self
        return Tensor(_place(self._array, target), target)

    def cpu(self) -> Tensor:
        """The tensor on this rank's CPU."""
        return self.to(Device("cpu", 0, self._device.rank))

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        if is_cupy_array(self._array):
            if copy is False:
                raise ValueError("a CUDA tensor cannot become a NumPy array without a copy")
            result = self._array.get()
        else:
            result = self._array
            if copy:
                result = result.copy()
        return result if dtype is None else result.astype(dtype, copy=False)

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        if not is_cupy_array(self._array):
            raise AttributeError("a CPU tensor has no __cuda_array_interface__")
        return self._array.__cuda_array_interface__

    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        if "out" in kwargs:
            outs = kwargs["out"]
            for out in outs:
                if isinstance(out, Tensor):
                    _check_writable(out)
            kwargs["out"] = tuple(_unwrap(out) for out in outs)
        args = [_unwrap(value) for value in inputs]
        result = getattr(ufunc, method)(*args, **kwargs)
        return _wrap(result, self._device)

    # -- indexing ------------------------------------------------------------------------

    def __getitem__(self, key: Any) -> Any:
        return _wrap(self._array[_unwrap_key(key)], self._device)

    def __setitem__(self, key: Any, value: Any) -> None:
        _check_writable(self)
        self._array[_unwrap_key(key)] = _unwrap(value)

    # -- delegation of everything else to the array ---------------------------------------

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        attribute = getattr(self._array, name)
        if not callable(attribute):
            return _wrap(attribute, self._device)

        def call(*args: Any, **kwargs: Any) -> Any:
            args = tuple(_unwrap(a) for a in args)
            kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
            return _wrap(attribute(*args, **kwargs), self._device)

        call.__name__ = name
        call.__doc__ = getattr(attribute, "__doc__", None)
        return call

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self._array)))

    def __reduce__(self) -> tuple[Callable[..., Tensor], tuple[Any, ...]]:
        return (_rebuild, (self.numpy(), self._device.kind))

    def __copy__(self) -> Tensor:
        return Tensor(self._array.copy(), self._device)

    def __deepcopy__(self, memo: dict[int, Any]) -> Tensor:
        return self.__copy__()


def _check_writable(tensor: Tensor) -> None:
    """Refuse a write to `tensor` while a collective in flight reads or writes it.

    Raises:
        TensorInFlightError: a collective is in flight on it.
    """
    if tensors_in_flight and id(tensor) in tensors_in_flight:
        raise TensorInFlightError(
            "this tensor is in use by a collective in flight; call resolve() on its "
            "CollectiveTensor before writing to it"
        )


_new_tensor = TensorRecord.__new__


def wrap_array(array: Any, device: Device) -> Tensor:
    """A `Tensor` over `array` (not copied) on `device`, without `Tensor`'s checks.

    For results the collectives build themselves (an array of the right kind on the right
    device): they make one per result tensor, hundreds per fused call.

    Args:
        array: a NumPy or CuPy array (not checked).
        device: the device it lives on (not checked).

    Returns:
        The tensor.
    """
    # The class's own module fills the slots of a tensor made without __init__ (and its
    # checks): the one way to build a tensor without the cost of a constructor call.
    result = _new_tensor(Tensor)
    result._array = array
    result._device = device
    return result


def wrap_arrays(arrays: Iterable[Any], devices: Iterable[Device]) -> list[Tensor]:
    """`wrap_array` of each array on its device, for the hundreds of results of a fused call.

    Args:
        arrays: NumPy or CuPy arrays (not checked).
        devices: the device of each (not checked).

    Returns:
        The tensors, in order.
    """
    tensors = []
    for array, device in zip(arrays, devices):
        result = _new_tensor(Tensor)
        result._array = array
        result._device = device
        tensors.append(result)
    return tensors


def unwrap_leaves(values: list[Any], host: Device) -> tuple[list[Any], list[Device]]:
    """The arrays of `values` (tensors, or anything else as it is) and their devices.

    For the leaves of a fused call, hundreds at a time: a tensor's slots are read here
    rather than through its properties, which would cost two calls per leaf.

    Args:
        values: tensors, arrays or other leaves.
        host: the device given to leaves that are not tensors.

    Returns:
        (each tensor's array, or the leaf itself; each tensor's device, or `host`).
    """
    kinds = set(map(type, values))
    if kinds == _TENSOR_ONLY:  # the usual cases first: one C loop for each list
        return list(map(_ARRAY_SLOT, values)), list(map(_DEVICE_SLOT, values))
    if Tensor not in kinds:
        return list(values), [host] * len(values)
    arrays = [v._array if type(v) is Tensor else v for v in values]
    devices = [v._device if type(v) is Tensor else host for v in values]
    return arrays, devices


_TENSOR_ONLY = {Tensor}
_ARRAY_SLOT, _DEVICE_SLOT = operator.attrgetter("_array"), operator.attrgetter("_device")

array_of: Callable[[Tensor], Any] = _ARRAY_SLOT
"""``array_of(tensor)`` is ``tensor.array``, without a Python call (the smallest calls' paths read it)."""


def _rebuild(array: np.ndarray, kind: str) -> Tensor:
    return tensor(array, device=None if kind == "cpu" else Device(kind))


def _unwrap_key(key: Any) -> Any:
    if isinstance(key, tuple):
        return tuple(_unwrap(k) for k in key)
    return _unwrap(key)


def _binary(op: Callable[[Any, Any], Any], reflected: bool) -> Callable[[Tensor, Any], Any]:
    if reflected:

        def method(self: Tensor, other: Any) -> Any:
            return _wrap(op(_unwrap(other), self._array), self._device)

    else:

        def method(self: Tensor, other: Any) -> Any:
            return _wrap(op(self._array, _unwrap(other)), self._device)

    return method


def _inplace(op: Callable[[Any, Any], Any]) -> Callable[[Tensor, Any], Tensor]:
    def method(self: Tensor, other: Any) -> Tensor:
        _check_writable(self)
        self._array = op(self._array, _unwrap(other))
        return self

    return method


def _unary(op: Callable[[Any], Any]) -> Callable[[Tensor], Any]:
    def method(self: Tensor) -> Any:
        return _wrap(op(self._array), self._device)

    return method


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul",
              "and", "or", "xor", "lshift", "rshift"):
    _op = getattr(operator, f"{_name}_" if _name in ("and", "or") else _name)
    setattr(Tensor, f"__{_name}__", _binary(_op, reflected=False))
    setattr(Tensor, f"__r{_name}__", _binary(_op, reflected=True))
    setattr(Tensor, f"__i{_name}__", _inplace(getattr(operator, f"i{_name}")))
for _name in ("lt", "le", "eq", "ne", "gt", "ge"):
    setattr(Tensor, f"__{_name}__", _binary(getattr(operator, _name), reflected=False))
for _name in ("neg", "pos", "abs", "invert"):
    setattr(Tensor, f"__{_name}__", _unary(getattr(operator, _name)))
Tensor.__divmod__ = _binary(divmod, reflected=False)  # type: ignore[attr-defined]
Tensor.__rdivmod__ = _binary(divmod, reflected=True)  # type: ignore[attr-defined]


# -- factories ----------------------------------------------------------------------------


def tensor(data: Any, *, dtype: Any = None, device: Device | str | None = None) -> Tensor:
    """A new tensor holding a copy of `data`.

    Args:
        data: a scalar, nested sequence, `Tensor`, or array of any library (NumPy, CuPy,
            torch, JAX, DLPack).
        dtype: the element type (a NumPy, torch or JAX dtype); inferred from `data` when
            None (NumPy's rules).
        device: where to put it; the current context's device when None.

    Raises:
        DeviceError: the device is another rank's, or CuPy/a GPU is missing.
    """
    target = resolve_device(device)
    data = _unwrap(data)
    dtype = _dtype(dtype)
    if _foreign(data):
        data = to_array(data, None, "tensor", "data")
    if target.kind == "cpu":
        if is_cupy_array(data):
            data = data.get()
        return Tensor(np.array(data, dtype=dtype, copy=True), target)
    cupy = require_cupy()
    with cupy.cuda.Device(target.index):
        if is_cupy_array(data) and data.device.id != target.index:
            return Tensor(cupy.asarray(_onto_current_gpu(data), dtype=dtype), target)
        return Tensor(cupy.array(data, dtype=dtype, copy=True), target)


def as_tensor(data: Any, *, device: Device | None = None) -> Tensor:
    """`data` as a tensor, sharing memory where possible (a `Tensor` comes back as is).

    Args:
        data: a `Tensor`, or an array of any library: NumPy, CuPy, torch (CPU and CUDA;
            the data of a tensor that requires grad), JAX (read-only), or any object with
            ``__dlpack__``, ``__array_interface__`` or ``__cuda_array_interface__``.
        device: the device the data lives on; derived from it when None.

    Raises:
        TypeError: `data` is none of these.
        DeviceError: `device` is not where the data lives (use `tensor(data, device=...)`
            or `.to(device)` to copy it there).
    """
    if isinstance(data, Tensor):
        return data
    if not is_supported_array(data):
        data = to_array(data, None, "as_tensor", "data")
    actual = _device_of_array(data)
    if device is None:
        return Tensor(data, actual)
    if (device.kind, device.index) != (actual.kind, actual.index):
        raise DeviceError(
            f"as_tensor shares memory and cannot move data: it lives on {actual.kind}:{actual.index}, "
            f"not on {device}; copy it there with mt.tensor(data, device=...) or .to(device)"
        )
    return Tensor(data, device)


def _foreign(data: Any) -> bool:
    """True for an array of another library (not NumPy, CuPy, a sequence or a Python number)."""
    kind = type(data)
    if kind is np.ndarray or kind in (list, tuple, int, float, bool, complex) or isinstance(data, np.generic):
        return False
    return not is_supported_array(data) and not isinstance(data, (list, tuple))


def _dtype(dtype: Any) -> Any:
    """A factory's `dtype` as NumPy takes it (torch dtypes converted); None stays None."""
    return None if dtype is None else numpy_dtype(dtype)


def from_numpy(array: np.ndarray) -> Tensor:
    """A CPU tensor sharing memory with `array` (no copy).

    Raises:
        TypeError: `array` is not a NumPy ndarray.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"from_numpy expects a numpy.ndarray, got {type(array).__name__}")
    return Tensor(array, Device("cpu", 0, _this_rank()))


def _factory(name: str, shape: ShapeLike, dtype: Any, device: Device | str | None, *extra: Any) -> Tensor:
    target = resolve_device(device)
    dtype = _dtype(dtype)
    xp = array_module(target.kind)
    if target.kind == "cpu":
        return Tensor(getattr(xp, name)(shape, *extra, dtype=dtype), target)
    with xp.cuda.Device(target.index):
        return Tensor(getattr(xp, name)(shape, *extra, dtype=dtype), target)


def zeros(shape: ShapeLike, *, dtype: Any = None, device: Device | str | None = None) -> Tensor:
    """A tensor of zeros (float64 unless `dtype` says otherwise, as NumPy)."""
    return _factory("zeros", shape, dtype, device)


def ones(shape: ShapeLike, *, dtype: Any = None, device: Device | str | None = None) -> Tensor:
    """A tensor of ones (float64 unless `dtype` says otherwise, as NumPy)."""
    return _factory("ones", shape, dtype, device)


def empty(shape: ShapeLike, *, dtype: Any = None, device: Device | str | None = None) -> Tensor:
    """An uninitialized tensor (float64 unless `dtype` says otherwise, as NumPy)."""
    return _factory("empty", shape, dtype, device)


def full(shape: ShapeLike, fill_value: Any, *, dtype: Any = None, device: Device | str | None = None) -> Tensor:
    """A tensor filled with `fill_value` (its dtype inferred as NumPy does)."""
    return _factory("full", shape, dtype, device, fill_value)


def arange(
    start: Any,
    stop: Any = None,
    step: Any = 1,
    *,
    dtype: Any = None,
    device: Device | str | None = None,
) -> Tensor:
    """Evenly spaced values in ``[start, stop)``, as `numpy.arange`."""
    if stop is None:
        start, stop = 0, start
    target = resolve_device(device)
    dtype = _dtype(dtype)
    xp = array_module(target.kind)
    if target.kind == "cpu":
        return Tensor(xp.arange(start, stop, step, dtype=dtype), target)
    with xp.cuda.Device(target.index):
        return Tensor(xp.arange(start, stop, step, dtype=dtype), target)
