"""Never a wrong number: reductions give NumPy's answer where MPI's own arithmetic does not.

Each case is one that passed a wrong result through silently before: Open MPI's saturating
small-integer sums, bool arrays holding bytes other than 0 and 1, integer scale factors
multiplied in float64, masked arrays, Python ints beyond int64, NaN factors. Where MPI's
own answer is the point (the first two), raw mpi4py runs beside mpitensor on the same
inputs, and the test says what MPI gave. Every expectation is NumPy's reduction of every
rank's input.
"""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpitensor as mt
from mpitensor._core import mpi_arithmetic
from tests.helpers import expect_mismatch, still_usable

pytestmark = pytest.mark.mpi(min_size=2)

SMALL_INTEGERS = [np.int8, np.uint8, np.int16, np.uint16]
# Sizes that take each path: the check's payload, the compiled/Python lanes, MPI's
# all-reduce, shared memory.
SIZES = [3, 16, 64, 1000, 40_000, 300_000]


@pytest.fixture(scope="module", params=[True, False], ids=["checked", "unchecked"])
def any_ctx(request):
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=request.param)) as ctx:
        yield ctx


def _overflowing(dtype: type, size: int, rank: int) -> np.ndarray:
    info = np.iinfo(dtype)
    return np.full(size, info.max // 2 + 3 + rank, dtype)


def _wrapping_sum(arrays: list[np.ndarray]) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.add.reduce(np.stack(arrays), axis=0, dtype=arrays[0].dtype)


def _raw_sum(array: np.ndarray) -> np.ndarray:
    out = np.empty_like(array)
    MPI.COMM_WORLD.Allreduce(array, out, MPI.SUM)
    return out


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", SMALL_INTEGERS, ids=lambda d: np.dtype(d).name)
def test_small_integer_sums_wrap_as_numpy_beside_raw_mpi(any_ctx, dtype, size):
    ctx = any_ctx
    inputs = [_overflowing(dtype, size, rank) for rank in range(ctx.size)]
    expected = _wrapping_sum(inputs)
    raw = _raw_sum(inputs[ctx.rank])
    raw_wraps = bool(np.array_equal(raw, expected))
    got = mt.all_reduce(inputs[ctx.rank].copy()).resolve().numpy()
    assert got.dtype == np.dtype(dtype)
    assert np.array_equal(got, expected), (
        f"{np.dtype(dtype)} x {size}: got {got[:3]}, NumPy {expected[:3]}, raw MPI {raw[:3]}"
    )
    # The probe saw what raw MPI does, from 16 elements up (where vector code starts).
    if size >= 16:
        assert (np.dtype(dtype) in mpi_arithmetic.probe()) == (not raw_wraps), (
            f"probe {sorted(map(str, mpi_arithmetic.probe()))}, raw MPI gave {raw[:3]} for {expected[:3]}"
        )


@pytest.mark.parametrize("dtype", SMALL_INTEGERS, ids=lambda d: np.dtype(d).name)
def test_small_integer_sums_wrap_in_every_reducing_collective(any_ctx, dtype):
    ctx = any_ctx
    rows = 4 * ctx.size
    inputs = [_overflowing(dtype, rows, rank).reshape(rows, 1) for rank in range(ctx.size)]
    mine = inputs[ctx.rank]
    expected = _wrapping_sum(inputs)
    assert np.array_equal(mt.all_reduce([mine.copy(), mine[:2].copy()]).resolve()[0].numpy(), expected)
    out = np.empty_like(mine)
    mt.all_reduce(mine.copy(), out=out).resolve()
    assert np.array_equal(out, expected)
    reduced = mt.reduce(mine.copy(), root=0).resolve()
    if ctx.rank == 0:
        assert np.array_equal(reduced.numpy(), expected)
    block = mt.reduce_scatter(mine.copy()).resolve().numpy()
    assert np.array_equal(block, expected[4 * ctx.rank : 4 * ctx.rank + 4])
    prefix = mt.scan(mine.copy()).resolve()
    assert np.array_equal(np.asarray(prefix), _wrapping_sum(inputs[: ctx.rank + 1]))
    with np.errstate(over="ignore"):
        scaled = _wrapping_sum([(x * np.asarray(3, dtype)).astype(dtype) for x in inputs])
    assert np.array_equal(mt.all_reduce(mine.copy(), prescale_factor=3).resolve().numpy(), scaled)


def _bool_bytes(size: int, rank: int) -> np.ndarray:
    """A bool array over bytes 0, 1, 2, 3 and 255, different on each rank."""
    values = np.array([0, 1, 2, 3, 255], np.uint8)
    return np.random.default_rng(1000 + rank).choice(values, size).view(np.bool_)


BOOL_OPS = {
    "sum": np.logical_or, "max": np.logical_or, "bor": np.logical_or,
    "prod": np.logical_and, "min": np.logical_and, "band": np.logical_and, "bxor": np.logical_xor,
}


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("op", sorted(BOOL_OPS))
def test_bool_of_any_bytes_reduces_as_numpy_beside_raw_mpi(any_ctx, op, size):
    ctx = any_ctx
    inputs = [_bool_bytes(size, rank) for rank in range(ctx.size)]
    expected = BOOL_OPS[op].reduce(np.stack(inputs), axis=0)
    mine = inputs[ctx.rank]
    raw = np.empty_like(mine)
    MPI.COMM_WORLD.Allreduce(mine, raw, {"sum": MPI.LOR, "max": MPI.LOR, "bor": MPI.LOR, "prod": MPI.LAND,
                                         "min": MPI.LAND, "band": MPI.LAND, "bxor": MPI.LXOR}[op])
    alone = mt.all_reduce(mine.copy(), op).resolve().numpy()
    for got in (alone, mt.all_reduce([mine.copy()], op).resolve()[0].numpy()):
        assert got.dtype == np.bool_
        # The bytes themselves: a True must be byte 1, as NumPy writes it.
        assert np.array_equal(got.view(np.uint8), expected.view(np.uint8)), (
            f"got bytes {np.unique(got.view(np.uint8))}, raw MPI gave bytes {np.unique(raw.view(np.uint8))}"
        )
    mean = mt.all_reduce(mine.copy(), "mean").resolve().numpy()
    assert np.array_equal(mean, sum(x.astype(np.float64) for x in inputs) / ctx.size)


@pytest.mark.parametrize("where", ["prescale_factor", "postscale_factor"])
def test_uint64_scaled_by_an_integer_is_exact(any_ctx, where):
    ctx = any_ctx
    mine = np.array([2**60 + 1, 2**63 + 5, 3], np.uint64)
    for factor in (2, 2**63):
        got = mt.all_reduce(mine, **{where: factor}).resolve().numpy()
        with np.errstate(over="ignore"):
            if where == "prescale_factor":
                expected = _wrapping_sum([mine * np.uint64(factor)] * ctx.size)
            else:
                expected = _wrapping_sum([mine] * ctx.size) * np.uint64(factor)
        assert got.dtype == np.uint64
        assert np.array_equal(got, expected), (factor, got, expected)


def test_integer_prescale_wraps_alike_for_sum_and_mean(any_ctx):
    ctx = any_ctx
    mine = np.array([2**30 + 1, 7], np.int32)
    with np.errstate(over="ignore"):
        product = mine * np.int32(2)  # wraps: -2147483646 for the first
    total = mt.all_reduce(mine, "sum", prescale_factor=2).resolve().numpy()
    mean = mt.all_reduce(mine, "mean", prescale_factor=2).resolve().numpy()
    with np.errstate(over="ignore"):
        assert np.array_equal(total, _wrapping_sum([product] * ctx.size))
    assert np.array_equal(mean, product.astype(np.float64))


def test_integer_factors_beyond_the_dtype_are_refused(any_ctx):
    for factor, dtype in ((2**70, np.int64), (300, np.int8), (-1, np.uint32), (1e300, np.int16)):
        with pytest.raises(ValueError, match=r"out of the range of the tensor's dtype"):
            mt.all_reduce(np.ones(3, dtype), prescale_factor=factor)
    # Float tensors take any finite or infinite float factor, as NumPy does.
    got = mt.all_reduce(np.ones(2), postscale_factor=2**70).resolve().numpy()
    assert np.array_equal(got, np.full(2, any_ctx.size * 2.0**70))
    still_usable(any_ctx)


def test_nan_factors_on_every_rank_agree(any_ctx):
    for factor in (float("nan"), complex("nan+1j")):
        dtype = np.complex128 if isinstance(factor, complex) else np.float64
        got = mt.all_reduce(np.ones(3, dtype), prescale_factor=factor).resolve().numpy()
        assert np.isnan(got).all()


def test_masked_arrays_are_refused(any_ctx):
    masked = np.ma.array([1.0, 1e20, 3.0], mask=[False, True, False])
    for call in (lambda: mt.all_reduce(masked), lambda: mt.all_reduce({"a": masked}),
                 lambda: mt.broadcast(masked), lambda: mt.all_gather(masked)):
        with pytest.raises(TypeError, match=r"numpy\.ma\.MaskedArray.*filled"):
            call()
    still_usable(any_ctx)


def test_python_ints_outside_int64_raise_overflow(ctx):
    with pytest.raises(OverflowError, match=r"Python int 18446744073709551616 is outside int64's range"):
        mt.all_reduce(2**64, "max")
    with pytest.raises(OverflowError, match=r"SUM over \d+ ranks of Python ints .* can leave int64's range"):
        mt.all_reduce(2**62)
    with pytest.raises(OverflowError, match=r"PROD over"):
        mt.all_reduce(2**40, "prod")
    assert mt.all_reduce(-(2**63), "max").resolve() == -(2**63)
    assert mt.all_reduce(2**31 + ctx.rank).resolve() == sum(2**31 + r for r in range(ctx.size))
    assert mt.all_reduce(3, "prod").resolve() == 3**ctx.size
    still_usable(ctx)


def test_a_python_int_beyond_int64_on_one_rank_fails_that_rank_and_tells_the_peers(ctx):
    if ctx.rank == 1:
        with pytest.raises(OverflowError, match="outside int64's range"):
            mt.all_reduce(2**63)
    else:
        expect_mismatch(lambda: mt.all_reduce(5), "rank 1's all_reduce failed on that rank", "OverflowError")
    still_usable(ctx)


def test_out_names_a_torch_tensor_as_torch_s(ctx):
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"got torch\.Tensor; pass a NumPy array"):
        mt.all_reduce(np.ones(3, np.float32), out=torch.zeros(3))
    still_usable(ctx)


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("no pickling of this")


class _FailsToLoad:
    def __reduce__(self):
        return (_raise_key_error, ())


def _raise_key_error():
    raise KeyError("missing on the receiver")


def test_object_collectives_say_what_cannot_be_pickled_or_unpickled(ctx):
    with pytest.raises(TypeError, match=r"_Unpicklable\) cannot be pickled: RuntimeError: no pickling of this"):
        mt.all_gather_object(_Unpicklable())
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    if ctx.rank == 0:
        with pytest.raises(TypeError, match="cannot be pickled: RecursionError"):
            mt.broadcast_object(deep, root=0)
    else:
        expect_mismatch(lambda: mt.broadcast_object(None, root=0), "rank 0's broadcast_object failed", "RecursionError")
    # The root's object unpickles to an error on every rank: each says whose object it was.
    handle = mt.broadcast_object(_FailsToLoad() if ctx.rank == 0 else None, root=0)
    with pytest.raises(TypeError, match=r"rank 0's object cannot be unpickled on this rank: KeyError"):
        handle.resolve()
    still_usable(ctx)
