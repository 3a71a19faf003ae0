"""out= on broadcast, reduce, all_gather, reduce_scatter, all_to_all and recv."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpitensor as mt
from tests.collectives.option_helpers import agree, close, still_usable
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, OP, every_rank_settings, rank_input, reference

pytestmark = pytest.mark.mpi(min_size=1)

KINDS = ["all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all"]


def _call(kind, mine, n, root, members, out):
    if kind == "broadcast":
        return mt.broadcast(mine, root=root, devices=members, out=out)
    if kind == "reduce":
        return mt.reduce(mine, "sum", root=root, devices=members, out=out)
    if kind == "all_reduce":
        return mt.all_reduce(mine, "sum", devices=members, out=out)
    return getattr(mt, kind)(mine, devices=members, out=out)


def _expected(kind, inputs, members, me, root):
    arrays = [inputs[r] for r in members]
    n = len(members)
    if kind == "broadcast":
        return inputs[root]
    if kind in ("reduce", "all_reduce"):
        return reference(OP.SUM, arrays)
    if kind == "all_gather":
        return np.concatenate(arrays)
    block = arrays[0].shape[0] // n
    if kind == "reduce_scatter":
        return reference(OP.SUM, arrays)[me * block : (me + 1) * block]
    return np.concatenate([a[me * block : (me + 1) * block] for a in arrays])


@every_rank_settings(40)
@given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(ALL_DTYPES),
    as_tensor=st.booleans(),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_out_receives_the_result(module_ctx, kind, dtype, as_tensor, group_kind, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    n, me = len(members), members.index(ctx.rank)
    root = members[seed % n]
    inputs = {r: rank_input(seed, r, (2 * n, 3), dtype) for r in members}
    expected = _expected(kind, inputs, members, me, root)
    array = np.empty(expected.shape, expected.dtype)
    out = mt.from_numpy(array) if as_tensor else array
    got = _call(kind, inputs[ctx.rank], n, root, members, out).resolve()
    if kind == "reduce" and ctx.rank != root:
        ok = got is None
    else:
        ok = close(got, expected, OP.SUM, n) and close(array, expected, OP.SUM, n)
        ok = ok and (got is out if as_tensor else np.shares_memory(got.numpy(), array))
    agree(ok, f"{kind} out= {np.dtype(dtype).name} on {members}")


def test_a_loop_reuses_out(ctx):
    out = mt.zeros((3,))
    for step in range(3):
        got = mt.reduce_scatter(np.full(3 * ctx.size, float(step)), "sum", out=out).resolve()
        assert got is out
        assert out.numpy().tolist() == [float(step * ctx.size)] * 3


def test_out_is_protected_while_in_flight(ctx):
    out = np.zeros(2)
    pending = mt.broadcast(np.ones(2), out=out)
    if not pending.done:
        with pytest.raises(ValueError, match="read-only"):
            out[0] = 5.0
    pending.resolve()
    out[0] = 5.0  # writable again once complete
    assert out.flags.writeable


def test_in_place_broadcast(ctx):
    data = np.full(3, float(ctx.rank))
    got = mt.broadcast(data, root=0, out=data).resolve()
    assert np.shares_memory(got.numpy(), data)
    assert data.tolist() == [0.0] * 3


def test_non_root_may_describe_by_out(ctx):
    out = np.empty(4, np.int16)
    data = np.arange(4, dtype=np.int16) if ctx.rank == 0 else None
    mt.broadcast(data, root=0, out=out).resolve()
    assert out.tolist() == [0, 1, 2, 3]


def test_all_gather_out_along_another_axis(ctx):
    out = np.empty((2, 3 * ctx.size))
    got = mt.all_gather(np.full((2, 3), float(ctx.rank)), axis=1, out=out).resolve()
    assert np.shares_memory(got.numpy(), out)
    np.testing.assert_array_equal(out, np.concatenate([np.full((2, 3), float(r)) for r in range(ctx.size)], axis=1))


def test_mean_of_integers_needs_a_float64_out(ctx):
    with pytest.raises(TypeError, match="dtype float64"):
        mt.reduce(np.ones(3, np.int32), "mean", out=np.empty(3, np.int32))
    got = mt.reduce(np.ones(3, np.int32), "mean", out=np.empty(3)).resolve()
    if ctx.rank == 0:
        assert got.numpy().tolist() == [1.0] * 3
    still_usable(ctx)


def _read_only(shape):
    array = np.empty(shape)
    array.flags.writeable = False
    return array


BAD_OUTS = [
    (lambda shape, x: np.empty(shape, np.float32), TypeError, "dtype float32"),
    (lambda shape, x: np.empty(shape[0] + 1), ValueError, "shape"),
    (lambda shape, x: _read_only(shape), ValueError, "read-only"),
    (lambda shape, x: np.empty(2 * shape[0])[::2], ValueError, "C-contiguous"),
    (lambda shape, x: x[: shape[0]], ValueError, "overlaps the input"),
    (lambda shape, x: [0.0] * shape[0], TypeError, "must be a host"),
]


@pytest.mark.parametrize(("make", "error", "message"), BAD_OUTS)
@pytest.mark.parametrize("kind", ["reduce", "reduce_scatter", "all_to_all", "all_gather"])
def test_bad_out(ctx, kind, make, error, message):
    n = ctx.size
    data = np.ones(4 * n)
    result_shape = {"reduce": (4 * n,), "reduce_scatter": (4,), "all_to_all": (4 * n,), "all_gather": (4 * n * n,)}
    target = make(result_shape[kind], data)
    with pytest.raises(error, match=message):  # all_gather learns its length from the peers: raised at resolve
        if kind in ("reduce", "reduce_scatter"):
            getattr(mt, kind)(data, "sum", out=target).resolve()
        else:
            getattr(mt, kind)(data, out=target).resolve()
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
def test_recv_into_out(ctx):
    if ctx.rank == 0:
        mt.send(np.arange(6, dtype=np.int32).reshape(2, 3), 1).resolve()
    elif ctx.rank == 1:
        out = mt.empty((2, 3), dtype=np.int32)
        got = mt.recv(0, out=out).resolve()
        assert got is out
        assert out.numpy().tolist() == [[0, 1, 2], [3, 4, 5]]


@pytest.mark.mpi(min_size=2)
def test_recv_into_an_out_that_does_not_fit(ctx):
    if ctx.rank == 0:
        mt.send(np.arange(6, dtype=np.int32), 1).resolve()
    elif ctx.rank == 1:
        with pytest.raises((mt.CollectiveMismatchError, ValueError), match="shape"):
            mt.recv(0, out=np.empty(5, np.int32)).resolve()
