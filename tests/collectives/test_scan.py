"""`scan` and `exscan`: prefix reductions in group order, against NumPy."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpitensor as mt
from mpitensor._collectives.scan import identity
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, OP, agree, every_rank_settings, rank_input, reference, rejects, tolerance

pytestmark = pytest.mark.mpi(min_size=1)

_IDENTITIES = {
    (OP.SUM, "i"): 0, (OP.PROD, "i"): 1, (OP.MAX, "i"): np.iinfo(np.int32).min, (OP.MIN, "i"): np.iinfo(np.int32).max,
    (OP.BAND, "i"): -1, (OP.BOR, "i"): 0, (OP.BXOR, "i"): 0, (OP.MAX, "f"): -np.inf, (OP.MIN, "f"): np.inf,
}


def _expected(op: mt.ReduceOperation, prefix: list[np.ndarray], like: np.ndarray) -> np.ndarray:
    if prefix:
        return reference(op, prefix)
    result_dtype = np.dtype(np.float64) if op is OP.MEAN and like.dtype.kind in "biu" else like.dtype
    return np.broadcast_to(identity(op, result_dtype), like.shape).copy()


def _close(got: object, expected: np.ndarray, op: mt.ReduceOperation, count: int) -> bool:
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype.kind not in "fc" or op in (OP.MAX, OP.MIN):
        return bool(np.array_equal(got, expected, equal_nan=True))
    tol = tolerance(expected.dtype, count)
    return bool(np.allclose(got, expected, rtol=tol, atol=tol, equal_nan=True))


@every_rank_settings(80)
@given(
    kind=st.sampled_from(["scan", "exscan"]),
    dtype=st.sampled_from(ALL_DTYPES),
    shape=st.lists(st.integers(0, 4), min_size=0, max_size=2).map(tuple),
    op=st.sampled_from(list(OP)),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_prefix_reductions_match_numpy(module_ctx, kind, dtype, shape, op, group_kind, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    call = mt.scan if kind == "scan" else mt.exscan
    inputs = {r: rank_input(seed, r, shape, dtype) for r in members}
    if rejects(op, dtype):
        with pytest.raises(TypeError, match="bitwise reduction"):
            call(inputs[ctx.rank], op, devices=members)
        agree(True, "rejected")
        return
    index = members.index(ctx.rank)
    covered = members[: index + 1] if kind == "scan" else members[:index]
    got = call(inputs[ctx.rank], op, devices=members).resolve()
    expected = _expected(op, [inputs[r] for r in covered], inputs[ctx.rank])
    agree(_close(got, expected, op, max(1, len(covered))), f"{kind} {np.dtype(dtype)} {shape} {op.name} on {members}")


@pytest.mark.parametrize("op", [OP.SUM, OP.MEAN, OP.MAX], ids=lambda o: o.name)
def test_half_precision_prefixes(module_ctx, op):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    ctx = module_ctx
    for dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        inputs = [np.full(3, r + 1, np.float32).astype(dtype) for r in range(ctx.size)]
        got = mt.scan(inputs[ctx.rank], op).resolve()
        exact = functools.reduce(np.add if op is not OP.MAX else np.maximum,
                                 [x.astype(np.float64) for x in inputs[: ctx.rank + 1]])
        if op is OP.MEAN:
            exact = exact / (ctx.rank + 1)
        assert got.dtype == dtype
        np.testing.assert_allclose(got.numpy().astype(np.float64), exact, rtol=1e-2)


def test_max_of_floats_keeps_nan(module_ctx):
    ctx = module_ctx
    value = np.array([np.nan if ctx.rank == 0 else float(ctx.rank), -0.0])
    got = mt.scan(value, "max").resolve().numpy()
    assert np.isnan(got[0])
    later = mt.exscan(value, "max").resolve().numpy()
    assert later[0] == -np.inf if ctx.rank == 0 else np.isnan(later[0])


@pytest.mark.parametrize(("op", "kind", "value"), [(op, k, v) for (op, k), v in _IDENTITIES.items()],
                         ids=lambda x: getattr(x, "name", str(x)))
def test_exscan_gives_rank_zero_the_identity(module_ctx, op, kind, value):
    dtype = np.int32 if kind == "i" else np.float64
    got = mt.exscan(np.full(2, 3, dtype), op).resolve().numpy()
    if module_ctx.rank == 0:
        assert got.tolist() == [value, value]


def test_exscan_identities_of_bool_and_mean(module_ctx):
    flags = mt.exscan(np.array([True]), "band").resolve().numpy()
    mean = mt.exscan(np.array([4]), "mean").resolve().numpy()
    if module_ctx.rank == 0:
        assert flags.tolist() == [True]
        assert mean.dtype == np.float64 and np.isnan(mean[0])
    else:
        assert mean[0] == 4.0


def test_torch_jax_and_python_inputs_scan_into_their_kind(module_ctx):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    ctx = module_ctx
    inputs = [rank_input(32, r, (4,), np.int32) for r in range(ctx.size)]
    inclusive = functools.reduce(np.add, inputs[: ctx.rank + 1])
    got = mt.scan(torch.from_numpy(inputs[ctx.rank].copy()), "sum").resolve()
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int32
    np.testing.assert_array_equal(got.numpy(), inclusive)
    got = mt.exscan(jax.numpy.asarray(inputs[ctx.rank]), "max").resolve()
    assert isinstance(got, jax.Array) and got.dtype == np.int32
    expected = functools.reduce(np.maximum, inputs[: ctx.rank]) if ctx.rank else np.full(4, np.iinfo(np.int32).min)
    np.testing.assert_array_equal(np.asarray(got), expected)
    count = mt.scan(1, "sum").resolve()
    assert type(count) is int and count == ctx.rank + 1


@pytest.mark.mpi(min_size=2)
def test_python_ints_whose_prefix_sum_could_overflow_are_refused(module_ctx):
    with pytest.raises(OverflowError, match=rf"exscan: a SUM over {module_ctx.size} ranks of Python ints of magnitude"):
        mt.exscan(2**62, "sum")  # two of them leave int64
    assert mt.all_reduce(np.ones(1)).resolve().item() == module_ctx.size
