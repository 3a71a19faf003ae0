"""One rank's mistake gives every rank a clear error, and the context stays usable.

Each test has one rank (the last) misuse the API while the others call correctly, then
checks the error every rank gets, and that the next collective is right on every rank.
"""

from __future__ import annotations

import ctypes
import gc
import threading

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import rank_input

pytestmark = pytest.mark.mpi(min_size=2)


def _still_usable(ctx: mt.DistributedContext) -> None:
    inputs = [rank_input(7, r, (5,), np.float64) for r in range(ctx.size)]
    got = mt.all_reduce(inputs[ctx.rank]).resolve().numpy()
    np.testing.assert_allclose(got, np.sum(inputs, axis=0), rtol=1e-12)


def _outcome(call):
    """What a call gave: its resolved result, or the exception it (or resolve()) raised."""
    try:
        handle = call()
        return handle.resolve() if isinstance(handle, mt.CollectiveTensor) else handle
    except Exception as exc:
        return exc


def _others(size: int) -> list[int]:
    return list(range(size - 1))


# (name, collective, the good call, the bad call on the last rank, its error type, a fragment of it)
LOCAL_FAILURES = [
    ("object dtype", "all_reduce", lambda: mt.all_reduce(np.ones(4)),
     lambda: mt.all_reduce(np.ones(4, dtype=object)), TypeError, "dtype object cannot be communicated"),
    ("None input", "all_reduce", lambda: mt.all_reduce(np.ones(4)),
     lambda: mt.all_reduce(None), TypeError, "got NoneType"),
    ("a list of strings", "all_reduce", lambda: mt.all_reduce(np.ones(4)),
     lambda: mt.all_reduce(["a", "b"]), TypeError, "every tensor of the list"),
    ("unknown op", "all_reduce", lambda: mt.all_reduce(np.ones(4)),
     lambda: mt.all_reduce(np.ones(4), "foo"), ValueError, "foo"),
    ("a device of no context", "all_reduce", lambda: mt.all_reduce(np.ones(4)),
     lambda: mt.all_reduce(np.ones(4), devices=[mt.Device("cpu", 0, 99)]), mt.DeviceError, "is not in this context"),
    ("a bad dtype to broadcast", "broadcast", lambda: mt.broadcast(np.ones(4), root=0),
     lambda: mt.broadcast(None, root=0, shape=(4,), dtype="no-such-dtype"), TypeError, "no-such-dtype"),
    ("reduce with a bad op", "reduce", lambda: mt.reduce(np.ones(4), root=0),
     lambda: mt.reduce(np.ones(4), "foo", root=0), ValueError, "foo"),
    ("all_gather of strings", "all_gather", lambda: mt.all_gather(np.ones(4)),
     lambda: mt.all_gather(np.array(["a"])), TypeError, "cannot be communicated"),
    ("all_gather with a bad axis", "all_gather", lambda: mt.all_gather(np.ones(4)),
     lambda: mt.all_gather(np.ones(4), axis=3), ValueError, "axis 3 is out of range"),
    ("reduce_scatter of objects", "reduce_scatter", lambda: mt.reduce_scatter(np.ones(4 * mt.current_context().size)),
     lambda: mt.reduce_scatter(np.ones(4, dtype=object)), TypeError, "cannot be communicated"),
    ("all_to_all of None", "all_to_all", lambda: mt.all_to_all(np.ones(2 * mt.current_context().size)),
     lambda: mt.all_to_all(None), TypeError, "got NoneType"),
    ("barrier with bad devices", "barrier", mt.barrier, lambda: mt.barrier(devices="all"), TypeError,
     "devices must be"),
]


@pytest.mark.parametrize("case", LOCAL_FAILURES, ids=[c[0] for c in LOCAL_FAILURES])
def test_a_call_that_fails_on_one_rank_fails_on_every_rank(ctx, case):
    _, kind, good, bad, error, fragment = case
    last = ctx.size - 1
    got = _outcome(bad if ctx.rank == last else good)
    if ctx.rank == last:
        assert isinstance(got, error), repr(got)
        assert error is mt.DeviceError or not isinstance(got, mt.MpitensorError), repr(got)
        assert fragment in str(got)
    else:
        assert isinstance(got, mt.CollectiveMismatchError), repr(got)
        assert f"rank {last}'s {kind} failed on that rank: {error.__name__}: " in str(got)
        assert fragment in str(got)
    _still_usable(ctx)


def test_every_rank_failing_alike_raises_only_their_own_errors(ctx):
    for _ in range(3):
        with pytest.raises(TypeError, match="dtype object"):
            mt.all_reduce(np.ones(3, dtype=object))
    _still_usable(ctx)


def _call_of(kind: str, size: int):
    calls = {
        "all_reduce": lambda: mt.all_reduce(np.ones(4)),
        "fused all_reduce": lambda: mt.all_reduce([np.ones(4), np.ones(2)]),
        "broadcast": lambda: mt.broadcast(np.ones(4), root=0),
        "reduce": lambda: mt.reduce(np.ones(4), root=0),
        "all_gather": lambda: mt.all_gather(np.ones(4)),
        "reduce_scatter": lambda: mt.reduce_scatter(np.ones(2 * size)),
        "all_to_all": lambda: mt.all_to_all(np.ones(2 * size)),
        "barrier": mt.barrier,
    }
    return calls[kind]


