"""`broadcast_held` and `all_gather_held`: MPI's blocking calls on the caller's buffers, and their compiled lanes.

Every result is compared with NumPy's from every rank's input, on the Python path (the
first call of a kind), on the compiled lane (later calls of the kind on the full group with
the check on) and with a peer late past the lane's wait. A mismatch met on the lane (with
another held call or with the general collective), bad buffers and the calls the lane
declines behave as on the Python path; unchecked calls take the general path.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives import native
from mpitensor._collectives.held import all_gather_held, broadcast_held, data_lane
from tests.helpers import expect_mismatch, rank_input, seed_of, still_usable

pytestmark = pytest.mark.mpi(min_size=1)

switched_off = os.environ.get("MPITENSOR_NATIVE", "").strip() == "0"
needs_compiled = pytest.mark.skipif(switched_off or not native.built(),
                                    reason="MPITENSOR_NATIVE=0, or built without a C compiler: the Python path only")

SHAPES = [(), (3,), (20_000,), (5, 7)]
DTYPES = [np.float32, np.float64, np.int8, np.complex128, np.bool_]


def _inputs(size: int, *key: object, shape: tuple[int, ...], dtype: object) -> list[np.ndarray]:
    return [rank_input(seed_of("held-data", *key), r, shape, dtype) for r in range(size)]


def _broadcast(array: np.ndarray, root: int) -> np.ndarray:
    out = np.empty_like(array)
    result = broadcast_held(array, out, root).resolve().numpy()
    assert np.shares_memory(result, out), "the result is the caller's buffer"
    return out


def _all_gather(array: np.ndarray, size: int) -> np.ndarray:
    out = np.empty((size, *array.shape), array.dtype)
    result = all_gather_held(array, out).resolve().numpy()
    assert np.shares_memory(result, out), "the result is the caller's buffer"
    return out


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_repeated_calls_match_numpy(shape, dtype):
    """Four calls of each kind (the first on the Python path, then on the lane), the last with a late peer."""
    with mt.DistributedContext.init() as ctx:
        root = ctx.size - 1
        for turn in range(4):
            inputs = _inputs(ctx.size, shape, np.dtype(dtype).name, turn, shape=shape, dtype=dtype)
            if turn == 3 and ctx.rank == 0:
                time.sleep(0.05)
            np.testing.assert_array_equal(_broadcast(inputs[ctx.rank], root), inputs[root])
            np.testing.assert_array_equal(_all_gather(inputs[ctx.rank], ctx.size), np.stack(inputs))
        has_lanes = native.built() and not switched_off and 2 <= ctx.size <= 8
        probe = np.empty(shape, dtype)
        assert (data_lane(ctx, "broadcast", probe, root) is not None) == has_lanes
        assert (data_lane(ctx, "all_gather", probe, -1) is not None) == has_lanes
        assert not ctx.engine.busy()
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
def test_run_held_moves_the_bytes_at_once_and_declines_what_it_cannot_take():
    """`run_held` (what a compiled program's handler calls): the result in `out` when it returns; buffers of
    another kind, overlapping ones and another thread's call declined."""
    with mt.DistributedContext.init() as ctx:
        shape = (20_000,)
        for _ in range(2):
            _broadcast(np.ones(shape), 0)
            _all_gather(np.ones(shape), ctx.size)
        lanes = data_lane(ctx, "broadcast", np.ones(shape), 0), data_lane(ctx, "all_gather", np.ones(shape), -1)
        for turn in range(3):
            inputs = _inputs(ctx.size, "run-held", turn, shape=shape, dtype=np.float64)
            if turn == 2 and ctx.rank == ctx.size - 1:
                time.sleep(0.05)
            spread, gathered = np.empty(shape), np.empty((ctx.size, *shape))
            assert lanes[0].run_held(inputs[ctx.rank], spread) is True
            assert lanes[1].run_held(inputs[ctx.rank], gathered) is True
            np.testing.assert_array_equal(spread, inputs[0])
            np.testing.assert_array_equal(gathered, np.stack(inputs))
        whole = np.ones(2 * shape[0])
        for lane, out in zip(lanes, (whole[1:shape[0] + 1], whole), strict=True):
            assert lane.run_held(whole[:shape[0]], out) is None, "overlapping buffers"
            assert lane.run_held(np.ones(shape, np.float32), out.astype(np.float32)) is None, "another dtype"
        assert lanes[1].run_held(np.ones(shape), np.empty(shape)) is None, "an all-gather's out of one rank's size"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(lanes[0].run_held(np.ones(shape), np.empty(shape))))
        thread.start()
        thread.join()
        assert seen == [None], "another thread's call is declined"
        np.testing.assert_array_equal(_broadcast(np.full(shape, float(ctx.rank)), 0), np.zeros(shape))
        still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_mismatches_are_caught_on_every_rank():
    """On the lane and off it: another shape, another root, and a held call against the general collective."""
    with mt.DistributedContext.init() as ctx:
        last = ctx.rank == ctx.size - 1
        for _ in range(2):
            _broadcast(np.ones(8), 0)
            _all_gather(np.ones(8), ctx.size)
        shape = (9,) if last else (8,)
        expect_mismatch(lambda: broadcast_held(np.ones(shape), np.empty(shape), 0), "(8,)", "(9,)")
        expect_mismatch(lambda: all_gather_held(np.ones(shape), np.empty((ctx.size, *shape))), "(8,)", "(9,)")
        root = 1 if last else 0
        expect_mismatch(lambda: broadcast_held(np.ones(8), np.empty(8), root), "root")
        general = (lambda: mt.broadcast(np.ones(8), root=0, out=np.empty(8))) if last else (
            lambda: broadcast_held(np.ones(8), np.empty(8), 0))
        expect_mismatch(general, "held")
        np.testing.assert_array_equal(_broadcast(np.full(8, float(ctx.rank)), 0), np.zeros(8))
        still_usable(ctx)


def test_bad_buffers_are_refused_with_what_to_do():
    with mt.DistributedContext.init() as ctx:
        whole = np.ones(17)
        with pytest.raises(ValueError, match="overlaps the input"):
            broadcast_held(whole[:8], whole[1:9], 0)
        with pytest.raises(ValueError, match="elements of float64"):
            all_gather_held(np.ones(8), np.empty(8 * ctx.size + 1))
        with pytest.raises(ValueError, match="C-contiguous"):
            broadcast_held(np.ones(16)[::2], np.empty(8), 0)
        with pytest.raises(ValueError, match="writable"):
            read_only = np.empty(8)
            read_only.flags.writeable = False
            broadcast_held(np.ones(8), read_only, 0)
        with pytest.raises(TypeError, match="NumPy arrays"):
            all_gather_held([1.0], np.empty(ctx.size))
        still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_unchecked_calls_take_the_general_path():
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        for turn in range(3):
            inputs = _inputs(ctx.size, "unchecked", turn, shape=(4, 3), dtype=np.float32)
            np.testing.assert_array_equal(_broadcast(inputs[ctx.rank], 0), inputs[0])
            np.testing.assert_array_equal(_all_gather(inputs[ctx.rank], ctx.size), np.stack(inputs))
        assert data_lane(ctx, "broadcast", inputs[0], 0) is None
        assert data_lane(ctx, "all_gather", inputs[0], -1) is None
