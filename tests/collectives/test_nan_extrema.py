"""MAX and MIN with NaN, infinities and signed zeros: NumPy's semantics on every path, and
the same bits on every rank.

A NaN on any rank makes the element NaN (``np.maximum``/``np.minimum``), whichever path the
message takes: the small-message path, MPI's all-reduce (checked or posted at once), the
shared-memory all-reduce, the fused all-reduce, `reduce`, `reduce_scatter` and
`GradientSync`. The result is one defined bit pattern, so every rank gets the same bits:
a NaN is the canonical quiet NaN (positive for MAX, negative for MIN, in both parts of a
complex number), and of operands that compare equal, +0.0 wins MAX and -0.0 wins MIN.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import mpitensor as mt
from mpitensor._transport import shm as _shm
from mpitensor._transport.mpi import SMALL_BYTES
from mpitensor._transport.shm.arena import Lease
from tests.helpers import (
    ALL_DTYPES,
    ARITHMETIC,
    OP,
    every_rank_settings,
    kept_plan,
    rank_input,
    reference,
    seed_of,
    tolerance,
)

try:
    import ml_dtypes
except ImportError:  # bfloat16 is optional
    ml_dtypes = None

pytestmark = pytest.mark.mpi(min_size=1)

BF16 = [np.dtype(ml_dtypes.bfloat16)] if ml_dtypes is not None else []
FLOATS = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64), *BF16]
COMPLEX = [np.dtype(np.complex64), np.dtype(np.complex128)]
DTYPES = FLOATS + COMPLEX
EXTREMA = [OP.MAX, OP.MIN]
_UFUNC = {OP.MAX: np.maximum, OP.MIN: np.minimum}

# The paths a message can take, by configuration (and size: see SIZES).
PATHS = {
    "default": mt.DistributedConfig(),  # checked; shared memory from 512 KiB
    "unchecked": mt.DistributedConfig(check=False),  # posted at once, bypassing the queue
    "no_shm": mt.DistributedConfig(shared_memory=False),  # MPI's all-reduce at every size
    "shm": mt.DistributedConfig(shared_memory=True),  # shared memory at every size but the smallest
}
# 8 bytes (the small path), 64 KiB (MPI's all-reduce), 1 MiB + 24 (shared memory by default).
SIZES = [8, 64 << 10, (1 << 20) + 24]


def _ids(value: object) -> str:
    return value.name if isinstance(value, (np.dtype, OP)) else str(value)


# -- inputs and references --------------------------------------------------------------


def _part_dtype(dtype: np.dtype) -> np.dtype:
    """The real dtype of one part of `dtype` (the dtype itself for floats)."""
    return np.dtype(f"f{dtype.itemsize // 2}") if dtype.kind == "c" else dtype


def _special_parts(seed: int, rank: int, count: int, dtype: np.dtype) -> np.ndarray:
    """Floats of `dtype` with NaNs (some with the sign bit or a payload), infinities and
    signed zeros, at positions that differ between ranks; ordinary values elsewhere."""
    rng = np.random.default_rng([seed, rank])
    values = rng.uniform(-4, 4, count)
    kind = rng.integers(0, 16, count)
    values[kind == 0] = np.nan
    values[kind == 1] = -np.nan
    values[kind == 2] = np.inf
    values[kind == 3] = -np.inf
    values[kind == 4] = 0.0
    values[kind == 5] = -0.0
    values[kind == 6] = 1.0  # equal on many ranks
    # A few fixed patterns: a NaN on one rank only, zeros of both signs across ranks.
    fixed = [np.nan if rank == 0 else 1.0, -0.0 if rank % 2 else 0.0, -0.0, 0.0, -np.inf, np.inf]
    head = min(count, len(fixed))
    values[:head] = fixed[:head]
    out = values.astype(dtype)
    if dtype.itemsize in (4, 8) and dtype.kind == "f":
        # A NaN with a payload, and a negative one with a payload, on some ranks.
        ints = out.view(f"u{dtype.itemsize}")
        nan_bits = np.array(np.nan, dtype).view(ints.dtype)
        sign = np.array(-0.0, dtype).view(ints.dtype)
        payload = (kind == 7) & (rng.random(count) < 0.5)
        ints[payload] = nan_bits | 1
        ints[(kind == 8) & (rng.random(count) < 0.5)] = nan_bits | sign | 3
    return out


def special_input(seed: int, rank: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """Rank `rank`'s input for test `seed`: specials and ordinary values, the same wherever computed."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    part = _part_dtype(dtype)
    if dtype.kind == "c":
        real = _special_parts(seed, rank, count, part)
        imag = _special_parts(seed + 1, rank, count, part)
        out = np.empty(count, dtype)
        out.view(part).reshape(count, 2)[:, 0] = real
        out.view(part).reshape(count, 2)[:, 1] = imag
        return out.reshape(shape)
    return _special_parts(seed, rank, count, dtype).reshape(shape)