KINDS = ["all_reduce", "fused all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all",
         "barrier"]
PAIRS = [(a, b) for a in KINDS for b in KINDS if a != b]


@pytest.mark.parametrize(("usual", "odd"), PAIRS, ids=[f"{a}-vs-{b}" for a, b in PAIRS])
def test_any_two_different_collectives_meet_as_a_mismatch(ctx, usual, odd):
    last = ctx.size - 1
    got = _outcome(_call_of(odd if ctx.rank == last else usual, ctx.size))
    assert isinstance(got, mt.CollectiveMismatchError), repr(got)
    message = str(got)
    assert f"called {usual}" in message and f"rank {last} called {odd}" in message, message
    _still_usable(ctx)


def test_a_fused_mismatch_names_the_entry_with_shapes_and_dtypes(ctx):
    last = ctx.size - 1
    odd = {"w": np.ones((2, 3)), "b": np.ones(3, np.float32)}
    usual = {"w": np.ones((2, 3)), "b": np.ones(3)}
    got = _outcome(lambda: mt.all_reduce(odd if ctx.rank == last else usual))
    assert isinstance(got, mt.CollectiveMismatchError), repr(got)
    assert "entries at index 1" in str(got)
    assert "'b': shape (3,) float64" in str(got) and f"rank {last} passed 'b': shape (3,) float32" in str(got)
    assert "argument" not in str(got)
    _still_usable(ctx)


@pytest.mark.parametrize("lane", [False, True])
def test_a_collective_from_another_thread_raises_instead_of_pairing_wrongly(ctx, lane):
    """Also where the owner thread's calls of that kind take their lane (see `_collectives/lane.py`)."""
    for _ in range(2 if lane else 0):
        mt.all_reduce(np.ones(3)).resolve()
    errors = []

    def worker():
        try:
            mt.all_reduce(np.ones(3))
        except mt.MpitensorError as exc:
            errors.append(exc)

    thread = threading.Thread(target=worker, name="worker")
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], mt.ThreadMisuseError)
    assert "thread 'worker'" in str(errors[0]) and "opened it" in str(errors[0])
    _still_usable(ctx)


def test_a_handle_may_be_resolved_on_another_thread(ctx):
    pending = mt.all_reduce(np.full(3, float(ctx.rank)))
    out = []
    thread = threading.Thread(target=lambda: out.append(pending.resolve()))
    thread.start()
    thread.join()
    assert out[0].numpy().tolist() == [float(sum(range(ctx.size)))] * 3


@pytest.mark.parametrize("check", [True, False])
def test_dropped_handles_release_their_memory_as_they_complete(check):
    psutil = pytest.importorskip("psutil")
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=check, shared_memory=False)) as ctx:
        data = np.ones(12_288)  # 96 KiB: protected in flight, not copied (nor pooled)
        for _ in range(200):
            mt.all_reduce(data)
        mt.barrier()
        gc.collect()
        before = psutil.Process().memory_info().rss
        for _ in range(10_000):
            mt.all_reduce(data)  # fire and forget
        gc.collect()
        grown = psutil.Process().memory_info().rss - before
        assert grown < 50 << 20, f"10,000 dropped 96 KiB all-reduces grew this rank by {grown >> 20} MiB"
        _still_usable(ctx)


def _foreign_arrays(n: int):
    """Arrays whose memory another object owns, with a way to write that memory directly."""
    c_buffer = (ctypes.c_double * n)(*([1.0] * n))
    byte_buffer = bytearray(np.ones(n).tobytes())

    def write_bytes(value):
        byte_buffer[:] = np.full(n, value).tobytes()

    def write_ctypes(value):
        # The source must outlive the copy: `.ctypes.data` of a temporary would point at
        # memory freed before memmove reads it (unmapped at 4 MiB, hence a crash).
        source = np.full(n, value)
        ctypes.memmove(c_buffer, source.ctypes.data, 8 * n)

    return [
        ("ctypes", np.ctypeslib.as_array(c_buffer), write_ctypes),
        ("bytearray", np.frombuffer(byte_buffer, np.float64), write_bytes),
    ]


@pytest.mark.parametrize("n", [3072, 16368, 524280])  # 24 KiB, 128 KiB, 4 MiB; divisible by 1-4 ranks
@pytest.mark.parametrize("collective", ["all_reduce", "reduce", "reduce_scatter", "all_gather", "all_to_all"])
def test_memory_another_library_owns_is_copied_before_it_can_change(ctx, n, collective):
    for name, array, write in _foreign_arrays(n):
        size = ctx.size
        if collective == "all_reduce":
            pending = mt.all_reduce(array)
            expected = np.full(n, float(size))
        elif collective == "reduce":
            pending = mt.reduce(array, root=0)
            expected = np.full(n, float(size)) if ctx.rank == 0 else None
        elif collective == "reduce_scatter":
            pending = mt.reduce_scatter(array)
            expected = np.full(n // size, float(size))
        elif collective == "all_gather":
            pending = mt.all_gather(array)
            expected = np.ones(n * size)
        else:
            pending = mt.all_to_all(array)
            expected = np.ones(n)
        write(200.0)  # behind mpitensor's back, before the result is resolved
        result = pending.resolve()
        if expected is None:
            assert result is None
        else:
            np.testing.assert_array_equal(result.numpy(), expected, err_msg=f"{name} input, {collective}")
        mt.barrier()
