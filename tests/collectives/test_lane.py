"""The lane of repeated small all-reduces: later calls of a kind skip the planning of the first.

A call on its lane must give what the general path gives (NumPy's reduction of every rank's
input, on every rank), meet a peer's call on the general path, still be checked, and refuse
what the general path refuses.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives.lane import LANE_BYTES, CheckLane, CopyLane, PlainLane
from mpitensor._collectives.native import LaneTensor
from mpitensor._collectives.plans import PLANS
from mpitensor._transport.mpi import SMALL_BYTES
from tests.helpers import OP, agree, rank_input, reference, rejects, seed_of, still_usable, tolerance

pytestmark = pytest.mark.mpi(min_size=1)

DTYPES = [np.bool_, np.int8, np.int64, np.uint32, np.float16, np.float32, np.float64, np.complex128]
# (SMALL_BYTES // 8 + 1,): small in 4 bytes, not in 8; (40_000,): beyond the small size (protected, not
# copied) and below the shared-memory path's, in up to 8 bytes.
SHAPES = [(), (0,), (3,), (2, 5), (1000,), (SMALL_BYTES // 8 + 1,), (40_000,)]


def _lanes(ctx: mt.DistributedContext) -> dict:
    """The all-reduce lanes of `ctx`'s plan cache, by (dtype, shape, op)."""
    plans = ctx.full_group.extra.get(PLANS, {})
    return {key[1:]: plan for key, plan in plans.items() if key[0] == "all_reduce" and len(key) == 4}