def canonical_nan(op: mt.ReduceOperation, dtype: np.dtype) -> np.ndarray:
    """The one NaN MAX (positive quiet NaN) or MIN (negative) gives, as a 0-d array."""
    part = np.array(np.nan if op is OP.MAX else -np.nan, _part_dtype(dtype))
    if dtype.kind != "c":
        return part
    both = np.empty((), dtype)
    both.reshape(1).view(part.dtype)[:] = part
    return both


def _words(array: np.ndarray) -> np.ndarray:
    """The bits of each element as unsigned words, of shape ``array.shape + (words per element,)``."""
    size = array.dtype.itemsize
    word = size // 2 if array.dtype.kind == "c" else min(size, 8)
    flat = np.ascontiguousarray(array).reshape(-1).view(f"u{word}")
    return flat.reshape(*array.shape, size // word)


def extremum_reference(op: mt.ReduceOperation, arrays: list[np.ndarray]) -> np.ndarray:
    """The exact result: NumPy's extremum, where a NaN is the canonical one and operands
    equal to the result merge their bits (AND for MAX: +0.0 wins; OR for MIN: -0.0 wins)."""
    with np.errstate(invalid="ignore"):  # bfloat16's loops flag NaN operands
        value = functools.reduce(_UFUNC[op], arrays)
        stack = np.stack(arrays)
        top = stack == value
    words = _words(stack)
    words = words.reshape(len(arrays), value.size, words.shape[-1])
    top = top.reshape(len(arrays), value.size, 1)
    if op is OP.MAX:
        merged = np.bitwise_and.reduce(np.where(top, words, np.iinfo(words.dtype).max), axis=0)
    else:
        merged = np.bitwise_or.reduce(np.where(top, words, 0), axis=0)
    result = np.ascontiguousarray(merged).view(value.dtype).reshape(value.shape)
    result[np.isnan(value)] = canonical_nan(op, value.dtype)
    return result


def assert_same_bits(got: mt.Tensor | np.ndarray, expected: np.ndarray, what: str = "") -> None:
    """`got` has `expected`'s shape, dtype and bits, and NumPy's values (NaN where NumPy has NaN)."""
    got = np.asarray(got)
    assert got.shape == expected.shape and got.dtype == expected.dtype, (what, got.shape, got.dtype)
    same = _words(got) == _words(expected)
    if not same.all():
        where = np.argwhere(~same.reshape(got.size, same.shape[-1]).all(axis=1))[:5, 0]
        flat_got, flat_expected = got.reshape(-1), expected.reshape(-1)
        pairs = [(int(i), flat_got[i], flat_expected[i]) for i in where]
        raise AssertionError(f"{what}: bits differ at (index, got, expected) {pairs}")


def assert_numpy_semantics(got: mt.Tensor | np.ndarray, op: mt.ReduceOperation, arrays: list[np.ndarray]) -> None:
    """NaN exactly where NumPy has NaN, NumPy's values elsewhere."""
    got = np.asarray(got)
    with np.errstate(invalid="ignore"):
        expected = functools.reduce(_UFUNC[op], arrays)
    if got.dtype.kind == "V":  # NumPy's testing knows no bfloat16 NaN
        got, expected = got.astype(np.float32), expected.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    np.testing.assert_array_equal(got, expected)


def gathered_bytes(ctx: mt.DistributedContext, array: np.ndarray | None) -> list[bytes | None]:
    """Every rank's `array` as bytes (None for ranks without one), on every rank."""
    return ctx.comm.allgather(None if array is None else np.ascontiguousarray(array).tobytes())


def identical_on_every_rank(ctx: mt.DistributedContext, array: np.ndarray) -> bool:
    """Whether every rank has the same bits as `array` (a collective call)."""
    everyone = gathered_bytes(ctx, np.asarray(array))
    return all(b == everyone[0] for b in everyone)


def via_shared_memory(result: mt.Tensor) -> bool:
    """True when the result lives in a block of this rank's shared memory."""
    array = result.numpy()
    while array is not None:
        if isinstance(array, Lease):
            return True
        array = getattr(array, "base", None)
    return False


def _count(nbytes: int, dtype: np.dtype) -> int:
    return max(1, nbytes // dtype.itemsize)


# -- all_reduce on every path ---------------------------------------------------------------


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_all_reduce_propagates_nan_with_the_same_bits_everywhere(module_ctx, op, dtype, nbytes, path):
    seed = seed_of("all_reduce", op.name, dtype.name, nbytes, path)
    shape = (_count(nbytes, dtype),)
    with mt.DistributedContext.init(config=PATHS[path]) as ctx:
        everyone = [special_input(seed, r, shape, dtype) for r in range(ctx.size)]
        # Every collective first, the checks after: a rank that fails leaves none waiting.
        got = mt.all_reduce(mt.tensor(everyone[ctx.rank]), op).resolve()
        also = mt.all_reduce(everyone[ctx.rank], op).resolve()  # a bare array (the shortest path)
        identical = identical_on_every_rank(ctx, got.numpy())
        assert got.dtype == dtype
        assert_same_bits(got, extremum_reference(op, everyone), f"{op.name} {dtype} {nbytes} B {path}")
        assert_same_bits(also, extremum_reference(op, everyone), "bare array")
        assert_numpy_semantics(got, op, everyone)
        assert identical, "ranks got different bits"
        # The path taken: shared memory for floats past the small-message size, where allowed.
        shared = ctx.size > 1 and dtype.kind == "f" and nbytes > SMALL_BYTES and (
            path == "shm" or (path != "no_shm" and nbytes >= _shm.min_bytes()))
        assert via_shared_memory(got) == shared


# Repeated calls of one kind take their lane (compiled where built): carried in the check
# (8 bytes), or MPI's all-reduce of keys on a copy (1 KiB, 64 KiB).
LANE_SIZES = [8, 1 << 10, SMALL_BYTES]


def _late(ctx: mt.DistributedContext, turn: int) -> None:
    """The last rank comes late to odd calls: its peers' checks do not agree at once, and the engine takes over."""
    if ctx.size > 1 and ctx.rank == ctx.size - 1 and turn % 2:
        time.sleep(0.01)


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
@pytest.mark.parametrize("nbytes", LANE_SIZES)
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)], ids=_ids)
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_repeated_calls_on_their_lane_give_the_same_bits(module_ctx, op, dtype, nbytes, check):
    """Six calls of one kind, a late rank at every other: the lanes' keys, their decoding and the
    rows reduced in C give the general path's bits, whether the check agreed at once or not."""
    shape = (_count(nbytes, dtype),)
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        results, expected = [], []
        for turn in range(6):
            everyone = [special_input(seed_of("lane", op.name, dtype.name, nbytes, check, turn), r, shape, dtype)
                        for r in range(ctx.size)]
            mine = everyone[ctx.rank].copy()
            _late(ctx, turn)
            pending = mt.all_reduce(mine, op)
            mine[...] = 0  # the call copied (or carried) it
            results.append(pending.resolve().numpy())
            expected.append(extremum_reference(op, everyone))
        on_lane = kept_plan(ctx, "all_reduce", dtype, shape, op) is not None
        identical = identical_on_every_rank(ctx, np.concatenate(results))
    for turn, (got, want) in enumerate(zip(results, expected)):
        assert_same_bits(got, want, f"call {turn}")
    assert identical, "ranks got different bits"
    if ctx.size > 1:
        assert on_lane, "repeated MAX/MIN calls of floats keep a lane"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=_ids)
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_a_lane_call_meets_a_call_into_out(module_ctx, op, dtype):
    """Rank 0 writes into out= (its row carries no input), the others call on their lane (their rows
    carry it): every member sees a row without input, and MPI reduces keys, which each side decodes."""
    shape = (2,)
    with mt.DistributedContext.init() as ctx:
        for turn in range(4):
            everyone = [special_input(seed_of("lane out", op.name, dtype.name, turn), r, shape, dtype)
                        for r in range(ctx.size)]
            mine = everyone[ctx.rank].copy()
            if ctx.rank == 0 and turn >= 2:
                out = np.empty(shape, dtype)
                mt.all_reduce(mine, op, out=out).resolve()
                got = out
            else:
                got = mt.all_reduce(mine, op).resolve().numpy()
            assert_same_bits(got, extremum_reference(op, everyone), f"call {turn}")


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16)], ids=_ids)
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_shared_memory_and_mpi_give_the_same_bits(module_ctx, op, dtype):
    seed = seed_of("paths agree", op.name, dtype.name)
    shape = (_count(SIZES[-1], dtype),)
    results = {}
    for path in ("shm", "no_shm"):
        with mt.DistributedContext.init(config=PATHS[path]) as ctx:
            mine = special_input(seed, ctx.rank, shape, dtype)
            results[path] = mt.all_reduce(mine, op).resolve().numpy()
    assert_same_bits(results["shm"], results["no_shm"], "shared memory against MPI")


