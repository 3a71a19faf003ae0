"""The compiled lane: the same results as the Python lanes, and the engine can take over its ops.

Repeated calls of a kind with a compiled lane start there (their handles are `LaneTensor`s);
every result is compared with NumPy's reduction of every rank's input, bit for bit where
the Python lane's reduction is exact. The cases where the compiled lane hands an op to the
Python engine (a late peer, a mismatch, dropped handles, `assume_resolved`, a timeout)
must behave as they do without it.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives import native
from mpitensor._collectives.native import LaneTensor
from tests.helpers import (
    OP,
    agree,
    kept_plan,
    rank_input,
    reference,
    rejects,
    same,
    seed_of,
    still_usable,
    tolerance,
)

pytestmark = pytest.mark.mpi(min_size=1)

switched_off = os.environ.get("MPITENSOR_NATIVE", "").strip() == "0"
needs_compiled = pytest.mark.skipif(switched_off or not native.built(),
                                    reason="MPITENSOR_NATIVE=0, or built without a C compiler: the Python lanes only")

DTYPES = [np.bool_, np.int8, np.uint16, np.int32, np.int64, np.uint64, np.float32, np.float64, np.complex64,
          np.complex128]
OPS = [OP.SUM, OP.PROD, OP.MAX, OP.MIN, OP.MEAN, OP.BAND, OP.BOR, OP.BXOR]
SHAPES = [(), (0,), (2,), (3, 2), (1000,)]


def _compiled(ctx: mt.DistributedContext, dtype: object, shape: tuple[int, ...], op: object) -> object:
    lane = kept_plan(ctx, "all_reduce", np.dtype(dtype), shape, op)
    return None if lane is None else lane.compiled


def test_the_compiled_lane_is_bound():
    """Where the package was built with a C compiler (``MPITENSOR_EXPECT_NATIVE=1``, as `make test` sets
    it), the compiled lane is on after a first call; switched off, it says so."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)):
        mt.all_reduce(np.ones(2)).resolve()
    if switched_off:
        assert native.status() == "switched off (MPITENSOR_NATIVE=0)", native.status()
    elif os.environ.get("MPITENSOR_EXPECT_NATIVE") == "1":
        assert native.status() == "on", f"the compiled lane is not in use: {native.status()}"
    else:
        assert native.status() == "on" or native.status().startswith(("not built", "cannot bind")), native.status()


@needs_compiled
@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_calls_on_the_compiled_lane_match_numpy(check, op):
    """Four calls of each kind: the later ones on the compiled lane (where the plan has one), all NumPy's.

    Integer results are exact; so are float results reduced from the check's rows (in rank
    order, as the reference; MEAN then divided as NumPy divides), as the Python lane gives them.
    """
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        for dtype in DTYPES:
            if rejects(op, dtype):
                continue
            for shape in SHAPES:
                for turn in range(4):
                    seed = seed_of("compiled", check, op.name, np.dtype(dtype).str, shape, turn)
                    inputs = [rank_input(seed, r, shape, dtype) for r in range(ctx.size)]
                    with np.errstate(over="ignore", invalid="ignore"):
                        expected = reference(op, inputs)
                    mine = inputs[ctx.rank].copy()
                    pending = mt.all_reduce(mt.from_numpy(mine) if turn % 2 else mine, op)
                    mine[...] = 0  # copied at the call, on every lane
                    got = pending.resolve()
                    # Rank order, as NumPy's reference, where the rows carried in the check are
                    # reduced locally; MPI's own order otherwise (exact for integers only).
                    carried = check and 1 < ctx.size <= 8 and mine.nbytes <= 64
                    # (NumPy's complex products may fuse multiply and add: its array and scalar
                    # loops can differ in the last bit.)
                    exact = expected.dtype.kind in "biu" or ctx.size == 1 or (
                        carried and not (op is OP.PROD and expected.dtype.kind == "c"))
                    if exact:
                        ok = same(got, expected)
                    else:
                        tol = tolerance(expected.dtype, ctx.size)
                        ok = got.dtype == expected.dtype and np.allclose(got.numpy(), expected, rtol=tol, atol=tol,
                                                                          equal_nan=True)
                    if turn == 3 and _compiled(ctx, dtype, shape, op) is not None:
                        ok = ok and type(pending) is LaneTensor
                    agree(bool(ok), f"{op.name} of {shape} {np.dtype(dtype)}, call {turn}: {got} vs {expected}")
        still_usable(ctx)


