"""The host buffer pool: reuse without ever handing out memory still in use."""

from __future__ import annotations

import gc

import numpy as np

from mpitensor._core.pool import HostPool


def test_a_dropped_block_is_reused():
    pool = HostPool(min_bytes=1024)
    first = pool.empty((1000,), np.dtype(np.float64))
    address = first.ctypes.data
    del first
    gc.collect()
    second = pool.empty((1000,), np.dtype(np.float64))
    assert second.ctypes.data == address
    assert pool.stats()["hits"] == 1


def test_a_block_still_referenced_by_a_view_is_not_reused():
    pool = HostPool(min_bytes=1024)
    first = pool.empty((2000,), np.dtype(np.float32))
    first[:] = 1.0
    view = first[10:20]
    del first
    gc.collect()
    second = pool.empty((2000,), np.dtype(np.float32))
    second[:] = 2.0
    assert (view == 1.0).all()
    assert not np.shares_memory(view, second)


def test_small_requests_bypass_the_pool_and_shapes_and_dtypes_are_right():
    pool = HostPool(min_bytes=1 << 16)
    small = pool.empty((3, 4), np.dtype(np.int16))
    assert small.shape == (3, 4) and small.dtype == np.int16
    assert pool.stats() == {"hits": 0, "misses": 0, "cached_bytes": 0}
    big = pool.empty((256, 256), np.dtype(np.complex64))
    assert big.shape == (256, 256) and big.dtype == np.complex64 and big.flags.c_contiguous


def test_the_cache_is_capped():
    pool = HostPool(min_bytes=1, max_cached_bytes=10_000)
    arrays = [pool.empty((1000,), np.dtype(np.float64)) for _ in range(3)]
    del arrays
    gc.collect()
    assert pool.cached_bytes <= 10_000


def test_size_classes_are_quarter_steps_and_serve_nearby_sizes():
    from mpitensor._core.pool import size_class

    assert [size_class(n) for n in (65536, 65537, 81920, 81921, 131071)] == [65536, 81920, 81920, 98304, 131072]
    for n in range(5, 1 << 20, 4099):
        assert n <= size_class(n) <= n * 1.25
    pool = HostPool(min_bytes=1024)
    first = pool.empty((10_000,), np.dtype(np.uint8))
    address = first.ctypes.data
    del first
    gc.collect()
    second = pool.empty((9_000,), np.dtype(np.uint8))  # another size, the same class
    assert second.ctypes.data == address and second.shape == (9_000,)


def test_pooled_arrays_can_be_write_protected_and_released():
    from mpitensor._core.protect import restorable

    pool = HostPool(min_bytes=1024)
    array = pool.empty((64, 64), np.dtype(np.float64))
    assert restorable(array) and restorable(array[1:, ::2])
    array.flags.writeable = False
    array.flags.writeable = True
    view = array.T[3:]
    view.flags.writeable = False
    view.flags.writeable = True
    view[0, 0] = 5.0
    assert array[0, 3] == 5.0


def test_a_block_returns_only_when_the_last_view_of_a_view_is_gone():
    pool = HostPool(min_bytes=1024)
    first = pool.empty((4, 1000), np.dtype(np.float32))
    deep = first[1:].reshape(-1)[::2].view(np.int32)
    del first
    gc.collect()
    assert pool.cached_bytes == 0
    del deep
    gc.collect()
    from mpitensor._core.pool import size_class

    assert pool.cached_bytes == size_class(16_000)