@pytest.mark.parametrize("node_size", [1, 2])
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_hierarchical_shared_memory(module_ctx, monkeypatch, op, node_size):
    # Pseudo-nodes of `node_size` ranks: node sums, then the leaders' exchange (which
    # reduces with the same NumPy function), then the copy from the leader.
    monkeypatch.setenv("MPITENSOR_SHM_NODE_SIZE", str(node_size))
    seed = seed_of("hierarchical", op.name, node_size)
    results = []
    with mt.DistributedContext.init(config=PATHS["shm"]) as ctx:
        for dtype, count in ((np.dtype(np.float32), 70001), (np.dtype(np.float64), 5)):
            everyone = [special_input(seed, r, (count,), dtype) for r in range(ctx.size)]
            got = mt.all_reduce(everyone[ctx.rank], op).resolve()
            results.append((everyone, got, identical_on_every_rank(ctx, got.numpy())))
    for everyone, got, identical in results:
        assert identical, "ranks got different bits"
        assert_same_bits(got, extremum_reference(op, everyone), f"{op.name} {got.dtype} nodes of {node_size}")


@pytest.mark.parametrize("shape", [(), (1,), (3, 4)], ids=str)
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_byte_swapped_and_strided_inputs(module_ctx, op, shape):
    ctx = module_ctx
    seed = seed_of("layout", op.name, shape)
    everyone = [special_input(seed, r, shape, np.dtype(np.float64)) for r in range(ctx.size)]
    expected = extremum_reference(op, everyone)
    swapped = mt.all_reduce(everyone[ctx.rank].astype(">f8"), op).resolve()
    if shape == (3, 4):
        wide = [np.repeat(a, 2, axis=1) for a in everyone]
        strided = mt.all_reduce(wide[ctx.rank][:, ::2], op).resolve()
        assert_same_bits(strided, expected, "strided")
    assert_same_bits(swapped, expected, "byte-swapped")


