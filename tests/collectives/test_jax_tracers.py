"""The eager collectives under JAX transformations: a clear error, and peers are not left waiting."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import still_usable

pytestmark = pytest.mark.mpi(min_size=1)

jax = pytest.importorskip("jax")
jnp = jax.numpy

MESSAGE = r"got a traced JAX value \(\w+Tracer\).*use mpitensor\.jax's collectives inside jax\.jit/grad/vmap"

# Each collective on a JAX value x of shape (size * 2,), as the eager API is called.
CALLS = {
    "all_reduce": lambda x, size: mt.all_reduce(x),
    "all_reduce of a dict": lambda x, size: mt.all_reduce({"g": x}),
    "broadcast": lambda x, size: mt.broadcast(x, root=0),
    "reduce": lambda x, size: mt.reduce(x, root=0),
    "all_gather": lambda x, size: mt.all_gather(x),
    "reduce_scatter": lambda x, size: mt.reduce_scatter(x),
    "all_to_all": lambda x, size: mt.all_to_all(x),
    "gather": lambda x, size: mt.gather(x, 0),
    "scatter": lambda x, size: mt.scatter(x, 0),
    "scan": lambda x, size: mt.scan(x),
    "exscan": lambda x, size: mt.exscan(x),
}
TRANSFORMS = {
    "jit": lambda f, x: jax.jit(f)(x),
    "grad": lambda f, x: jax.grad(lambda y: f(y).sum())(x),
    "vmap": lambda f, x: jax.vmap(f)(x[None]),
    "jvp": lambda f, x: jax.jvp(f, (x,), (x,)),
}


def _traced(call, transform, size):
    """Run `call` on a tracer under `transform`; its error must come out as it is."""

    def body(y):
        call(y, size)
        return y

    TRANSFORMS[transform](body, jnp.ones(2 * size))


@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("name", sorted(CALLS))
def test_every_collective_on_a_tracer_says_what_to_use(module_ctx, name, transform):
    ctx = module_ctx
    with pytest.raises(mt.TracedArrayError, match=MESSAGE):
        _traced(CALLS[name], transform, ctx.size)
    # Every rank failed alike: each raised its own error, and the next call lines up.
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["all_reduce", "gather", "scatter", "scan"])
def test_a_rank_tracing_alone_takes_its_turn(module_ctx, name):
    ctx = module_ctx
    call = CALLS[name]
    if ctx.rank == 1:
        with pytest.raises(mt.TracedArrayError, match=MESSAGE):
            _traced(call, "jit", ctx.size)
    else:
        expected = rf"rank 1's {name} failed on that rank: TracedArrayError: {name} got a traced JAX value"
        with pytest.raises(mt.CollectiveMismatchError, match=expected):
            call(jnp.ones(2 * ctx.size), ctx.size).resolve()
    still_usable(ctx)


def test_outside_the_transformation_the_same_call_works(module_ctx):
    ctx = module_ctx
    mine = jnp.full(2, float(ctx.rank + 1))
    total = mt.all_reduce(mine, "sum").resolve()
    assert isinstance(total, jax.Array)
    np.testing.assert_array_equal(np.asarray(total), np.full(2, ctx.size * (ctx.size + 1) / 2))
