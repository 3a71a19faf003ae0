"""mpitensor.jax's collectives inside jax.jit over every dtype JAX has.

Each (collective, dtype) gives NumPy's result from every rank's input, or, for a dtype MPI
and the consistency check do not carry (the packed types of fewer than 8 bits, the float8
family, float0), a TypeError on the calling rank while it traces: the peers' compiled call
then raises CollectiveMismatchError naming it, and the next collective is right.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from tests.helpers import rank_input, seed_of

pytestmark = pytest.mark.mpi(min_size=1)

jax = pytest.importorskip("jax")
jnp = jax.numpy
mtj = pytest.importorskip("mpitensor.jax")

KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter",
         "scan", "sendrecv"]
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "scan")
# The dtypes the eager collectives carry.
MOVED = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "bfloat16",
         "float32", "float64", "complex64", "complex128"]
# The other dtypes JAX has (those of this version): refused while traced.
_REFUSED = ["float8_e3m4", "float8_e4m3", "float8_e4m3b11fnuz", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2",
            "float8_e5m2fnuz", "float8_e8m0fnu", "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn", "int4", "uint4",
            "int2", "uint2", "int1", "uint1"]


def _jax_dtypes() -> set[str]:
    """Every dtype this JAX names (its scalar types), and float0."""
    named = {str(np.dtype(each.dtype)) for each in vars(jnp).values()
             if isinstance(each, type) and isinstance(getattr(each, "dtype", None), np.dtype)}
    return named | {"float0"}


REFUSED = [name for name in _REFUSED if name in _jax_dtypes()] + ["float0"]


@pytest.fixture(autouse=True)
def _x64() -> Iterator[None]:
    # JAX makes 64-bit inputs 32-bit unless asked.
    with jax.enable_x64(True):
        yield


def _dtype(name: str) -> np.dtype:
    return np.dtype(jax.dtypes.float0) if name == "float0" else np.dtype(getattr(jnp, name))


def _shape(kind: str, rank: int, size: int) -> tuple[int, ...]:
    # One row per rank: what reduce_scatter and all_to_all cut, and the root's rows of a scatter.
    return (2,) if kind == "scatter" and rank != size - 1 else (size, 2)


def _values(kind: str, name: str, rank: int, size: int) -> np.ndarray:
    """Rank `rank`'s input: small integers (and Gaussian integers), whose sums every dtype holds exactly."""
    dtype, shape = _dtype(name), _shape(kind, rank, size)
    if dtype.kind in "biu":
        return rank_input(seed_of("jax-dtypes", kind, name), rank, shape, dtype)
    real = rank_input(seed_of("jax-dtypes", kind, name), rank, shape, np.int8).astype(np.float32)
    if dtype.kind == "c":
        return (real + 1j * rank_input(seed_of("jax-dtypes", kind, name, "imag"), rank, shape, np.int8)).astype(dtype)
    return real.astype(dtype)


def _sum(arrays: list[np.ndarray]) -> np.ndarray:
    dtype = arrays[0].dtype
    if dtype.kind == "b":
        return np.logical_or.reduce(arrays)  # NumPy's sum of bools, as mpitensor reduces them
    wide = {"i": np.int64, "u": np.uint64, "c": np.complex128}.get(dtype.kind, np.float64)
    return np.sum([each.astype(wide) for each in arrays], axis=0).astype(dtype)


def _expected(kind: str, inputs: list[np.ndarray], rank: int) -> np.ndarray:
    """What rank `rank` gets from `kind`, by NumPy, from every rank's input (root: the last rank)."""
    size, root = len(inputs), len(inputs) - 1
    references: dict[str, Callable[[], np.ndarray]] = {
        "all_reduce": lambda: _sum(inputs),
        "broadcast": lambda: inputs[root],
        "reduce": lambda: _sum(inputs) if rank == root else inputs[rank],
        "all_gather": lambda: np.stack(inputs),
        "reduce_scatter": lambda: _sum(inputs)[rank:rank + 1],
        "all_to_all": lambda: np.stack([each[rank] for each in inputs]),
        "gather": lambda: np.stack(inputs) if rank == root else inputs[rank],
        "scatter": lambda: inputs[root][rank],
        "scan": lambda: _sum(inputs[:rank + 1]),
        "sendrecv": lambda: inputs[(rank - 1) % size],
    }
    return references[kind]()


@functools.cache
def _program(kind: str, rank: int, size: int) -> Any:
    """`kind` inside jax.jit, its root the last rank, a sendrecv a ring (one program per kind: compiled once)."""
    root, before, after = size - 1, (rank - 1) % size, (rank + 1) % size
    calls: dict[str, Callable[[Any], Any]] = {
        "all_reduce": lambda x: mtj.all_reduce(x, "sum"),
        "broadcast": lambda x: mtj.broadcast(x, root),
        "reduce": lambda x: mtj.reduce(x, "sum", root),
        "all_gather": mtj.all_gather,
        "reduce_scatter": lambda x: mtj.reduce_scatter(x, "sum"),
        "all_to_all": mtj.all_to_all,
        "gather": lambda x: mtj.gather(x, root),
        "scatter": lambda x: mtj.scatter(x, root),
        "scan": lambda x: mtj.scan(x, "sum"),
        "sendrecv": lambda x: mtj.sendrecv(x, x, before, after),
    }
    return jax.jit(calls[kind])