@needs_compiled
def test_which_kinds_have_a_compiled_lane():
    """Copies up to 64 KiB (check off) and carried inputs (check on, 2-8 ranks); MEAN of floats only."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        for op in (None, OP.MEAN, OP.BXOR):
            for dtype in (np.float32, np.int64):
                if op is OP.BXOR and dtype is np.float32:
                    continue
                mt.all_reduce(np.ones(3, dtype), op).resolve()
        assert _compiled(ctx, np.float32, (3,), None) is not None
        assert _compiled(ctx, np.float32, (3,), OP.MEAN) is not None, "MEAN of float32 divides in C"
        assert _compiled(ctx, np.int64, (3,), OP.BXOR) is not None
        assert kept_plan(ctx, "all_reduce", np.dtype(np.int64), (3,), OP.MEAN) is None, (
            "MEAN of integers reduces in float64: no lane at all")
    with mt.DistributedContext.init() as ctx:
        mt.all_reduce(np.ones(3, np.complex64), OP.PROD).resolve()
        mt.all_reduce(np.ones(3, np.float32)).resolve()
        if 1 < ctx.size <= 8:
            assert _compiled(ctx, np.complex64, (3,), OP.PROD) is None, "complex products keep NumPy's formula"
            assert _compiled(ctx, np.float32, (3,), None) is not None
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", [OP.SUM, OP.MEAN])
def test_checked_calls_with_a_late_rank(op):
    """A rank that comes late to every other call: its peers' checks do not agree at once, and the engine takes over."""
    with mt.DistributedContext.init() as ctx:
        for turn in range(12):
            if ctx.rank == ctx.size - 1 and turn % 2:
                time.sleep(0.02)
            inputs = [rank_input(seed_of("late", op.name, turn), r, (4,), np.float64) for r in range(ctx.size)]
            pending = mt.all_reduce(inputs[ctx.rank].copy(), op)
            agree(same(pending.resolve(), reference(op, inputs)), f"call {turn}")
        assert not ctx.engine.busy()
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", [(1,), (1000,)], ids=["carried", "copied"])
def test_calls_that_wait_at_call_with_a_late_rank(shape):
    """Calls made with `wait_at_call` (a compiled program's): a peer late by less than the 2 ms the
    lane waits in C, and one later than that (its check queued): every result NumPy's; the
    setting is the thread's own and comes back."""
    with mt.DistributedContext.init() as ctx:
        assert native.wait_at_call(True) is False
        try:
            for turn in range(12):
                if ctx.rank == ctx.size - 1 and turn % 3:
                    time.sleep(0.0005 if turn % 3 == 1 else 0.02)
                # Integers: exact sums in any order (MPI's algorithm for the copied size may reorder).
                inputs = [rank_input(seed_of("wait", shape, turn), r, shape, np.int64) for r in range(ctx.size)]
                result = mt.all_reduce(inputs[ctx.rank].copy()).resolve()
                agree(same(result, reference(OP.SUM, inputs)), f"call {turn}")
            seen = []
            thread = threading.Thread(target=lambda: seen.append(native.wait_at_call(False)))
            thread.start()
            thread.join()
            assert seen == [False], "another thread has its own setting"
        finally:
            assert native.wait_at_call(False) is True
        assert not ctx.engine.busy()
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [False, True])
def test_a_mismatch_between_two_lanes_is_caught(check):
    """Ranks on lanes of different shapes: the check names both (check on), and the context stays usable."""
    if not check:
        pytest.skip("without the check, mismatched calls are the program's to avoid")
    with mt.DistributedContext.init() as ctx:
        for shape in ((2,), (3,)):
            for _ in range(2):
                mt.all_reduce(np.ones(shape)).resolve()
        shape = (2,) if ctx.rank == 0 else (3,)
        with pytest.raises(mt.CollectiveMismatchError, match="shape"):
            mt.all_reduce(np.ones(shape)).resolve()
        still_usable(ctx)


