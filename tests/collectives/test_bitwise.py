"""BAND, BOR and BXOR in every reducing collective: integers and bools against NumPy, floats refused."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import BITWISE, SIGNED, UNSIGNED, assert_matches, rank_input, reference, seed_of

pytestmark = pytest.mark.mpi(min_size=1)

INTEGERS = [np.bool_, *SIGNED, *UNSIGNED]


def _inputs(seed: int, size: int, shape: tuple[int, ...], dtype: type) -> list[np.ndarray]:
    """Every rank's input, spread over all the bits of the dtype."""
    if np.dtype(dtype).kind == "b":
        return [rank_input(seed, r, shape, dtype) for r in range(size)]
    info = np.iinfo(dtype)
    return [np.random.default_rng([seed, r]).integers(info.min, info.max, shape, dtype, endpoint=True)
            for r in range(size)]


@pytest.mark.parametrize("dtype", INTEGERS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", BITWISE, ids=lambda o: o.name)
def test_every_reducing_collective(module_ctx, op, dtype):
    ctx = module_ctx
    n, rank = ctx.size, ctx.rank
    everyone = _inputs(seed_of("bitwise", op.name, np.dtype(dtype).name), n, (2 * n, 3), dtype)
    full = reference(op, everyone)
    assert_matches(mt.all_reduce(everyone[rank], op).resolve(), full)
    fused = mt.all_reduce({"a": everyone[rank], "b": everyone[rank][:1]}, op).resolve()
    assert_matches(fused["a"], full)
    assert_matches(fused["b"], full[:1])
    reduced = mt.reduce(everyone[rank], op, root=n - 1).resolve()
    if rank == n - 1:
        assert_matches(reduced, full)
    assert_matches(mt.reduce_scatter(everyone[rank], op).resolve(), full[2 * rank : 2 * rank + 2])
    assert_matches(mt.scan(everyone[rank], op).resolve(), reference(op, everyone[: rank + 1]))
    if rank:
        assert_matches(mt.exscan(everyone[rank], op).resolve(), reference(op, everyone[:rank]))
    else:
        mt.exscan(everyone[rank], op).resolve()


@pytest.mark.parametrize("op", BITWISE, ids=lambda o: o.name)
def test_the_shared_memory_path(op):
    """Large messages go through the node's shared memory, where NumPy does the reducing."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(shared_memory=True)) as ctx:
        everyone = _inputs(seed_of("bitwise-shm", op.name), ctx.size, (1 << 18,), np.uint32)
        assert_matches(mt.all_reduce(everyone[ctx.rank], op).resolve(), reference(op, everyone))


def test_gradient_sync_of_integer_counters(module_ctx):
    ctx = module_ctx
    sync = mt.GradientSync({"flags": np.zeros(4, np.uint8)}, op="bor")
    sync.submit("flags", np.array([1 << ctx.rank % 8, 0, 0, 0], np.uint8))
    expected = np.bitwise_or.reduce([1 << r % 8 for r in range(ctx.size)])
    assert sync.wait()["flags"].numpy().tolist() == [expected, 0, 0, 0]


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.complex64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", BITWISE, ids=lambda o: o.name)
def test_floats_are_refused_with_a_clear_error(module_ctx, op, dtype):
    message = f"{op.name} is a bitwise reduction, defined for integer and bool tensors only, got {np.dtype(dtype)}"
    values = np.ones(3, dtype)
    for call in (lambda: mt.all_reduce(values, op), lambda: mt.reduce(values, op),
                 lambda: mt.scan(values, op), lambda: mt.exscan(values, op),
                 lambda: mt.all_reduce([values], op)):
        with pytest.raises(TypeError, match=message):
            call()
    with pytest.raises(TypeError, match=message):
        mt.GradientSync({"w": values}, op=op)
    assert mt.all_reduce(np.ones(1)).resolve().item() == module_ctx.size