_next = jax.jit(lambda x: mtj.all_reduce(x, "sum"))


def _next_is_right(ctx: Any) -> None:
    got = _next(jnp.full(2, ctx.rank + 1.0, jnp.float32))
    np.testing.assert_array_equal(np.asarray(got), np.full(2, sum(range(1, ctx.size + 1)), np.float32))


def test_the_grid_has_every_dtype_of_this_jax():
    missing = _jax_dtypes() - set(MOVED) - set(REFUSED)
    assert not missing, f"JAX has dtypes the grid does not try: {sorted(missing)}; add each to MOVED or _REFUSED"


@pytest.mark.parametrize("name", MOVED)
@pytest.mark.parametrize("kind", KINDS)
def test_a_carried_dtype_gives_numpys_result(module_ctx, kind, name):
    size, rank = module_ctx.size, module_ctx.rank
    inputs = [_values(kind, name, r, size) for r in range(size)]
    got = np.asarray(_program(kind, rank, size)(inputs[rank]))
    expected = _expected(kind, inputs, rank)
    assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("name", REFUSED)
@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_dtype_raises_while_traced_and_fails_the_peers(module_ctx, kind, name):
    """One rank (another one per kind) passes the dtype and raises TypeError before any data
    moves; its peers, which pass int8 arrays, raise CollectiveMismatchError naming it. Every
    rank passes it to a sendrecv, whose two sides pair no turns (both sides refuse it)."""
    size, rank = module_ctx.size, module_ctx.rank
    refuser = KINDS.index(kind) % size
    refuses = kind == "sendrecv" or rank == refuser
    x = np.zeros(_shape(kind, rank, size), _dtype(name) if refuses else np.int8)
    refusal = f"mpitensor.jax.{kind} cannot communicate {name} arrays: "
    if refuses:
        with pytest.raises(TypeError, match=re.escape(refusal)):
            _program(kind, rank, size)(x)
    else:
        with pytest.raises(jax.errors.JaxRuntimeError, match="CollectiveMismatchError") as failed:
            _program(kind, rank, size)(x).block_until_ready()
        assert f"rank {refuser}'s {kind} failed on that rank: TypeError: {refusal}" in str(failed.value)
    _next_is_right(module_ctx)


@pytest.mark.parametrize("kind", REDUCING)
def test_a_reduction_a_dtype_lacks_raises_while_traced(module_ctx, kind):
    """A bitwise reduction of floats on one rank is refused as that rank traces, inside the door:
    the peers reducing integers raise CollectiveMismatchError naming it. (Refused as the program
    is lowered, outside the door, a reduce's peers would pair it with that rank's next collective.)"""
    size, rank = module_ctx.size, module_ctx.rank
    refuser = REDUCING.index(kind) % size
    x = np.ones((size, 2), np.float32 if rank == refuser else np.int32)
    calls = {"all_reduce": lambda v: mtj.all_reduce(v, "band"), "reduce": lambda v: mtj.reduce(v, "band", size - 1),
             "reduce_scatter": lambda v: mtj.reduce_scatter(v, "band"), "scan": lambda v: mtj.scan(v, "band")}
    refusal = (f"mpitensor.jax.{kind}: BAND is a bitwise reduction, defined for integer and bool tensors only, "
               "got float32")
    if rank == refuser:
        with pytest.raises(TypeError, match=re.escape(refusal)):
            jax.jit(calls[kind])(x)
    else:
        with pytest.raises(jax.errors.JaxRuntimeError, match="CollectiveMismatchError") as failed:
            jax.jit(calls[kind])(x).block_until_ready()
        assert f"rank {refuser}'s {kind} failed on that rank: TypeError: {refusal}" in str(failed.value)
    _next_is_right(module_ctx)


@pytest.mark.parametrize("kind", ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
                                  "sendrecv"])
def test_the_tangent_of_an_integer_input_is_a_float0_zero_without_a_collective(module_ctx, kind):
    """jvp of a collective of integers: NumPy's result, and a float0 zero tangent (no data, nothing
    communicated: the next collective pairs with the peers' next one)."""
    size, rank = module_ctx.size, module_ctx.rank
    inputs = [_values(kind, "int32", r, size) for r in range(size)]
    zero = np.zeros(inputs[rank].shape, jax.dtypes.float0)
    primal, tangent = jax.jit(lambda x: jax.jvp(_program(kind, rank, size), (x,), (zero,)))(inputs[rank])
    expected = _expected(kind, inputs, rank)
    np.testing.assert_array_equal(np.asarray(primal), expected)
    assert tangent.dtype == jax.dtypes.float0 and tangent.shape == expected.shape
    _next_is_right(module_ctx)


def test_the_handler_refuses_a_packed_buffer(module_ctx):
    """A packed buffer that reaches the handler untraced (a custom call of its own) is refused before
    any view of it: one byte per value would reach past XLA's buffer. Nothing is communicated."""
    from mpitensor.jax import _handler

    _handler.register()
    call = jax.ffi.ffi_call(_handler.TARGET, jax.ShapeDtypeStruct((3,), jnp.int4), has_side_effect=True)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"TypeError: mpitensor\.jax: XLA data type 21 is packed"):
        jax.jit(lambda v: call(v, site=np.int64(0)))(np.zeros(3, jnp.int4)).block_until_ready()
    _next_is_right(module_ctx)