# -- signed zeros and infinities, one by one ----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("nbytes", [8, 64 << 10])
def test_signed_zeros_and_infinities_are_deterministic(module_ctx, dtype, nbytes):
    ctx = module_ctx
    count = max(4, _count(nbytes, dtype))
    odd = ctx.rank % 2 == 1
    # Element 0: -0.0 on even ranks, +0.0 on odd ones. 1: -0.0 everywhere. 2: +0.0 everywhere.
    # 3: -inf on rank 0, +inf elsewhere.
    mine = np.zeros(count, dtype)
    parts_of_mine = mine.view(_part_dtype(mine.dtype)).reshape(count, -1)  # both parts of a complex
    parts_of_mine[0] = 0.0 if odd else -0.0
    parts_of_mine[1] = -0.0
    mine[3] = -np.inf if ctx.rank == 0 else np.inf
    neg = {OP.MAX: ctx.size == 1, OP.MIN: True}  # the sign of element 0
    results = {op: mt.all_reduce(mine, op).resolve().numpy() for op in EXTREMA}
    identical = [identical_on_every_rank(ctx, got) for got in results.values()]
    assert all(identical), "ranks got different bits"
    for op, got in results.items():
        parts = got.view(_part_dtype(got.dtype)).reshape(count, -1).astype(np.float64)
        assert (np.signbit(parts[0]) == neg[op]).all(), (op.name, parts[0])
        assert np.signbit(parts[1]).all() and not np.signbit(parts[2]).any()
        assert parts[1][0] == 0.0 and parts[2][0] == 0.0
        if op is OP.MAX:
            assert parts[3][0] == (np.inf if ctx.size > 1 else -np.inf)
        else:
            assert parts[3][0] == -np.inf


