"""GradientSync: bucketed gradient averaging, started as gradients arrive."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import OP, assert_matches, in_shared_memory, rank_input, reference, seed_of

pytestmark = pytest.mark.mpi(min_size=1)

PARAMS = {
    "w1": ((64, 32), np.float64),
    "b1": ((32,), np.float64),
    "w2": ((32, 10), np.float64),
    "b2": ((10,), np.float64),
    "steps": ((), np.int64),
}


def _grad(step: int, name: str, rank: int) -> np.ndarray:
    shape, dtype = PARAMS[name]
    return rank_input(seed_of("grad", step, name), rank, shape, dtype)


@pytest.mark.parametrize("bucket_bytes", [100, 4096, None])
def test_same_gradients_as_a_blocking_all_reduce_of_each(module_ctx, bucket_bytes):
    ctx = module_ctx
    sync = mt.GradientSync(PARAMS, bucket_bytes=bucket_bytes)
    for step in range(3):
        for name in reversed(PARAMS):  # backward order
            sync.submit(name, _grad(step, name, ctx.rank))
        reduced = sync.wait()
        assert list(reduced) == list(PARAMS)
        for name in PARAMS:
            blocking = mt.all_reduce(_grad(step, name, ctx.rank), OP.MEAN).resolve()
            expected = reference(OP.MEAN, [_grad(step, name, r) for r in range(ctx.size)])
            assert_matches(reduced[name], expected, OP.MEAN, ctx.size)
            np.testing.assert_array_equal(reduced[name].numpy(), blocking.numpy())


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [OP.MEAN, OP.MAX])
def test_large_buckets_reduce_in_shared_memory(module_ctx, op):
    """Buckets the shared-memory transport takes reduce there (MAX of floats stays on MPI)."""
    ctx = module_ctx
    params = {"w": ((300, 200), np.float32), "b": ((200,), np.float32), "n": ((40_000,), np.int64)}
    config = mt.DistributedConfig(shared_memory=True)
    with mt.DistributedContext.init(config=config):
        sync = mt.GradientSync(params, op=op, bucket_bytes=250_000)
        assert sync.bucket_names == [["n"], ["b", "w"]]
        for step in range(2):
            grads = {name: [rank_input(seed_of("large", step, name), r, shape, dtype) for r in range(ctx.size)]
                     for name, (shape, dtype) in params.items()}
            for name in reversed(params):
                sync.submit(name, grads[name][ctx.rank])
            reduced = sync.wait()
            for name, got in reduced.items():
                assert_matches(got, reference(op, grads[name]), op, ctx.size)
                on_mpi = op is OP.MAX and name != "n"
                assert in_shared_memory(got) != on_mpi, (name, op)


def test_buckets_follow_reverse_registration_order_and_start_when_full(module_ctx):
    ctx = module_ctx
    sync = mt.GradientSync(PARAMS, bucket_bytes=4096)
    assert sync.bucket_names == [["steps", "b2", "w2", "b1"], ["w1"]]
    for name in ("steps", "b2", "w2"):
        sync.submit(name, _grad(0, name, ctx.rank))
    assert sync.started == 0
    sync.submit("b1", _grad(0, "b1", ctx.rank))
    assert sync.started == 1  # started before w1 exists: it overlaps the rest of backward
    sync.submit("w1", mt.tensor(_grad(0, "w1", ctx.rank)))
    assert sync.started == 2
    assert set(sync.wait()) == set(PARAMS)


def test_submission_errors_name_the_problem(module_ctx):
    ctx = module_ctx
    sync = mt.GradientSync({"w": ((2, 3), np.float32), "b": ((3,), np.float32)})
    with pytest.raises(ValueError, match="unknown parameter 'v': the registered parameters are 'w', 'b'"):
        sync.submit("v", np.zeros((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"the gradient of 'w' has shape \(3, 2\), expected \(2, 3\)"):
        sync.submit("w", np.zeros((3, 2), np.float32))
    with pytest.raises(TypeError, match="the gradient of 'w' has dtype float64, expected float32"):
        sync.submit("w", np.zeros((2, 3)))
    sync.submit("w", np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="the gradient of 'w' was already submitted in this step"):
        sync.submit("w", np.ones((2, 3), np.float32))
    with pytest.raises(RuntimeError, match=r"missing \['b'\]"):
        sync.wait()
    assert ctx.size >= 1


def test_bad_registrations(module_ctx):
    with pytest.raises(ValueError, match="at least one parameter"):
        mt.GradientSync({})
    with pytest.raises(TypeError, match="expected \\(shape, dtype\\)"):
        mt.GradientSync({"w": 3})
    with pytest.raises(TypeError, match="cannot be communicated"):
        mt.GradientSync({"w": ((2,), object)})