@needs_compiled
@pytest.mark.parametrize("check", [False, True])
def test_dropped_handles_are_completed(check):
    """Hundreds of calls whose handles are dropped: the engine reaps them; the last one's result is right."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        value = np.full(2, float(ctx.rank + 1))
        for _ in range(600):
            mt.all_reduce(value)
        got = mt.all_reduce(value).resolve()
        assert got.numpy().tolist() == [ctx.size * (ctx.size + 1) / 2] * 2
        assert len(ctx.engine.posted) <= 257
        still_usable(ctx)
    assert not ctx.engine.busy()


@needs_compiled
def test_assume_resolved_protects_a_compiled_result():
    """The result of a call in flight refuses writes until resolved, as on the Python lanes."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        mt.all_reduce(np.ones(4)).resolve()
        pending = mt.all_reduce(np.ones(4))
        early = pending.assume_resolved()
        if not pending.done:
            with pytest.raises(mt.TensorInFlightError):
                early[0] = 5.0
        got = pending.resolve()
        assert got is early and got.numpy().tolist() == [float(ctx.size)] * 4
        got[0] = 5.0  # writable once resolved
        still_usable(ctx)


@needs_compiled
@pytest.mark.parametrize("check", [False, True])
def test_resolve_with_a_timeout_and_twice(check):
    """resolve(timeout) and a second resolve() give the same tensor; test() and done agree."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        for _ in range(2):
            mt.all_reduce(np.ones(3, np.float32)).resolve()
        first = mt.all_reduce(np.ones(3, np.float32))
        second = mt.all_reduce(np.ones(3, np.float32))
        a = first.resolve(timeout=30)
        b = second.resolve()
        assert a is first.resolve() and b is second.resolve(5)
        assert first.done and second.test()
        assert a.numpy().tolist() == b.numpy().tolist() == [float(ctx.size)] * 3
        with pytest.raises(ValueError, match="positive"):
            first.resolve(timeout=-1)
        still_usable(ctx)


@needs_compiled
def test_another_thread_is_refused_and_a_closed_context_too():
    """A compiled lane declines calls from another thread, and after close(): the usual errors."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        data = np.ones(2)
        mt.all_reduce(data).resolve()
        errors: list[BaseException] = []

        def call() -> None:
            try:
                mt.all_reduce(data)
            except BaseException as exc:  # the test reads it
                errors.append(exc)

        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        assert len(errors) == 1 and isinstance(errors[0], mt.ThreadMisuseError), errors
        pending = mt.all_reduce(data)
        still_usable(ctx)
    with pytest.raises(mt.NoContextError):
        mt.all_reduce(data)
    with pytest.raises(mt.ContextClosedError, match="closed first"):
        pending.resolve()  # close() completed it; results are resolved before closing