@pytest.mark.parametrize("dtype", FLOATS, ids=_ids)
def test_nan_bits_are_canonical(module_ctx, dtype):
    ctx = module_ctx
    mine = np.array([np.nan, -np.nan, 1.0, np.nan], dtype)
    if ctx.rank != 0:
        mine[3] = 1.0
    results = {op: mt.all_reduce(mine, op).resolve().numpy() for op in EXTREMA}
    for op, got in results.items():
        nan = canonical_nan(op, np.dtype(dtype))
        assert_same_bits(got[[0, 1, 3]], np.stack([nan, nan, nan]), op.name)
        assert np.signbit(got[0].astype(np.float32)) == (op is OP.MIN)


# -- the other reducing collectives ---------------------------------------------------------


@pytest.mark.parametrize("path", ["default", "unchecked", "no_shm"])
@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_fused_all_reduce(module_ctx, op, bucket_bytes, path):
    seed = seed_of("fused", op.name, bucket_bytes, path)
    specs = [((5,), dtype) for dtype in DTYPES] + [((3, 7), np.dtype(np.float32)), ((), np.dtype(np.float64)),
                                                   ((4,), np.dtype(np.int32)), ((40000,), np.dtype(np.float32))]
    config = mt.DistributedConfig(check=PATHS[path].check, shared_memory=PATHS[path].shared_memory,
                                  bucket_bytes=bucket_bytes)
    with mt.DistributedContext.init(config=config) as ctx:
        everyone = [[special_input(seed + i, r, shape, dtype) if dtype.kind in "fcV" else
                     rank_input(seed + i, r, shape, dtype) for i, (shape, dtype) in enumerate(specs)]
                    for r in range(ctx.size)]
        mine = everyone[ctx.rank]
        got = mt.all_reduce(mine, op).resolve()
        named = mt.all_reduce({f"t{i}": x for i, x in enumerate(mine)}, op).resolve()
        identical = identical_on_every_rank(ctx, np.concatenate([t.numpy().reshape(-1).view(np.uint8) for t in got]))
        for i, (shape, dtype) in enumerate(specs):
            column = [inputs[i] for inputs in everyone]
            expected = extremum_reference(op, column) if dtype.kind in "fcV" else reference(op, column)
            assert_same_bits(got[i], expected, f"tensor {i} ({dtype}, {shape})")
            assert_same_bits(named[f"t{i}"], expected, f"named tensor {i}")
        assert identical, "ranks got different bits"


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_reduce(module_ctx, op, dtype, nbytes):
    ctx = module_ctx
    seed = seed_of("reduce", op.name, dtype.name, nbytes)
    shape = (_count(nbytes, dtype),)
    everyone = [special_input(seed, r, shape, dtype) for r in range(ctx.size)]
    root = ctx.size - 1
    got = mt.reduce(mt.tensor(everyone[ctx.rank]), op, root=root).resolve()
    if ctx.rank != root:
        assert got is None
        return
    assert_same_bits(got, extremum_reference(op, everyone), f"reduce {op.name} {dtype} {nbytes} B")
    assert_numpy_semantics(got, op, everyone)


