"""mpitensor.jax against NumPy references from every rank's input: values, derivatives, vmap, groups, errors."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import rank_input, seed_of

pytestmark = pytest.mark.mpi(min_size=1)

jax = pytest.importorskip("jax")
jnp = jax.numpy
mtj = pytest.importorskip("mpitensor.jax")


def _input(rank, shape=(4, 3)):
    return np.arange(np.prod(shape), dtype=np.float32).reshape(shape) * (rank + 1) + rank


def _all(size, shape=(4, 3)):
    return np.stack([_input(r, shape) for r in range(size)])


@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8", "bfloat16", "float16", "complex64"])
def test_all_reduce_dtypes_jit(module_ctx, dtype):
    size, rank = module_ctx.size, module_ctx.rank
    factor = 1 + 1j if dtype == "complex64" else 1
    x = (jnp.asarray(_input(rank)) * factor).astype(dtype)
    result = jax.jit(lambda v: mtj.all_reduce(v, "sum"))(x)
    wide = np.complex128 if dtype == "complex64" else np.float64
    inputs = [np.asarray((jnp.asarray(_input(r)) * factor).astype(dtype)) for r in range(size)]
    expected = np.sum([i.astype(wide) for i in inputs], 0)
    if dtype == "uint8":
        expected = expected % 256  # integers wrap as NumPy's do
    assert result.dtype == x.dtype and result.shape == x.shape
    np.testing.assert_allclose(np.asarray(result).astype(wide), expected, rtol=1e-2 if "16" in dtype else 1e-6)


@pytest.mark.parametrize("dtype", ["float32", "int32", "int8", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "prod"])
def test_large_all_reduces_jit(module_ctx, op, dtype):
    """Above 64 KiB the input is copied into XLA's result and reduced there in place (or, where
    that cannot be, the result copied in): two in one jitted function, against NumPy."""
    size, rank = module_ctx.size, module_ctx.rank
    if op == "mean" and dtype in ("int32", "int8"):
        pytest.skip("mpitensor.jax's mean takes floating arrays")
    count = 40_000 if dtype in ("float32", "int32") else 70_000  # 140-160 KiB

    def values(r, salt):
        return rank_input(seed_of("large-jit", op, dtype, salt), r, (count,), np.float32 if dtype in (
            "float32", "bfloat16") else np.dtype(dtype))

    x, y = (jnp.asarray(values(rank, salt)).astype(dtype) for salt in (0, 1))
    first, second = jax.jit(lambda a, b: (mtj.all_reduce(a, op), mtj.all_reduce(b * 2, op)))(x, y)
    numpy_op = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min, "prod": np.prod}[op]
    for result, salt, scale in ((first, 0, 1), (second, 1, 2)):
        inputs = np.stack([np.asarray(jnp.asarray(values(r, salt)).astype(dtype) * scale).astype(np.float64)
                           for r in range(size)])
        expected = numpy_op(inputs, axis=0)
        assert result.shape == (count,)
        if dtype == "int8":  # integers wrap as NumPy's do
            expected = expected.astype(np.int64).astype(np.int8)
        got = np.asarray(result).astype(np.float64)
        np.testing.assert_allclose(got, expected, rtol=2e-2 if dtype == "bfloat16" else 1e-5, atol=1e-6)  # sums near 0


@pytest.mark.parametrize("count", [12, 40_000, 400_000])
def test_collectives_of_programs_xla_runs_on_its_own_threads(module_ctx, count):
    """Where a program computes before its collectives, XLA runs them on a thread of its own
    (above a few thousand elements): they are the owner thread's, in the program's order; an
    eager call of the same kind right after the program comes after them on every rank."""
    size, rank = module_ctx.size, module_ctx.rank
    program = jax.jit(lambda a: (mtj.all_reduce(jnp.sin(a) * 2, "sum"), mtj.all_reduce(a * 3, "sum")))
    for round_ in range(3):
        x = jnp.full(count, rank + round_, jnp.float32)
        first, second = program(x)
        eager = mt.all_reduce(np.full(count, 5.0 * (rank + 1), np.float32)).resolve().numpy()
        inputs = [np.full(count, r + round_, np.float32) for r in range(size)]
        np.testing.assert_allclose(first, np.sum([np.sin(i) * 2 for i in inputs], 0), rtol=1e-5)
        np.testing.assert_allclose(second, np.sum([i * 3 for i in inputs], 0), rtol=1e-6)
        np.testing.assert_array_equal(eager, np.full(count, 5.0 * sum(range(1, size + 1)), np.float32))


def test_mean_and_its_gradient(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    x = jnp.asarray(_input(rank))
    np.testing.assert_allclose(jax.jit(lambda v: mtj.all_reduce(v, "mean"))(x), _all(size).mean(0), rtol=1e-6)
    grad = jax.jit(jax.grad(lambda v: mtj.all_reduce(v, "mean").sum()))(x)
    np.testing.assert_allclose(grad, np.full((4, 3), 1 / size), rtol=1e-6)


def test_broadcast_gradient_is_a_reduce_to_the_root(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    root = size - 1
    x = jnp.asarray(_input(rank))
    # Each rank weighs the broadcast value by its own factor: the root's input collects them all.
    grad = jax.jit(jax.grad(lambda v: (mtj.broadcast(v, root) * (rank + 1)).sum()))(x)
    expected = np.full((4, 3), sum(r + 1 for r in range(size))) if rank == root else np.zeros((4, 3))
    np.testing.assert_array_equal(grad, expected)


def test_all_gather_tiled_and_its_gradient(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    x = jnp.asarray(_input(rank))
    tiled = jax.jit(lambda v: mtj.all_gather(v, tiled=True))(x)
    np.testing.assert_array_equal(tiled, np.concatenate(list(_all(size))))
    # Rank r weighs every gathered row by (r + 1) * row: the gradient of rank k's rows sums that over r.
    rows = np.arange(size * 4, dtype=np.float32)[:, None]
    grad = jax.jit(jax.grad(lambda v: (mtj.all_gather(v, tiled=True) * rows * (rank + 1)).sum()))(x)
    weight = sum(r + 1 for r in range(size))
    np.testing.assert_array_equal(grad, np.broadcast_to(rows[rank * 4:(rank + 1) * 4] * weight, (4, 3)))


def test_reduce_scatter_and_its_gradient(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    shape = (2 * size, 3)
    x = jnp.asarray(_input(rank, shape))
    block = jax.jit(lambda v: mtj.reduce_scatter(v, "sum"))(x)
    np.testing.assert_array_equal(block, _all(size, shape).sum(0)[2 * rank:2 * rank + 2])
    # Rank r's block is weighed by (r + 1): every rank's input gets the weights of all blocks.
    grad = jax.jit(jax.grad(lambda v: (mtj.reduce_scatter(v, "sum") * (rank + 1)).sum()))(x)
    np.testing.assert_array_equal(grad, np.repeat(np.arange(1, size + 1, dtype=np.float32), 2)[:, None] * np.ones(3))


def test_all_to_all_and_its_gradient(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    shape = (size, 2)
    x = jnp.asarray(_input(rank, shape))
    np.testing.assert_array_equal(jax.jit(mtj.all_to_all)(x), _all(size, shape)[:, rank])
    # Rank r weighs what it received from rank k by (r + 1) * (k + 1); rank k's block to r carries it back.
    weights = np.arange(1, size + 1, dtype=np.float32)[:, None] * (rank + 1)
    grad = jax.jit(jax.grad(lambda v: (mtj.all_to_all(v) * weights).sum()))(x)
    expected = np.arange(1, size + 1, dtype=np.float32)[:, None] * (rank + 1) * np.ones(2)
    np.testing.assert_array_equal(grad, expected)


def test_reduce_gradient(module_ctx):
    rank = module_ctx.rank
    x = jnp.asarray(_input(rank))
    grad = jax.jit(jax.grad(lambda v: (mtj.reduce(v, "sum", 0) * (rank + 1)).sum()))(x)
    # The root's result weighs every input by 1 (the root's factor); the others keep their own term too.
    expected = np.ones((4, 3)) * (1 if rank == 0 else 1 + rank + 1)
    np.testing.assert_array_equal(grad, expected)


def test_jvp_of_every_linear_collective(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    shape = (size, 3)
    x, t = jnp.asarray(_input(rank, shape)), jnp.asarray(_input(rank, shape) * 0 + rank + 1)
    tangents = np.stack([np.full(shape, r + 1, np.float32) for r in range(size)])
    cases = {
        mtj.all_reduce: tangents.sum(0),
        lambda v: mtj.broadcast(v, 0): tangents[0],
        mtj.all_gather: tangents,
        mtj.reduce_scatter: tangents.sum(0)[rank:rank + 1],
        mtj.all_to_all: tangents[:, rank],
    }
    for f, expected in cases.items():
        primal, tangent = jax.jit(lambda a, b, f=f: jax.jvp(f, (a,), (b,)))(x, t)
        np.testing.assert_array_equal(tangent, expected)
        np.testing.assert_array_equal(primal, f(x))


def test_vmap_of_gathers_and_exchanges(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    batch = jnp.stack([jnp.asarray(_input(rank, (size, 2))) + b for b in range(3)])
    everyone = np.stack([np.stack([_input(r, (size, 2)) + b for b in range(3)]) for r in range(size)])
    gathered = jax.jit(jax.vmap(mtj.all_gather))(batch)
    np.testing.assert_array_equal(gathered, np.moveaxis(everyone, 0, 1))
    exchanged = jax.jit(jax.vmap(mtj.all_to_all))(batch)
    np.testing.assert_array_equal(exchanged, np.moveaxis(everyone[:, :, rank], 0, 1))
    scattered = jax.jit(jax.vmap(mtj.reduce_scatter))(batch)
    np.testing.assert_array_equal(scattered, everyone.sum(0)[:, rank:rank + 1])
    scalars = jax.vmap(mtj.all_gather)(jnp.arange(3.0) + rank)
    np.testing.assert_array_equal(scalars, np.arange(3.0)[:, None] + np.arange(size)[None, :])


def test_order_kept_inside_one_program(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank

    @jax.jit
    def many(v):
        # Independent collectives of one signature: any reordering on one rank would swap results.
        return [mtj.all_reduce(v * k, "sum") for k in range(1, 9)]

    for got, k in zip(many(jnp.asarray(_input(rank))), range(1, 9)):
        np.testing.assert_array_equal(got, _all(size).sum(0) * k)


def test_sub_group(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    members = [r for r in range(size) if r % 2 == rank % 2]
    x = jnp.asarray(_input(rank))
    result = jax.jit(lambda v: mtj.all_reduce(v, "max", devices=members))(x)
    np.testing.assert_array_equal(result, _all(size)[members].max(0))
    gathered = jax.jit(lambda v: mtj.all_gather(v, devices=members))(x)
    np.testing.assert_array_equal(gathered, _all(size)[members])


def test_a_closed_over_numpy_array_is_communicated_at_every_call(module_ctx):
    size, rank = module_ctx.size, module_ctx.rank
    held = np.full(3, rank + 1.0)
    f = jax.jit(lambda scale: mtj.all_reduce(held) * scale)
    first = f(1.0)
    held[:] = 10.0 * (rank + 1)  # jit traced held as a constant: the new value is not seen
    np.testing.assert_array_equal(first, np.full(3, sum(range(1, size + 1))))
    # The collective itself runs at every call (no result is baked into the program).
    again = f(2.0)
    np.testing.assert_array_equal(again, np.full(3, 2 * sum(range(1, size + 1))))


def test_bad_arguments_are_clear(module_ctx):
    with pytest.raises(ValueError, match="unknown reduce operation 'median'"):
        mtj.all_reduce(jnp.ones(2), "median")
    with pytest.raises(TypeError, match="op='mean' needs a floating"):
        jax.jit(lambda v: mtj.all_reduce(v, "mean"))(jnp.ones(2, jnp.int32))
    with pytest.raises(NotImplementedError, match="op='max' has no derivative"):
        jax.grad(lambda v: mtj.all_reduce(v, "max").sum())(jnp.ones(2))
    if module_ctx.size > 1:
        with pytest.raises(ValueError, match="first axis of a multiple"):
            jax.jit(mtj.reduce_scatter)(jnp.ones(module_ctx.size + 1))


def test_eager_collectives_on_tracers_point_here(module_ctx):
    with pytest.raises(mt.TracedArrayError, match=r"mpitensor\.jax"):
        jax.jit(lambda v: mt.all_reduce(v).resolve())(jnp.ones(2))


@pytest.mark.mpi(min_size=2)
def test_mismatch_raises_on_every_rank(module_ctx):
    rank = module_ctx.rank
    length = 4 if rank == 0 else 8
    with pytest.raises(jax.errors.JaxRuntimeError, match="CollectiveMismatchError"):
        jax.jit(mtj.all_reduce)(jnp.ones(length)).block_until_ready()
    # The context is still usable: the check caught it before any data moved.
    np.testing.assert_array_equal(jax.jit(mtj.all_reduce)(jnp.ones(2)), np.full(2, module_ctx.size))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("length", [2, 20_000], ids=["8 B", "80 KB"])
def test_repeated_all_reduces_across_contexts(module_ctx, length):
    """Once its lane is kept a compiled all-reduce runs without its Python runner while its
    context is the innermost: in contexts opened inside the module's (of every rank, of rank
    0 alone), after they close, and met by a peer's mismatch, every result equals NumPy's."""
    compiled = jax.jit(mtj.all_reduce)

    def check(ctx, turns, salt):
        for turn in range(turns):
            inputs = [rank_input(seed_of("jit-contexts", length, salt, turn), r, (length,), np.float32)
                      for r in range(ctx.size)]
            got = np.asarray(compiled(jnp.asarray(inputs[ctx.rank])))
            np.testing.assert_allclose(got, np.sum(inputs, 0), rtol=1e-5, atol=1e-5)

    check(module_ctx, 3, "outer")
    with mt.DistributedContext.init() as inner:
        check(inner, 3, "inner")
    check(module_ctx, 3, "outer again")
    if module_ctx.rank == 0:  # a context of rank 0 alone: the outer context's lane would wait for the peers
        with mt.DistributedContext.init(devices=[0]) as alone:
            check(alone, 2, "alone")
    check(module_ctx, 2, "outer after rank 0 alone")
    other = length if module_ctx.rank == 0 else length + 1
    with pytest.raises(jax.errors.JaxRuntimeError, match="CollectiveMismatchError"):
        compiled(jnp.ones(other, jnp.float32)).block_until_ready()
    check(module_ctx, 2, "after the mismatch")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("length", [2, 20_000], ids=["8 B", "80 KB"])
def test_repeated_rooted_and_exchanging_collectives_across_contexts(module_ctx, length):
    """Compiled broadcasts, all-gathers, all-to-alls, gathers and reduces on their held lanes, as the
    all-reduce's: in nested contexts, after they close, and met by a peer's mismatch (another root, another
    length), every result equals NumPy's."""
    size, root = module_ctx.size, module_ctx.size - 1
    spread = jax.jit(lambda x: mtj.broadcast(x, root))
    gathered = jax.jit(mtj.all_gather)
    exchanged = jax.jit(lambda x: mtj.all_to_all(x.reshape(size, -1)))
    at_root = jax.jit(lambda x: mtj.gather(x, root))
    summed = jax.jit(lambda x: mtj.reduce(x, "sum", root))

    def check(ctx, turns, salt, spread=spread, gathered=gathered, root=root):
        for turn in range(turns):
            inputs = [rank_input(seed_of("jit-data", length, salt, turn), r, (length * size,), np.int32)
                      for r in range(ctx.size)]
            mine, me = jnp.asarray(inputs[ctx.rank]), ctx.rank
            np.testing.assert_array_equal(np.asarray(spread(mine)), inputs[root])
            if gathered is None:  # a context of another size than the one these were traced in
                continue
            np.testing.assert_array_equal(np.asarray(gathered(mine)), np.stack(inputs))
            np.testing.assert_array_equal(np.asarray(exchanged(mine)),
                                          np.stack([each.reshape(size, -1)[me] for each in inputs]))
            np.testing.assert_array_equal(np.asarray(at_root(mine)), np.stack(inputs) if me == root else inputs[me])
            np.testing.assert_array_equal(np.asarray(summed(mine)), np.sum(inputs, 0) if me == root else inputs[me])

    check(module_ctx, 3, "outer")
    with mt.DistributedContext.init() as inner:
        check(inner, 3, "inner")
    check(module_ctx, 2, "outer again")
    if module_ctx.rank == 0:
        with mt.DistributedContext.init(devices=[0]) as alone:
            # A broadcast from rank 0 only: a gather's result shape, the group's size when first
            # traced, stays that of the module's context for arrays of this shape.
            check(alone, 2, "alone", jax.jit(mtj.broadcast), None, 0)
    check(module_ctx, 2, "outer after rank 0 alone")
    other = length * size if module_ctx.rank == 0 else (length + 1) * size
    for compiled in (gathered, exchanged, summed):
        with pytest.raises(jax.errors.JaxRuntimeError, match="CollectiveMismatchError"):
            compiled(jnp.ones(other, jnp.int32)).block_until_ready()
    with pytest.raises(jax.errors.JaxRuntimeError, match="CollectiveMismatchError"):
        jax.jit(lambda x: mtj.broadcast(x, module_ctx.rank))(jnp.ones(length, jnp.float32)).block_until_ready()
    check(module_ctx, 2, "after the mismatches")


@pytest.mark.mpi(min_size=2)
def test_a_closed_context_is_not_kept_alive_by_the_fast_paths(module_ctx):
    """The handler's fast paths of a context are dropped when it closes: after a collection nothing holds it."""
    small, large = jax.jit(mtj.all_reduce), jax.jit(mtj.all_reduce)
    spread, gathered = jax.jit(mtj.broadcast), jax.jit(mtj.all_gather)
    with mt.DistributedContext.init() as ctx:
        for _ in range(3):
            np.testing.assert_array_equal(small(jnp.ones(2)), np.full(2, float(ctx.size)))
            np.testing.assert_array_equal(large(jnp.ones(20_000)), np.full(20_000, float(ctx.size)))
            np.testing.assert_array_equal(spread(jnp.full(4, float(ctx.rank))), np.zeros(4))
            np.testing.assert_array_equal(gathered(jnp.ones(4)), np.ones((ctx.size, 4)))
    closed = weakref.ref(ctx)
    del ctx
    gc.collect()
    assert closed() is None, [type(referrer).__name__ for referrer in gc.get_referrers(closed())]
    np.testing.assert_array_equal(large(jnp.ones(20_000)), np.full(20_000, float(module_ctx.size)))
