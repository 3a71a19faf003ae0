"""The pool of pinned staging buffers: reuse, pending GPU work, lifetimes, the cache limit.

The pool's logic does not depend on CUDA: here its memory comes from NumPy and its events
are plain objects with CUDA events' ``done`` and ``synchronize()``. The tests in on_gpu/
run it on real pinned memory.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from mpitensor._transport.gpu.pinned import PinnedPool


class HostMemory:
    """An allocator over NumPy arrays that records what it allocates and frees."""

    def __init__(self) -> None:
        self.live: dict[int, np.ndarray] = {}
        self.allocated: list[int] = []
        self.freed: list[int] = []

    def __call__(self, nbytes: int):
        block = np.zeros(nbytes, np.uint8)
        ptr = block.ctypes.data
        self.live[ptr] = block
        self.allocated.append(nbytes)
        return ptr, self._free

    def _free(self, ptr: int) -> None:
        self.freed.append(self.live.pop(ptr).nbytes)


class Event:
    """Stands for a CUDA event: work before it is done once `finish()` is called."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def finish(self) -> None:
        self.done = True

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


@pytest.fixture
def memory() -> HostMemory:
    return HostMemory()


@pytest.fixture
def pool(memory) -> PinnedPool:
    return PinnedPool(memory, max_cached_bytes=64 << 10)


def test_buffers_have_the_shape_and_dtype_asked_for(pool):
    buffer = pool.empty((3, 5), np.float32)
    assert buffer.array.shape == (3, 5)
    assert buffer.array.dtype == np.float32
    assert buffer.nbytes == 60
    assert buffer.array.ctypes.data == buffer.ptr
    buffer.array[...] = 7
    assert float(buffer.array.sum()) == 7 * 15


def test_sizes_round_up_to_pages():
    assert PinnedPool.block_size(0) == 4096
    assert PinnedPool.block_size(1) == 4096
    assert PinnedPool.block_size(4096) == 4096
    assert PinnedPool.block_size(4097) == 8192


def test_empty_and_scalar_buffers(pool):
    assert pool.empty((0,), np.float64).array.shape == (0,)
    assert pool.empty((), np.int64).array.shape == ()


def test_a_released_block_is_lent_again(pool, memory):
    first = pool.empty((1000,), np.float32)
    ptr = first.ptr
    first.release()
    second = pool.empty((250, 4), np.float32)
    assert second.ptr == ptr
    assert memory.allocated == [4096]
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 1


def test_release_is_idempotent(pool):
    buffer = pool.empty((10,), np.uint8)
    buffer.release()
    buffer.release()
    assert pool.cached_bytes == 4096
    a, b = pool.empty((10,), np.uint8), pool.empty((10,), np.uint8)
    assert a.ptr != b.ptr


def test_a_block_comes_back_when_its_last_view_is_gone(pool):
    buffer = pool.empty((100,), np.float64)
    ptr = buffer.ptr
    view = buffer.array[10:20]
    del buffer
    gc.collect()
    assert pool.cached_bytes == 0, "a view still uses the block"
    del view
    gc.collect()
    assert pool.cached_bytes == 4096
    assert pool.empty((100,), np.float64).ptr == ptr


def test_a_block_with_pending_gpu_work_is_not_lent_until_done(pool, memory):
    buffer = pool.empty((100,), np.float32)
    ptr = buffer.ptr
    copy = Event()
    buffer.release(copy)
    other = pool.empty((100,), np.float32)
    assert other.ptr != ptr, "the pending copy still uses the first block"
    assert copy.waited == 0, "the pool allocates rather than waits"
    other.release()
    copy.finish()
    again = [pool.empty((100,), np.float32) for _ in range(2)]
    assert {b.ptr for b in again} == {ptr, other.ptr}
    assert len(memory.allocated) == 2


def test_after_marks_work_that_ends_later(pool):
    buffer = pool.empty((8,), np.float32)
    copy = Event()
    buffer.after(copy)
    ptr = buffer.ptr
    buffer.release()
    assert pool.empty((8,), np.float32).ptr != ptr
    copy.finish()
    assert pool.empty((8,), np.float32).ptr == ptr


def test_the_cache_limit_frees_blocks_of_the_size_least_recently_returned(pool, memory):
    buffers = [pool.empty((n * 4096,), np.uint8) for n in (4, 8, 4)]
    for buffer in buffers:
        buffer.release()
    # 16 + 32 + 16 KiB = 64 KiB fits; one more block pushes out the 32 KiB one, the size
    # returned least recently (16 KiB blocks came back after it).
    assert pool.cached_bytes == 64 << 10
    extra = pool.empty((4096,), np.uint8)
    extra.release()
    del buffers, buffer, extra
    gc.collect()
    assert memory.freed == [32768]
    assert pool.cached_bytes == (64 << 10) - 32768 + 4096


def test_a_block_larger_than_the_cache_is_freed_on_return(pool, memory):
    big = pool.empty((128 << 10,), np.uint8)
    big.release()
    del big
    gc.collect()
    assert memory.freed == [128 << 10]
    assert pool.cached_bytes == 0


def test_freeing_a_block_waits_for_its_pending_copy(pool, memory):
    big = pool.empty((128 << 10,), np.uint8)
    copy = Event()
    big.release(copy)
    del big
    gc.collect()
    assert copy.waited == 1
    assert memory.freed == [128 << 10]


def test_memory_lives_while_a_view_does_even_after_eviction(pool, memory):
    big = pool.empty((128 << 10,), np.uint8)
    view = big.array[:16]
    view[:] = 3
    big.release()
    # Released and too big to cache, but the view still holds the block: not freed yet.
    assert memory.freed == []
    assert int(view.sum()) == 48
    del big, view
    gc.collect()
    assert memory.freed == [128 << 10]


def test_clear_frees_cached_blocks(pool, memory):
    for _ in range(3):
        pool.empty((10,), np.uint8)
    gc.collect()
    assert pool.cached_bytes == 4096  # the same block, lent and returned three times
    pool.clear()
    assert pool.cached_bytes == 0
    assert memory.freed == [4096]


class FailingEvent(Event):
    """A CUDA event whose wait fails (a kernel fault left the device unusable)."""

    def synchronize(self) -> None:
        raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")


def test_a_block_that_cannot_be_freed_warns_instead_of_passing_silently(pool, memory):
    big = pool.empty((128 << 10,), np.uint8)
    big.release(FailingEvent())
    with pytest.warns(ResourceWarning, match="131072 bytes could not be freed.*cudaErrorIllegalAddress"):
        del big
        gc.collect()
    assert memory.freed == [], "memory a copy may still use is not freed"


def test_a_failing_free_warns(memory):
    def broken_free(ptr: int) -> None:
        raise RuntimeError("cudaErrorCudartUnloading")

    pool = PinnedPool(lambda n: (memory(n)[0], broken_free), max_cached_bytes=0)
    buffer = pool.empty((16,), np.uint8)
    with pytest.warns(ResourceWarning, match="cudaErrorCudartUnloading"):
        buffer.release()
        del buffer
        gc.collect()