@pytest.mark.parametrize("nbytes", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_ids)
@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_reduce_scatter(module_ctx, op, dtype, nbytes):
    ctx = module_ctx
    seed = seed_of("reduce_scatter", op.name, dtype.name, nbytes)
    block = _count(nbytes, dtype)
    shape = (ctx.size * block, 2)
    everyone = [special_input(seed, r, shape, dtype) for r in range(ctx.size)]
    got = mt.reduce_scatter(everyone[ctx.rank], op).resolve()
    blocks = gathered_bytes(ctx, got.numpy())
    full = extremum_reference(op, everyone)
    assert_same_bits(got, full[ctx.rank * block : (ctx.rank + 1) * block], f"block {ctx.rank}")
    assert b"".join(blocks) == full.tobytes()


@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_gradient_sync(module_ctx, op):
    ctx = module_ctx
    seed = seed_of("gradient sync", op.name)
    specs = {"w": ((6, 5), np.float32), "h": ((9,), np.float16), "b": ((3,), np.float64), "big": ((70000,), np.float32)}
    everyone = [{name: special_input(seed + i, r, shape, np.dtype(dtype)) for i, (name, (shape, dtype))
                 in enumerate(specs.items())} for r in range(ctx.size)]
    sync = mt.GradientSync(specs, op=op, bucket_bytes=256)
    steps = []
    for _ in range(2):  # a second step reuses the buckets
        for name in reversed(specs):
            sync.submit(name, everyone[ctx.rank][name])
        steps.append(sync.wait())
    for got in steps:
        for name in specs:
            expected = extremum_reference(op, [inputs[name] for inputs in everyone])
            assert_same_bits(got[name], expected, name)


@pytest.mark.parametrize("op", EXTREMA, ids=_ids)
def test_long_double(module_ctx, op):
    ctx = module_ctx
    dtype = np.dtype(np.longdouble)
    cases = []
    for nbytes in (16, 64 << 10):
        seed = seed_of("longdouble", op.name, nbytes)
        shape = (_count(nbytes, dtype),)
        everyone = [special_input(seed, r, shape, np.dtype(np.float64)).astype(dtype) for r in range(ctx.size)]
        got = mt.all_reduce(everyone[ctx.rank], op).resolve().numpy()
        # The value is the same on every rank, sign of zero and NaN included (padding bytes
        # of x87 extended precision carry no value).
        parts = np.stack([got.astype(np.float64), np.signbit(got).astype(np.float64)])
        cases.append((everyone, got, identical_on_every_rank(ctx, parts)))
    for everyone, got, identical in cases:
        assert identical, "ranks got different values"
        assert_numpy_semantics(got, op, everyone)
        zeros = got == 0
        expected = extremum_reference(op, [a.astype(np.float64) for a in everyone])
        np.testing.assert_array_equal(np.signbit(got[zeros]), np.signbit(expected[zeros]))


# -- random collectives: the same bits on every rank, and NumPy's result ------------------

SETTINGS = every_rank_settings(50)
KINDS = ["all_reduce", "fused", "reduce", "reduce_scatter"]


def _agree(ctx: mt.DistributedContext, problem: str | None, what: str) -> None:
    """Every rank learns whether any rank found a problem, and all fail together."""
    problems = [p for p in ctx.comm.allgather(problem) if p]
    assert not problems, f"{what}: {problems}"


