"""A property: whatever each rank gets wrong, every rank ends with the right result or an error.

Each example draws, for every rank, a collective, a shape, a dtype, a reduce op and maybe a
bad argument. Ranks that all call the same thing must get NumPy's answer; otherwise every
rank must get an `MpitensorError` (the rank whose own argument was bad: its `TypeError` or
`ValueError`), never a hang, a raw MPI error or a wrong value, and the next collective must
work. A rank that calls a group's collective though the group leaves it out ("not my group":
its peers call it on that group, which they are the members of) gets its `ValueError`, and
the members the group's result, untouched by it. Every rank derives every rank's choices
from the example's seed.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpitensor as mt
from tests.helpers import OP, every_rank_settings, rank_input, reference, tolerance

pytestmark = pytest.mark.mpi(min_size=1)

SETTINGS = every_rank_settings(50)
KINDS = ["all_reduce", "fused", "broadcast", "reduce", "all_gather", "barrier"]
DTYPES = [np.int32, np.float32, np.float64]
SHAPES = [(4,), (2, 3)]
OPS = [OP.SUM, OP.MAX]
BAD = [None, "object dtype", "unknown op", "not my group"]


def _choices(seed: int, size: int) -> list[dict]:
    """Every rank's call: mostly the same, sometimes one rank differs in one thing."""
    rng = np.random.default_rng(seed)
    usual = {"kind": KINDS[rng.integers(len(KINDS))], "dtype": DTYPES[rng.integers(len(DTYPES))],
             "shape": SHAPES[rng.integers(len(SHAPES))], "op": OPS[rng.integers(len(OPS))], "bad": None,
             "group": None}
    calls = [dict(usual) for _ in range(size)]
    if size > 1 and rng.random() < 0.7:
        odd = calls[int(rng.integers(size))]
        field = ["kind", "dtype", "shape", "op", "bad"][int(rng.integers(5))]
        pool = {"kind": KINDS, "dtype": DTYPES, "shape": SHAPES, "op": OPS, "bad": BAD[1:]}[field]
        odd[field] = pool[int(rng.integers(len(pool)))]
        # A bad argument the call takes: barrier has no data, only reductions take an op.
        if odd["bad"] == "unknown op" and odd["kind"] not in ("all_reduce", "fused", "reduce"):
            odd["bad"] = "object dtype"
        if odd["bad"] == "object dtype" and odd["kind"] == "barrier":
            odd["bad"] = "not my group"
        if odd["bad"] == "not my group":  # every rank calls the group that leaves the odd rank out
            outside = calls.index(odd)
            for call in calls:
                call["group"] = [r for r in range(size) if r != outside]
    return calls


def _signature(call: dict) -> tuple:
    op_matters = call["kind"] in ("all_reduce", "fused", "reduce")
    shape_matters = call["kind"] != "barrier"
    return (call["kind"], call["dtype"] if shape_matters else None, call["shape"] if shape_matters else None,
            call["op"] if op_matters else None, call["bad"])


def _run(call: dict, data: np.ndarray, size: int):
    kind, op, bad = call["kind"], call["op"], call["bad"]
    if bad == "object dtype":
        data = data.astype(object)
    if bad == "unknown op":
        op = "no-such-op"
    devices = call["group"]
    root = 0 if devices is None else devices[0]
    if kind == "all_reduce":
        return mt.all_reduce(data, op, devices=devices)
    if kind == "fused":
        return mt.all_reduce([data, data], op, devices=devices)
    if kind == "broadcast":
        return mt.broadcast(data, root=root, devices=devices)
    if kind == "reduce":
        return mt.reduce(data, op, root=root, devices=devices)
    if kind == "all_gather":
        return mt.all_gather(data, devices=devices)
    return mt.barrier(devices=devices)


def _expected(call: dict, inputs: list[np.ndarray], rank: int):
    group = call["group"]
    if group is not None:  # the group's result, from its members' inputs; its root: its first member
        inputs = [inputs[r] for r in group]
        rank = group.index(rank)
    kind = call["kind"]
    if kind in ("all_reduce", "reduce"):
        value = reference(call["op"], inputs)
        return value if kind == "all_reduce" or rank == 0 else None
    if kind == "fused":
        return [reference(call["op"], inputs)] * 2
    if kind == "broadcast":
        return inputs[0]
    if kind == "all_gather":
        return np.concatenate(inputs)
    return None


def _matches(got, expected, call: dict, size: int) -> bool:
    if expected is None:
        return got is None
    if isinstance(expected, list):
        return isinstance(got, list) and all(_matches(g, e, call, size) for g, e in zip(got, expected))
    got = np.asarray(got)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return False
    if expected.dtype.kind != "f" or call["op"] is OP.MAX or call["kind"] in ("broadcast", "all_gather"):
        return bool(np.array_equal(got, expected))
    tol = tolerance(expected.dtype, size)
    return bool(np.allclose(got, expected, rtol=tol, atol=tol))


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1))
def test_every_rank_gets_the_right_result_or_an_error(module_ctx, seed):
    ctx = module_ctx
    calls = _choices(seed, ctx.size)
    mine = calls[ctx.rank]
    inputs = [rank_input(seed, r, calls[r]["shape"], calls[r]["dtype"]) for r in range(ctx.size)]
    try:
        handle = _run(mine, inputs[ctx.rank], ctx.size)
        got = handle.resolve() if isinstance(handle, mt.CollectiveTensor) else handle
        error = None
    except Exception as exc:
        got, error = None, exc
    members = [c for r, c in enumerate(calls) if c["group"] is None or r in c["group"]]
    inside = mine["group"] is None or ctx.rank in mine["group"]
    agreed = inside and len({_signature(c) for c in members}) == 1 and mine["bad"] is None
    if agreed:
        assert error is None, f"every rank called {mine}, yet this rank got {error!r}"
        if isinstance(got, list):
            got = [np.asarray(t) for t in got]
        assert _matches(got, _expected(mine, inputs, ctx.rank), mine, ctx.size), f"wrong result for {mine}"
    else:
        assert error is not None, f"ranks disagreed ({calls}), yet this rank got a result"
        if mine["bad"] is None:
            assert isinstance(error, mt.MpitensorError), repr(error)
        else:
            assert isinstance(error, (TypeError, ValueError)) and not isinstance(error, mt.MpitensorError), repr(error)
    # The next collective works on every rank.
    total = mt.all_reduce(np.full(3, float(ctx.rank + 1))).resolve().numpy()
    assert total.tolist() == [float(ctx.size * (ctx.size + 1) // 2)] * 3
