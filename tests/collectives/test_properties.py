"""Property-based tests: random collectives, shapes, dtypes, ops and groups against NumPy.

Every rank must draw the same examples (derandomized, no database), and no rank may stop
early while the others go on, so each example ends with a collective verdict: all ranks
pass or fail it together. Shrinking is off for the same reason.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, BITWISE, OP, agree, every_rank_settings, rank_input, reference, rejects, tolerance

pytestmark = pytest.mark.mpi(min_size=1)

SETTINGS = every_rank_settings(60)
KINDS = ["all_reduce", "reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "fused"]


def _close(got: np.ndarray, expected: np.ndarray, op: mt.ReduceOperation | None, count: int) -> bool:
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype.kind not in "fc" or op in (None, OP.MAX, OP.MIN):
        return bool(np.array_equal(got, expected))
    tol = tolerance(expected.dtype, count)
    return bool(np.allclose(got, expected, rtol=tol, atol=tol))


@SETTINGS
@given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(ALL_DTYPES),
    shape=array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5),
    op=st.sampled_from(list(OP)),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_collectives_match_numpy(module_ctx, kind, dtype, shape, op, group_kind, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:  # outside this group: take part in the verdict only
        agree(True, "outside")
        return
    n = len(members)
    if rejects(op, dtype):  # bitwise ops reduce integers (floats raise TypeError: see test_bitwise)
        dtype = np.int64
    if kind in ("reduce_scatter", "all_to_all"):
        shape = (n * (shape[0] if shape else 1), *shape[1:])
    if kind == "all_gather" and not shape:
        shape = (1,)
    inputs = {r: rank_input(seed, r, shape, dtype) for r in members}
    mine = inputs[ctx.rank]
    root = members[seed % n]
    if kind == "all_reduce":
        got = mt.all_reduce(mine, op, devices=members).resolve()
        ok = _close(got, reference(op, [inputs[r] for r in members]), op, n)
    elif kind == "reduce":
        got = mt.reduce(mine, op, root=root, devices=members).resolve()
        ok = (got is None) if ctx.rank != root else _close(got, reference(op, [inputs[r] for r in members]), op, n)
    elif kind == "broadcast":
        got = mt.broadcast(mine, root=root, devices=members).resolve()
        ok = _close(got, inputs[root], None, n)
    elif kind == "all_gather":
        got = mt.all_gather(mine, devices=members).resolve()
        ok = _close(got, np.concatenate([inputs[r] for r in members]), None, n)
    elif kind == "reduce_scatter":
        got = mt.reduce_scatter(mine, op, devices=members).resolve()
        block = shape[0] // n
        index = members.index(ctx.rank)
        full = reference(op, [inputs[r] for r in members])
        ok = _close(got, full[index * block : (index + 1) * block], op, n)
    elif kind == "all_to_all":
        got = mt.all_to_all(mine, devices=members).resolve()
        block = shape[0] // n
        index = members.index(ctx.rank)
        expected = np.concatenate([inputs[r][index * block : (index + 1) * block] for r in members])
        ok = _close(got, expected, None, n)
    else:
        second = np.int16 if op in BITWISE else np.float64
        others = {r: rank_input(seed + 1, r, (3,), second) for r in members}
        got = mt.all_reduce([mine, others[ctx.rank]], op, devices=members).resolve()
        ok = _close(got[0], reference(op, [inputs[r] for r in members]), op, n) and _close(
            got[1], reference(op, [others[r] for r in members]), op, n
        )
    agree(ok, f"{kind} {np.dtype(dtype).name} {shape} {op.name} on {members}")