def _check(got: np.ndarray, op: mt.ReduceOperation, inputs: list[np.ndarray]) -> str | None:
    """None if `got` is right: exact for MAX/MIN and integers, to round-off for float sums."""
    expected_dtype = np.dtype(np.float64) if op is OP.MEAN and inputs[0].dtype.kind in "biu" else inputs[0].dtype
    if got.dtype != expected_dtype or got.shape != inputs[0].shape:
        return f"dtype/shape {got.dtype} {got.shape}"
    kind = inputs[0].dtype.kind
    if op in EXTREMA and kind in "fcV":
        try:
            assert_same_bits(got, extremum_reference(op, inputs))
        except AssertionError as exc:
            return str(exc)
        return None
    if kind == "V":  # bfloat16 sums: reduced in float32 and rounded once
        wide = [x.astype(np.float32) for x in inputs]
        expected = reference(op, wide)
        close = np.allclose(got.astype(np.float32), expected, rtol=2**-6 * len(inputs), atol=2**-6 * len(inputs))
        return None if close else "not close to NumPy's"
    expected = reference(op, inputs)
    if kind not in "fc" or op in EXTREMA:
        return None if np.array_equal(got, expected, equal_nan=True) else "not NumPy's result"
    tol = tolerance(expected.dtype, len(inputs))
    return None if np.allclose(got, expected, rtol=tol, atol=tol, equal_nan=True) else "not close to NumPy's"


@SETTINGS
@given(
    kind=st.sampled_from(KINDS),
    op=st.sampled_from(ARITHMETIC),
    dtype=st.sampled_from([np.dtype(d) for d in ALL_DTYPES] + BF16),
    shape=array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=6),
    path=st.sampled_from(list(PATHS)),
    large=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_reductions_are_identical_on_every_rank(module_ctx, kind, op, dtype, shape, path, large, seed):
    size = module_ctx.size
    if large:  # past the small-message path (and, by default, into shared memory)
        shape = ((600 << 10) // dtype.itemsize // size * size,)
    if kind == "reduce_scatter":
        shape = (size * (shape[0] if shape else 1), *shape[1:])
    extremum = op in EXTREMA and dtype.kind in "fcV"
    with mt.DistributedContext.init(config=PATHS[path]) as ctx:
        if extremum:
            everyone = [special_input(seed, r, shape, dtype) for r in range(size)]
        elif dtype.kind == "V":
            everyone = [rank_input(seed, r, shape, np.float32).astype(dtype) for r in range(size)]
        else:
            everyone = [rank_input(seed, r, shape, dtype) for r in range(size)]
        mine = everyone[ctx.rank]
        problem = None
        if kind == "all_reduce":
            got = mt.all_reduce(mine, op).resolve().numpy()
            problem = _check(got, op, everyone)
            everyone_got = gathered_bytes(ctx, got)
        elif kind == "fused":
            other = [rank_input(seed + 1, r, (3,), np.float64) for r in range(size)]
            got, second = (t.numpy() for t in mt.all_reduce([mine, other[ctx.rank]], op).resolve())
            problem = _check(got, op, everyone) or _check(second, op, other)
            everyone_got = gathered_bytes(ctx, np.concatenate([got.reshape(-1).view(np.uint8),
                                                               second.view(np.uint8)]))
        elif kind == "reduce":
            root = seed % size
            result = mt.reduce(mine, op, root=root).resolve()
            got = None if result is None else result.numpy()
            if (got is None) != (ctx.rank != root):
                problem = "result on the wrong rank"
            elif got is not None:
                problem = _check(got, op, everyone)
            everyone_got = [b"" for _ in range(size)]
        else:
            got = mt.reduce_scatter(mine, op).resolve().numpy()
            block = shape[0] // size
            # Reassembled from every rank's block, the result is the full reduction.
            blocks = gathered_bytes(ctx, got)
            full = np.frombuffer(b"".join(blocks), got.dtype).reshape(size * block, *shape[1:])
            problem = _check(full, op, everyone)
            everyone_got = [b"" for _ in range(size)]
        if problem is None and any(b != everyone_got[0] for b in everyone_got):
            problem = "ranks got different bits"
        _agree(ctx, problem, f"{kind} {op.name} {dtype} {shape} {path}")
