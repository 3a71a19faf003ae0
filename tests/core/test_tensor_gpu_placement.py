"""Which GPU a tensor's memory is on: moving between GPUs copies, labels never lie.

CuPy is replaced by a stand-in that records the current device (no GPU needed): an array of
another GPU must be copied while the target GPU is current, and never merely relabelled.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace
from typing import Any, ClassVar

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core import tensor as tensor_module


class _StandInGpu:
    """The part of CuPy the placement code uses: the current device, arrays, copies."""

    def __init__(self) -> None:
        self.current = 0
        self.cuda = SimpleNamespace(Device=self._device)

    @contextlib.contextmanager
    def _device(self, index: int) -> Any:
        before, self.current = self.current, index
        try:
            yield
        finally:
            self.current = before

    def asarray(self, data: Any, dtype: Any = None) -> Any:
        # As CuPy: an array of another GPU comes back unchanged.
        if isinstance(data, _GpuArray):
            return data if dtype is None else _GpuArray(data.host.astype(dtype), data.device.id, self)
        return _GpuArray(np.asarray(data, dtype=dtype), self.current, self)

    def array(self, data: Any, dtype: Any = None, copy: bool = True) -> Any:
        host = data.host if isinstance(data, _GpuArray) else data
        device = data.device.id if isinstance(data, _GpuArray) else self.current
        return _GpuArray(np.array(host, dtype=dtype, copy=True), device, self)


class _GpuArray:
    __module__ = "cupy._stand_in"
    __cuda_array_interface__: ClassVar[dict[str, Any]] = {}

    def __init__(self, host: np.ndarray, device: int, gpu: _StandInGpu) -> None:
        self.host, self.device, self._gpu = host, SimpleNamespace(id=device), gpu
        self.dtype, self.shape = host.dtype, host.shape

    def copy(self) -> _GpuArray:
        """As CuPy's ndarray.copy: onto the current device."""
        return _GpuArray(self.host.copy(), self._gpu.current, self._gpu)


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> _StandInGpu:
    stand_in = _StandInGpu()
    monkeypatch.setattr(tensor_module, "require_cupy", lambda: stand_in)
    monkeypatch.setattr(tensor_module, "require_cuda_device", lambda index: stand_in)
    return stand_in


def test_to_another_gpu_copies_onto_it(gpu):
    source = mt.Tensor(_GpuArray(np.arange(3.0), 0, gpu), mt.Device("cuda", 0))
    moved = source.to("cuda:1")
    assert moved.device.index == 1
    assert moved.array.device.id == 1
    assert moved.array is not source.array
    assert source.to("cuda:0") is source


def test_tensor_of_another_gpus_array_lands_on_the_target(gpu):
    data = _GpuArray(np.arange(4, dtype=np.float32), 1, gpu)
    made = mt.tensor(data, device="cuda:0")
    assert made.device.index == 0 and made.array.device.id == 0
    cast = mt.tensor(data, dtype=np.float64, device="cuda:0")
    assert cast.array.device.id == 0 and cast.dtype == np.float64
    same = mt.tensor(data, device="cuda:1")
    assert same.array.device.id == 1 and same.array is not data


def test_as_tensor_refuses_a_device_the_data_is_not_on(gpu):
    data = _GpuArray(np.zeros(2), 1, gpu)
    assert mt.as_tensor(data).device.index == 1
    assert mt.as_tensor(data, device=mt.Device("cuda", 1)).array is data
    with pytest.raises(mt.DeviceError, match="lives on cuda:1, not on cuda:0"):
        mt.as_tensor(data, device=mt.Device("cuda", 0))
    with pytest.raises(mt.DeviceError, match="lives on cpu:0"):
        mt.as_tensor(np.zeros(2), device=mt.Device("cuda", 0))