@needs_compiled
def test_nested_contexts_keep_their_own_lanes():
    """An inner context's calls take its own lanes; the outer's go on after it closes."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as outer:
        data = np.full(2, 1.0)
        for _ in range(2):
            mt.all_reduce(data).resolve()
        outer_lane = _compiled(outer, np.float64, (2,), None)
        with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as inner:
            for _ in range(3):
                assert mt.all_reduce(data).resolve().numpy().tolist() == [float(inner.size)] * 2
            inner_lane = _compiled(inner, np.float64, (2,), None)
        assert outer_lane is not None and inner_lane is not None and inner_lane is not outer_lane
        for _ in range(2):
            got = mt.all_reduce(data)
            assert type(got) is LaneTensor and got.resolve().numpy().tolist() == [float(outer.size)] * 2
        assert _compiled(outer, np.float64, (2,), None) is outer_lane
        still_usable(outer)


@needs_compiled
@pytest.mark.parametrize("check", [False, True])
def test_fused_leaves_packed_and_unpacked_by_the_compiled_loops(check):
    """One bucket of one dtype: Tensor results that view one buffer, NumPy's sums, in the input's structure."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        shapes = [(3,), (), (2, 2), (0,), (5, 1)] * 4
        for turn in range(2):
            inputs = [[rank_input(seed_of("fused", check, turn, i), r, shape, np.float64)
                       for i, shape in enumerate(shapes)] for r in range(ctx.size)]
            mine = [mt.from_numpy(a.copy()) if i % 2 else a.copy() for i, a in enumerate(inputs[ctx.rank])]
            pending = mt.all_reduce(mine)
            for leaf in mine:
                (leaf.numpy() if isinstance(leaf, mt.Tensor) else leaf)[...] = 0  # packed at the call
            got = pending.resolve()
            ok = type(got) is list and len(got) == len(shapes) and all(isinstance(t, mt.Tensor) for t in got)
            ok = ok and all(t.device == ctx.cpu_device for t in got)
            bases = {id(np.asarray(t.numpy()).base) for t in got if t.size}
            ok = ok and len(bases) == 1 and all(
                t.shape == s and np.allclose(t.numpy(), sum(a[i] for a in inputs), rtol=1e-12, atol=1e-12)
                for i, (t, s) in enumerate(zip(got, shapes)))
            agree(bool(ok), f"call {turn}: {[t.numpy() for t in got] if isinstance(got, list) else got}")
        still_usable(ctx)


@needs_compiled
@pytest.mark.parametrize("check", [False, True])
def test_numbers_and_torch_tensors_on_the_compiled_lane(check):
    """Numbers and CPU torch tensors start on the compiled lane of their array and come back in their kind."""
    torch = pytest.importorskip("torch")
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        for make, dtype, shape in ((float, np.float64, ()), (int, np.int64, ()), (np.float32, np.float32, ()),
                                   (torch.from_numpy, np.float32, (3,))):
            for turn in range(4):
                inputs = [rank_input(seed_of("kinds", check, turn, str(dtype)), r, shape, dtype)
                          for r in range(ctx.size)]
                mine = inputs[ctx.rank].copy()
                value = make(mine) if shape else make(mine[()])
                pending = mt.all_reduce(value)
                got = pending.resolve()
                expected = reference(OP.SUM, inputs)
                ok = type(got) is type(value) and np.allclose(np.asarray(got), expected, rtol=1e-6)
                ok = ok and got is pending.resolve()
                if turn == 3:
                    ok = ok and type(pending) is LaneTensor
                agree(bool(ok), f"{type(value).__name__}, call {turn}: {got!r} vs {expected!r}")
        still_usable(ctx)


@needs_compiled
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shape", [(2,), (3, 500)], ids=["carried", "copied"])
def test_run_into_reduces_at_once_into_the_callers_buffer(shape):
    """`run_into` (what a compiled program's handler calls): the result copied into `out` when
    it returns, a late peer waited for; arrays not of the lane, a read-only `out` and another
    thread's call declined."""
    with mt.DistributedContext.init() as ctx:
        op = "sum"
        for _ in range(2):
            mt.all_reduce(np.ones(shape), op).resolve()
        lane = native.find_lane(ctx, np.ones(shape), op)
        assert lane is not None
        assert native.find_lane(ctx, np.ones(shape), "max") is None, "another op's calls have no lane yet"
        for turn in range(3):
            inputs = [rank_input(seed_of("run-into", shape, turn), r, shape, np.float64) for r in range(ctx.size)]
            if turn == 2 and ctx.rank == ctx.size - 1:
                time.sleep(0.05)
            out = np.empty(shape)
            assert lane.run_into(inputs[ctx.rank], out) is True
            np.testing.assert_allclose(out, reference(OP.SUM, inputs), rtol=1e-12)
        read_only = np.empty(shape)
        read_only.flags.writeable = False
        assert lane.run_into(np.ones(shape), read_only) is None
        assert lane.run_into(np.ones(shape, np.float32), np.empty(shape, np.float32)) is None
        seen = []
        thread = threading.Thread(target=lambda: seen.append(lane.run_into(np.ones(shape), np.empty(shape))))
        thread.start()
        thread.join()
        assert seen == [None], "another thread's call is declined"
        still_usable(ctx)