@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("op", [OP.SUM, OP.PROD, OP.MAX, OP.MIN, OP.MEAN, OP.BXOR])
def test_repeated_calls_match_numpy(check, op):
    """Three calls of each kind, each with new inputs: every result is NumPy's, on every rank."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        for dtype in DTYPES:
            if rejects(op, dtype):
                continue
            for shape in SHAPES:
                for turn in range(3):
                    seed = seed_of("lane", check, op.name, np.dtype(dtype).str, shape, turn)
                    inputs = [rank_input(seed, r, shape, dtype) for r in range(ctx.size)]
                    with np.errstate(over="ignore", invalid="ignore"):
                        expected = reference(op, inputs)
                    mine = inputs[ctx.rank].copy()
                    pending = mt.all_reduce(mine, op)
                    if mine.nbytes <= SMALL_BYTES:
                        mine[...] = 0  # a small input is copied when the call is made, on the lane too
                    got = pending.resolve().numpy()
                    tol = tolerance(expected.dtype, ctx.size)
                    ok = got.dtype == expected.dtype and got.shape == expected.shape and np.allclose(
                        got, expected, rtol=tol, atol=tol, equal_nan=True)
                    agree(bool(ok), f"{op.name} of {shape} {np.dtype(dtype)}, call {turn}: {got} vs {expected}")
        still_usable(ctx)


def test_small_calls_keep_a_lane_and_large_ones_do_not():
    """What keeps a lane: small inputs copied at the call, with at most MEAN's division or MAX/MIN keys to finish."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        for _ in range(2):
            mt.all_reduce(np.ones(3, np.float32)).resolve()
            mt.all_reduce(np.ones(3, np.float32), OP.MEAN).resolve()
            mt.all_reduce(np.ones(3, np.float32), OP.MAX).resolve()
            mt.all_reduce(np.ones(40_000, np.float32)).resolve()
            mt.all_reduce(np.ones(40_000, np.float32), OP.MAX).resolve()
            mt.all_reduce(np.ones(LANE_BYTES // 4 + 1, np.float32)).resolve()
        lanes = _lanes(ctx)
        assert type(lanes.get((np.dtype(np.float32), (3,), None))) is CopyLane
        assert type(lanes.get((np.dtype(np.float32), (3,), OP.MEAN))) is CopyLane, "MEAN divides once reduced"
        assert type(lanes.get((np.dtype(np.float32), (3,), OP.MAX))) is CopyLane, "a copy of keys, decoded once reduced"
        assert (np.dtype(np.float32), (40_000,), OP.MAX) not in lanes, "keys in a pooled buffer: no lane"
        medium = lanes.get((np.dtype(np.float32), (40_000,), None))
        # Shared memory takes it on a node holding two of the ranks (MPITENSOR_SHM_NODE_SIZE may split them).
        assert type(medium) is PlainLane or (medium is None and ctx.size > 1), "protected, not copied"
        assert (np.dtype(np.float32), (LANE_BYTES // 4 + 1,), None) not in lanes, "beyond LANE_BYTES: no lane"
    with mt.DistributedContext.init() as ctx:
        mt.all_reduce(np.ones(3, np.float32)).resolve()
        lane = _lanes(ctx).get((np.dtype(np.float32), (3,), None))
        assert type(lane) is (CheckLane if 1 < ctx.size <= 8 else CopyLane), "checked: the check carries the data"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [False, True])
@pytest.mark.parametrize("count", [2, 64, 2048])
def test_a_call_on_its_lane_meets_a_call_on_the_general_path(check, count):
    """The last rank's earlier call passed ``devices`` (no lane kept); the others' kept one."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        everyone = list(range(ctx.size))
        last = ctx.rank == ctx.size - 1
        mt.all_reduce(np.ones(count), devices=everyone if last else None).resolve()
        assert ((np.dtype(np.float64), (count,), None) in _lanes(ctx)) != last
        for turn in range(3):
            inputs = [np.arange(count, dtype=np.float64) * (r + turn) for r in range(ctx.size)]
            got = mt.all_reduce(inputs[ctx.rank].copy()).resolve().numpy()
            agree(bool(np.array_equal(got, reference(OP.SUM, inputs))), f"call {turn} of {count} elements")
        still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what", ["shape", "dtype", "op", "broadcast"])
def test_calls_on_their_lane_are_still_checked(ctx, what):
    """The last rank calls something else while the others take their lane: every rank raises."""
    small = np.ones(3)
    for _ in range(2):
        mt.all_reduce(small).resolve()
    assert (small.dtype, small.shape, None) in _lanes(ctx)
    others = {
        "shape": lambda: mt.all_reduce(np.ones(4)),
        "dtype": lambda: mt.all_reduce(np.ones(3, np.float32)),
        "op": lambda: mt.all_reduce(small, "max"),
        "broadcast": lambda: mt.broadcast(small),
    }
    call = others[what] if ctx.rank == ctx.size - 1 else (lambda: mt.all_reduce(small))
    with pytest.raises(mt.CollectiveMismatchError):
        call().resolve()
    still_usable(ctx)


def test_inputs_the_lane_does_not_take_go_the_general_way(ctx):
    """Same dtype and shape as a lane, but byte-swapped, strided, a Tensor, a named op, a bad op."""
    base = np.arange(6, dtype=np.float64).reshape(2, 3)
    mt.all_reduce(base).resolve()
    assert (base.dtype, base.shape, None) in _lanes(ctx)
    expected = base * ctx.size
    swapped = base.astype(base.dtype.newbyteorder())
    strided = np.arange(12, dtype=np.float64).reshape(2, 6)[:, ::2]
    tensor = mt.from_numpy(base.copy())
    for given, want in [(swapped, expected), (strided, strided * ctx.size), (tensor, expected)]:
        for _ in range(2):
            got = mt.all_reduce(given).resolve()
            assert isinstance(got, mt.Tensor) and np.array_equal(got.numpy(), want)
    assert mt.all_reduce(tensor).resolve().device == tensor.device
    for _ in range(2):
        assert np.array_equal(mt.all_reduce(base, "sum").resolve().numpy(), expected)
    for bad in (["sum"], "median"):
        with pytest.raises((TypeError, ValueError)):
            mt.all_reduce(base, bad)
    still_usable(ctx)


def test_a_closed_context_is_refused_on_the_lane():
    ctx = mt.DistributedContext.init()
    mt.all_reduce(np.ones(3)).resolve()
    ctx.close()
    with pytest.raises(mt.MpitensorError):
        mt.all_reduce(np.ones(3))
    with mt.DistributedContext.init() as ctx:
        assert PLANS not in ctx.full_group.extra, "lanes belong to their context"
        assert mt.all_reduce(np.ones(3)).resolve().numpy().tolist() == [float(ctx.size)] * 3


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad", ["keyword", "positional", "no input"])
def test_a_call_all_reduce_does_not_take_fails_on_every_rank(ctx, bad):
    """Arguments all_reduce does not take raise on their rank, and the peers learn of it."""
    small = np.ones(3)
    for _ in range(2):
        mt.all_reduce(small).resolve()  # a lane for the peers' call
    if ctx.rank == ctx.size - 1:
        calls = {
            "keyword": lambda: mt.all_reduce(small, bogus=1),
            "positional": lambda: mt.all_reduce(small, "sum", None, "extra"),
            "no input": lambda: mt.all_reduce(op="sum"),
        }
        with pytest.raises(TypeError):
            calls[bad]()
    else:
        with pytest.raises(mt.CollectiveMismatchError, match="failed on another rank"):
            mt.all_reduce(small).resolve()
    still_usable(ctx)


class _Counted:
    """A lane that counts the calls it starts (the lane itself does the work)."""

    def __init__(self, lane: object) -> None:
        self.lane = lane
        self.calls = 0

    def start(self, tensor: object, array: np.ndarray) -> object:
        self.calls += 1
        return self.lane.start(tensor, array)


@pytest.mark.parametrize("check", [False, True])
def test_numbers_and_torch_tensors_take_the_lane_of_their_array(check):
    """Python numbers, NumPy scalars and CPU torch tensors: NumPy's result, in the input's kind.

    The first call of each takes the general path and keeps the lane of its array; the
    next ones take that lane (or its compiled twin, which the compiled entry may start
    without the Python lane object). A torch tensor written after the call does not change the
    result (the lane copies it at the call, as the general path does).
    """
    torch = pytest.importorskip("torch")
    kinds = {
        "float": (lambda x: float(x[()]), np.float64, ()),
        "int": (lambda x: int(x[()]), np.int64, ()),
        "numpy scalar": (lambda x: x[()], np.float32, ()),
        "torch": (torch.from_numpy, np.float32, (3,)),
        "torch 2-d": (torch.from_numpy, np.int64, (2, 2)),
    }
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        for name, (make, dtype, shape) in kinds.items():
            counted = None
            took = 0  # later calls started on the lane: in Python (counted), or by its compiled twin
            for turn in range(3):
                seed = seed_of("lane kinds", check, name, turn)
                inputs = [rank_input(seed, r, shape, dtype) for r in range(ctx.size)]
                expected = reference(OP.SUM, inputs)
                value = make(inputs[ctx.rank].copy())
                before = counted.calls if counted is not None else 0
                pending = mt.all_reduce(value)
                if counted is not None and (counted.calls > before or type(pending) is LaneTensor):
                    took += 1
                if isinstance(value, torch.Tensor):
                    value.zero_()
                got = pending.resolve()
                if isinstance(value, torch.Tensor):
                    ok = type(got) is torch.Tensor and np.allclose(got.numpy(), expected, rtol=1e-6)
                else:
                    ok = type(got) is type(value) and np.allclose(got, expected, rtol=1e-6)
                agree(bool(ok), f"{name}, call {turn}: {got!r} vs {expected!r}")
                if turn == 0:  # the lane kept by the first call: count what the next ones start on it
                    plans = ctx.full_group.extra[PLANS]
                    key = ("all_reduce", np.dtype(dtype), shape, None)
                    counted = plans[key] = _Counted(plans[key])
            agree(counted is not None and took == 2, f"{name}: the later calls took the lane")
        still_usable(ctx)


def test_torch_tensors_the_lane_does_not_take_are_still_reduced(ctx):
    """A tensor that requires grad, a non-contiguous one and a Parameter: the general path, same result."""
    torch = pytest.importorskip("torch")
    base = np.arange(6, dtype=np.float32).reshape(2, 3)
    mt.all_reduce(base).resolve()  # a lane for (float32, (2, 3))
    values = {
        "requires grad": torch.tensor(base, requires_grad=True),
        "non-contiguous": torch.from_numpy(base.T.copy()).t(),
        "Parameter": torch.nn.Parameter(torch.from_numpy(base.copy())),
    }
    for name, value in values.items():
        for _ in range(2):
            got = mt.all_reduce(value).resolve()
            ok = type(got) is torch.Tensor and np.array_equal(got.numpy(), base * ctx.size)
            agree(bool(ok), f"{name}: {got!r}")
    still_usable(ctx)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [False, True])
def test_ranks_giving_different_kinds_of_the_same_array_meet(check):
    """One rank a torch tensor, the next a NumPy array, the next a Tensor: lanes and the general path meet."""
    torch = pytest.importorskip("torch")
    makers = [torch.from_numpy, lambda x: x, mt.from_numpy]
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check)) as ctx:
        make = makers[ctx.rank % len(makers)]
        for op in (OP.SUM, OP.MEAN):
            for turn in range(3):
                inputs = [rank_input(seed_of("mixed kinds", check, op.name, turn), r, (2, 3), np.float32)
                          for r in range(ctx.size)]
                got = mt.all_reduce(make(inputs[ctx.rank].copy()), op).resolve()
                got = got.numpy() if hasattr(got, "numpy") else got
                expected = reference(op, inputs)
                agree(bool(np.allclose(got, expected, rtol=1e-6)), f"{op.name}, call {turn}: {got} vs {expected}")
        still_usable(ctx)


@pytest.mark.parametrize("check", [False, True])
def test_a_protected_input_on_its_lane_is_protected_until_resolved(check):
    """Beyond the small size the lane protects the input, as the general path does: writes raise in flight."""
    config = mt.DistributedConfig(check=check, shared_memory=False)
    with mt.DistributedContext.init(config=config) as ctx:
        for turn in range(3):
            for given in ("array", "Tensor"):
                inputs = [rank_input(seed_of("protected lane", check, turn, given), r, (40_000,), np.float64)
                          for r in range(ctx.size)]
                mine = inputs[ctx.rank].copy()
                value = mine if given == "array" else mt.from_numpy(mine)
                pending = mt.all_reduce(value)
                # A Tensor says it is in flight; a bare array is read-only meanwhile.
                refused = mt.TensorInFlightError if given == "Tensor" else ValueError
                with pytest.raises(refused, match=r"in flight|read-only"):
                    value[0] = 1.0
                got = pending.resolve().numpy()
                value[0] = got[0]  # writable again once resolved
                agree(bool(np.allclose(got, reference(OP.SUM, inputs), rtol=1e-12)), f"{given}, call {turn}")
        assert type(_lanes(ctx).get((np.dtype(np.float64), (40_000,), None))) is PlainLane
        still_usable(ctx)
