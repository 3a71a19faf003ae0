"""The held broadcast, all-gather, all-to-all, gather and reduce: MPI's blocking calls on the caller's buffers.

Every result is compared with NumPy's from every rank's input, on the Python path (the
first call of a kind), on the compiled lane (later calls of the kind on the full group with
the check on) and with a peer late past the lane's wait. A mismatch met on the lane (with
another held call or with the general collective), bad buffers and the calls the lane
declines behave as on the Python path; unchecked calls post MPI's nonblocking calls.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives import native
from mpitensor._collectives.held import data_plan, reducible
from tests.helpers import OP, assert_matches, expect_mismatch, rank_input, reference, seed_of, still_usable

pytestmark = pytest.mark.mpi(min_size=1)

switched_off = os.environ.get("MPITENSOR_NATIVE", "").strip() == "0"
needs_compiled = pytest.mark.skipif(switched_off or not native.built(),
                                    reason="MPITENSOR_NATIVE=0, or built without a C compiler: the Python path only")

KINDS = ["broadcast", "all_gather", "all_to_all", "gather", "reduce"]
# Shapes by their first axis in blocks of the group's size (an all-to-all cuts it into one per rank).
SHAPES = {"0-d": lambda size: (), "3 rows": lambda size: (3 * size,), "80 KB": lambda size: (20_000 * size,),
          "5x7": lambda size: (size, 5, 7)}
DTYPES = [np.float32, np.float64, np.int8, np.complex128, np.bool_]


def broadcast_held(array: np.ndarray, out: np.ndarray, root: int) -> mt.CollectiveTensor:
    return mt.broadcast(array, root=root, out=out, held=True)


def all_gather_held(array: np.ndarray, out: np.ndarray) -> mt.CollectiveTensor:
    return mt.all_gather(array, out=out, held=True)


def all_to_all_held(array: np.ndarray, out: np.ndarray) -> mt.CollectiveTensor:
    return mt.all_to_all(array, out=out, held=True)


def gather_held(array: np.ndarray, out: np.ndarray, root: int) -> mt.CollectiveTensor:
    return mt.gather(array, root, out=out, held=True)


def reduce_held(array: np.ndarray, out: np.ndarray, op: object, root: int) -> mt.CollectiveTensor:
    return mt.reduce(array, op, root=root, out=out, held=True)


def _held(kind: str, array: np.ndarray, size: int, rank: int, root: int, op: object = OP.SUM) -> np.ndarray:
    """The held call of `kind` into a fresh buffer of the result's size; that buffer, once resolved."""
    stacked = kind == "all_gather" or (kind == "gather" and rank == root)
    out = np.empty((size, *array.shape) if stacked else array.shape, array.dtype)
    calls = {"broadcast": lambda: broadcast_held(array, out, root), "all_gather": lambda: all_gather_held(array, out),
             "all_to_all": lambda: all_to_all_held(array, out), "gather": lambda: gather_held(array, out, root),
             "reduce": lambda: reduce_held(array, out, op, root)}
    result = calls[kind]().resolve().numpy()
    assert np.shares_memory(result, out), "the result is the caller's buffer"
    return out


def _expected(kind: str, inputs: list[np.ndarray], rank: int, root: int, op: object = OP.SUM) -> np.ndarray:
    """What `kind` gives rank `rank`, from every rank's input, by NumPy."""
    if kind == "broadcast":
        return inputs[root]
    if kind == "all_gather" or (kind == "gather" and rank == root):
        return np.stack(inputs)
    if kind == "all_to_all":
        return np.concatenate([np.array_split(np.reshape(each, -1), len(inputs))[rank] for each in inputs]).reshape(
            inputs[rank].shape)
    if kind == "reduce" and rank == root:
        return reference(op, inputs)
    return inputs[rank]


