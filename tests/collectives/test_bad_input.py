"""Bad input gets a clear exception naming what was wrong, before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt

pytestmark = pytest.mark.mpi(min_size=1)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: mt.all_reduce([[1, 2]]), TypeError, "expects every tensor of the list to be a mpitensor.Tensor"),
        (lambda: mt.all_reduce("abc"), TypeError, "or a number, got str"),
        (lambda: mt.all_reduce(np.array([object()])), TypeError, "dtype object cannot be communicated"),
        (lambda: mt.all_reduce(np.array(["a"])), TypeError, "dtype <U1 cannot be communicated"),
        (lambda: mt.all_reduce(np.zeros(2, dtype=[("a", "i4")])), TypeError, "cannot be communicated"),
        (lambda: mt.broadcast(np.ones(2), root=-1).resolve(), ValueError, "root must be a rank >= 0, got -1"),
        (lambda: mt.reduce(np.ones(2), root=99).resolve(), ValueError, "root 99 is not in the group"),
        (lambda: mt.broadcast(np.ones(2), root="0"), TypeError, "root must be a rank"),
        (lambda: mt.all_reduce(np.ones(2), devices=[mt.Device("cpu", 0, 99)]), mt.DeviceError,
         "device cpu:0@rank99 is not in this context"),
        (lambda: mt.all_reduce(np.ones(2), op="median"), ValueError, "unknown reduce operation 'median'"),
        (lambda: mt.all_reduce(np.ones(2)).resolve(timeout=-1), ValueError, "timeout must be a positive number"),
    ],
    ids=["nested-list", "string", "object", "unicode", "structured", "negative-root", "root-out-of-range",
         "root-type", "wrong-device", "unknown-op", "bad-timeout"],
)
def test_bad_input_table(ctx, call, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        call()
    # Nothing was left half-sent: the next collective works.
    assert mt.all_reduce(np.ones(1)).resolve().item() == ctx.size


@pytest.mark.mpi(min_size=2)
def test_none_for_a_non_root_broadcast_without_shape(ctx):
    root = (ctx.rank + 1) % ctx.size
    with pytest.raises(TypeError, match="a non-root rank passing input=None must give shape= and dtype="):
        mt.broadcast(None, root=root)


def test_closed_context(ctx):
    ctx.close()
    with pytest.raises(mt.NoContextError, match="no DistributedContext is open"):
        mt.all_reduce(np.ones(2))


def test_every_error_derives_from_mpitensor_error():
    for cls in (mt.CollectiveMismatchError, mt.CollectiveTimeoutError, mt.ContextClosedError, mt.ContextBrokenError,
                mt.MpiFinalizedError, mt.NoContextError, mt.DeviceError, mt.TensorInFlightError):
        assert issubclass(cls, mt.MpitensorError)
    assert issubclass(mt.CollectiveMismatchError, ValueError)
    assert issubclass(mt.CollectiveTimeoutError, TimeoutError)
    for cls in (mt.ContextClosedError, mt.ContextBrokenError, mt.MpiFinalizedError, mt.NoContextError, mt.DeviceError):
        assert issubclass(cls, RuntimeError)