def _kind_takes(kind: str, shape: tuple[int, ...], dtype: object) -> bool:
    return not (kind == "all_to_all" and shape == ()) and (kind != "reduce" or reducible(OP.SUM, dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape_of", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_repeated_calls_match_numpy(kind, shape_of, dtype):
    """Four calls of a kind (the first on the Python path, then on the lane), the last with a late peer."""
    with mt.DistributedContext.init() as ctx:
        shape, root = shape_of(ctx.size), ctx.size - 1
        if not _kind_takes(kind, shape, dtype):
            pytest.skip("an all-to-all of a 0-d array, or a reduction that is not MPI's own")
        for turn in range(4):
            inputs = [rank_input(seed_of("held-data", kind, shape, np.dtype(dtype).name, turn), r, shape, dtype)
                      for r in range(ctx.size)]
            if turn == 3 and ctx.rank == 0:
                time.sleep(0.05)
            got = _held(kind, inputs[ctx.rank], ctx.size, ctx.rank, root)
            assert_matches(got, _expected(kind, inputs, ctx.rank, root), OP.SUM, ctx.size)
        has_lane = native.built() and not switched_off and 2 <= ctx.size <= 8
        probe = np.empty(shape, dtype)
        rooted = kind in ("broadcast", "gather", "reduce")
        op = OP.SUM if kind == "reduce" else None
        assert (data_plan(ctx, kind, probe, root if rooted else -1, op) is not None) == has_lane
        assert not ctx.engine.busy()
        still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [OP.MAX, OP.BXOR, OP.PROD], ids=lambda o: o.name)
def test_reductions_on_the_lane_and_those_it_refuses(op):
    """Integer reductions MPI makes itself are held; a float MAX (encoded), a MEAN (divided) and a bool's take the
    general reduce, their result (off the root the input) written into the caller's buffer."""
    with mt.DistributedContext.init() as ctx:
        for turn in range(3):
            inputs = [rank_input(seed_of("held-reduce", op.name, turn), r, (40,), np.int32) for r in range(ctx.size)]
            got = _held("reduce", inputs[ctx.rank], ctx.size, ctx.rank, 0, op)
            assert_matches(got, _expected("reduce", inputs, ctx.rank, 0, op), op, ctx.size)
        for encoded, dtype in ((OP.MAX, np.float32), (OP.MEAN, np.float64), (OP.SUM, np.bool_)):
            assert not reducible(encoded, dtype)
            for turn in range(2):
                seed = seed_of("held-reduce-general", encoded.name, turn)
                inputs = [rank_input(seed, r, (4,), dtype) for r in range(ctx.size)]
                got = _held("reduce", inputs[ctx.rank], ctx.size, ctx.rank, 0, encoded)
                assert_matches(got, _expected("reduce", inputs, ctx.rank, 0, encoded), encoded, ctx.size)
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
def test_run_held_moves_the_data_at_once_and_declines_what_it_cannot_take():
    """`run_held` (what a compiled program's handler calls): the result in `out` when it returns; buffers of
    another kind, overlapping ones and another thread's call declined."""
    with mt.DistributedContext.init() as ctx:
        shape = (20_000 * ctx.size,)
        for kind in ("broadcast", "all_gather"):
            for _ in range(2):
                _held(kind, np.ones(shape), ctx.size, ctx.rank, 0)
        lanes = data_plan(ctx, "broadcast", np.ones(shape), 0), data_plan(ctx, "all_gather", np.ones(shape))
        for turn in range(3):
            inputs = [rank_input(seed_of("run-held", turn), r, shape, np.float64) for r in range(ctx.size)]
            if turn == 2 and ctx.rank == ctx.size - 1:
                time.sleep(0.05)
            spread, gathered = np.empty(shape), np.empty((ctx.size, *shape))
            assert lanes[0].run_held(inputs[ctx.rank], spread) is True
            assert lanes[1].run_held(inputs[ctx.rank], gathered) is True
            np.testing.assert_array_equal(spread, inputs[0])
            np.testing.assert_array_equal(gathered, np.stack(inputs))
        whole = np.ones((ctx.size + 1) * shape[0])
        for lane, out in zip(lanes, (whole[1:shape[0] + 1], whole[:ctx.size * shape[0]]), strict=True):
            assert lane.run_held(whole[:shape[0]], out) is None, "overlapping buffers"
            assert lane.run_held(np.ones(shape, np.float32), out.astype(np.float32)) is None, "another dtype"
        assert lanes[1].run_held(np.ones(shape), np.empty(shape)) is None, "an all-gather's out of one rank's size"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(lanes[0].run_held(np.ones(shape), np.empty(shape))))
        thread.start()
        thread.join()
        assert seen == [None], "another thread's call is declined"
        np.testing.assert_array_equal(_held("broadcast", np.full(shape, float(ctx.rank)), ctx.size, ctx.rank, 0),
                                      np.zeros(shape))
        still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_mismatches_are_caught_on_every_rank():
    """On the lane and off it: another shape, another root, another op, and a held call against the general one."""
    with mt.DistributedContext.init() as ctx:
        last = ctx.rank == ctx.size - 1
        size = ctx.size
        for _ in range(2):
            for kind in KINDS:
                _held(kind, np.ones(8 * size), size, ctx.rank, 0)
        shape = (9 * size,) if last else (8 * size,)
        expect_mismatch(lambda: broadcast_held(np.ones(shape), np.empty(shape), 0), str(8 * size), str(9 * size))
        expect_mismatch(lambda: all_gather_held(np.ones(shape), np.empty((size, *shape))), str(9 * size))
        expect_mismatch(lambda: all_to_all_held(np.ones(shape), np.empty(shape)), str(9 * size))
        root = 1 if last else 0
        expect_mismatch(lambda: broadcast_held(np.ones(8), np.empty(8), root), "root")
        expect_mismatch(lambda: gather_held(np.ones(8), np.empty(8 * size if ctx.rank == root else 8), root), "root")
        op = OP.MAX if last else OP.SUM
        expect_mismatch(lambda: reduce_held(np.ones(8, np.int64), np.empty(8, np.int64), op, 0), "MAX")
        general = (lambda: mt.broadcast(np.ones(8), root=0, out=np.empty(8))) if last else (
            lambda: broadcast_held(np.ones(8), np.empty(8), 0))
        expect_mismatch(general, "held")
        np.testing.assert_array_equal(_held("broadcast", np.full(8, float(ctx.rank)), size, ctx.rank, 0), np.zeros(8))
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
            gather_held(np.ones(8), read_only, ctx.size - 1)
        with pytest.raises(TypeError, match="NumPy arrays"):
            all_gather_held([1.0], np.empty(ctx.size))
        if ctx.size > 1:
            with pytest.raises(ValueError, match="equal blocks"):
                all_to_all_held(np.ones(ctx.size + 1, np.int8), np.empty(ctx.size + 1, np.int8))
        still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", KINDS)
def test_unchecked_calls_post_the_nonblocking_calls(kind):
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        shape, root = (4 * ctx.size, 3), ctx.size - 1
        for turn in range(3):
            inputs = [rank_input(seed_of("unchecked", kind, turn), r, shape, np.float32) for r in range(ctx.size)]
            got = _held(kind, inputs[ctx.rank], ctx.size, ctx.rank, root)
            assert_matches(got, _expected(kind, inputs, ctx.rank, root), OP.SUM, ctx.size)
        op = OP.SUM if kind == "reduce" else None
        assert data_plan(ctx, kind, inputs[0], root if kind in ("broadcast", "gather", "reduce") else -1, op) is None
