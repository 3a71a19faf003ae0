"""torch.distributed on the "mpitensor" backend, misused: every rank gets an error, the next call is right.

A rank whose own arguments are bad raises there and takes the call's turn (its peers raise
``CollectiveMismatchError`` naming it); ranks whose sizes disagree raise
``CollectiveMismatchError`` on every rank; and after each, the next collective gives
NumPy's result over every rank's input. Besides, what gloo runs and the backend refused:
zero rows in ``all_to_all_single``, parameters, conjugate views.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import rank_input, seed_of

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
import mpitensor.torch  # noqa: E402 - registers the backend, after the skip when torch is missing

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.fixture(scope="module")
def world(module_ctx: mt.DistributedContext) -> Iterator[mt.DistributedContext]:
    """torch's default process group on the mpitensor backend, over the module's context."""
    torch.set_num_threads(1)
    dist.init_process_group("mpitensor")
    yield module_ctx
    dist.destroy_process_group()


def inputs(name: str, shape: tuple[int, ...], size: int, dtype: Any = np.float64) -> list[np.ndarray]:
    """Every rank's input of test `name`."""
    return [rank_input(seed_of(name, shape, str(dtype)), rank, shape, dtype) for rank in range(size)]


def next_call_is_right(world: mt.DistributedContext) -> None:
    """An all-reduce after a misuse gives the sum of every rank's input (no call is one behind)."""
    arrays = inputs("next", (5,), world.size)
    tensor = torch.from_numpy(arrays[world.rank].copy())
    dist.all_reduce(tensor)
    np.testing.assert_allclose(tensor.numpy(), np.sum(arrays, axis=0), rtol=1e-12)


def expect_error(call: Callable[[], Any], error: type[BaseException], *patterns: str) -> BaseException:
    """Run `call`, which must raise `error` whose message holds every one of `patterns`."""
    with pytest.raises(error) as caught:
        call()
    for pattern in patterns:
        assert pattern in str(caught.value), f"{pattern!r} not in {caught.value}"
    return caught.value


# -- a local error takes its turn ----------------------------------------------------------


def _bad_and_good(world: mt.DistributedContext, case: str) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(rank 0's bad call, a peer's good call) of one kind; the good one pairs with the bad one's turn."""
    n = world.size
    if case == "non-contiguous all_reduce":
        return lambda: dist.all_reduce(torch.zeros(4, 4).t()), lambda: dist.all_reduce(torch.zeros(4, 4))
    if case == "sparse all_reduce with MAX":
        return (lambda: dist.all_reduce(torch.zeros(4).to_sparse(), op=dist.ReduceOp.MAX),
                lambda: dist.all_reduce(torch.zeros(4)))
    if case == "all_gather list length":
        return (lambda: dist.all_gather([torch.zeros(2) for _ in range(n + 1)], torch.zeros(2)),
                lambda: dist.all_gather([torch.zeros(2) for _ in range(n)], torch.zeros(2)))
    if case == "all_to_all_single uneven rows":
        return (lambda: dist.all_to_all_single(torch.zeros(n + 1, 2), torch.zeros(n + 1, 2)),
                lambda: dist.all_to_all_single(torch.zeros(n, 2), torch.zeros(n, 2)))
    if case == "broadcast of a dtype mpitensor cannot carry":
        return (lambda: dist.broadcast(torch.zeros(4, dtype=torch.float8_e4m3fn), src=0),
                lambda: dist.broadcast(torch.zeros(4), src=0))
    if case == "reduce_scatter input_list length":
        return (lambda: dist.reduce_scatter(torch.zeros(2), [torch.zeros(2) for _ in range(n + 1)]),
                lambda: dist.reduce_scatter(torch.zeros(2), [torch.zeros(2) for _ in range(n)]))
    raise AssertionError(case)


LOCAL_ERRORS = {
    "non-contiguous all_reduce": (ValueError, "contiguous", "all_reduce"),
    "sparse all_reduce with MAX": (ValueError, "SUM only", "all_reduce"),
    "all_gather list length": (ValueError, "tensor_list has", "all_gather"),
    "all_to_all_single uneven rows": (ValueError, "do not split evenly", "all_to_all"),
    "broadcast of a dtype mpitensor cannot carry": (TypeError, "float8_e4m3fn", "broadcast"),
    "reduce_scatter input_list length": (ValueError, "input_list has", "reduce_scatter"),
}


@pytest.mark.parametrize("case", list(LOCAL_ERRORS))
def test_a_local_error_on_one_rank_takes_its_turn(world, case):
    """Rank 0's argument error raises there; the peers' call raises naming rank 0, not the next call's data."""
    error, text, kind = LOCAL_ERRORS[case]
    bad, good = _bad_and_good(world, case)
    if world.rank == 0:
        expect_error(bad, error, text)
    else:
        expect_error(good, mt.CollectiveMismatchError, f"rank 0's {kind} failed on that rank", text)
    next_call_is_right(world)


def test_a_peer_goes_on_after_catching_its_error(world):
    """The case of a caught error: the failing rank's next all-reduce pairs with its peers' next one."""
    arrays = inputs("caught", (3,), world.size)
    tensor = torch.from_numpy(arrays[world.rank].copy())
    if world.rank == 0:
        with pytest.raises(ValueError, match="contiguous"):
            dist.all_reduce(torch.zeros(3, 3).t())
    else:
        with pytest.raises(mt.CollectiveMismatchError, match="rank 0"):
            dist.all_reduce(torch.full((3,), 100.0))
    dist.all_reduce(tensor)
    np.testing.assert_allclose(tensor.numpy(), np.sum(arrays, axis=0), rtol=1e-12)


# -- all_to_all_single with zero rows --------------------------------------------------------


@pytest.mark.parametrize("empty", ["one rank", "every rank"])
def test_all_to_all_single_with_zero_rows(world, empty):
    """An expert with no tokens: split sizes with zeros, empty tensors; NumPy's reference of every rank's rows."""
    n, rank = world.size, world.rank
    # rows[i][j]: what rank i sends rank j; rank 0 sends nothing, and with "every rank" nobody sends rank 0.
    rows = [[0 if i == 0 or (empty == "every rank" and j == 0) else i + j for j in range(n)] for i in range(n)]
    sent = [np.arange(sum(rows[i]) * 3, dtype=np.float32).reshape(-1, 3) + 100 * i for i in range(n)]
    incoming = [rows[i][rank] for i in range(n)]
    out = torch.full((sum(incoming), 3), -1.0)
    dist.all_to_all_single(out, torch.from_numpy(sent[rank].copy()), incoming, rows[rank])
    expected = [sent[i][sum(rows[i][:rank]): sum(rows[i][: rank + 1])] for i in range(n)]
    np.testing.assert_array_equal(out.numpy(), np.concatenate(expected).reshape(-1, 3))
    next_call_is_right(world)


# -- every rank's size against every rank's outputs -------------------------------------------


def _sizes(rank: int) -> int:
    return 2 if rank % 2 == 0 else 4


LIST_CASES = ["all_gather", "gather", "scatter", "all_to_all"]


def _list_call(world: mt.DistributedContext, case: str, size_of: Callable[[int], int],
               out_size: Callable[[int, int], int]) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """Rank k's input(s) of size_of(k) elements into outputs of out_size(receiver, sender)."""
    n, rank = world.size, world.rank
    value = float(rank + 1)
    if case == "all_gather":
        outs = [torch.zeros(out_size(rank, k)) for k in range(n)]
        return lambda: dist.all_gather(outs, torch.full((size_of(rank),), value)), outs
    if case == "gather":
        outs = [torch.zeros(out_size(0, k)) for k in range(n)] if rank == 0 else []
        return lambda: dist.gather(torch.full((size_of(rank),), value), outs if rank == 0 else None, dst=0), outs
    if case == "scatter":
        out = torch.zeros(out_size(rank, rank))  # the root's piece for this rank
        pieces = [torch.full((size_of(k),), float(k + 1)) for k in range(n)] if rank == 0 else None
        return lambda: dist.scatter(out, pieces, src=0), [out]
    outs = [torch.zeros(out_size(rank, k)) for k in range(n)]
    pieces = [torch.full((size_of(rank),), value) for _ in range(n)]
    return lambda: dist.all_to_all(outs, pieces), outs


@pytest.mark.parametrize("case", LIST_CASES)
@pytest.mark.parametrize("totals", ["equal", "different"])
def test_list_collectives_check_every_ranks_size(world, case, totals):
    """Inputs of 2 and 4 elements into outputs of 3 each (equal totals) or 3 and 4: a mismatch on every rank."""
    wrong = (lambda receiver, sender: 3) if totals == "equal" else (lambda receiver, sender: 3 + sender % 2)
    call, _ = _list_call(world, case, _sizes, wrong)
    error = expect_error(call, mt.CollectiveMismatchError)
    message = str(error)
    assert "sends 2 elements" in message or "sends 4 elements" in message or "rank 0" in message, message
    assert "holds 3" in message or "failed on that rank" in message, message
    next_call_is_right(world)


@pytest.mark.parametrize("case", LIST_CASES)
def test_list_collectives_of_unequal_sizes_that_agree(world, case):
    """Each rank's own size, and outputs of those sizes: NumPy's result on every rank."""
    size_of = (lambda k: k + 1) if case == "scatter" else _sizes
    call, outs = _list_call(world, case, size_of, lambda receiver, sender: size_of(sender))
    call()
    n, rank = world.size, world.rank
    if case == "scatter":
        np.testing.assert_array_equal(outs[0].numpy(), np.full(rank + 1, rank + 1.0))
    elif case != "gather" or rank == 0:
        for k, out in enumerate(outs):
            np.testing.assert_array_equal(out.numpy(), np.full(size_of(k), k + 1.0))
    assert len(outs) == (n if case != "scatter" and (case != "gather" or rank == 0) else len(outs))
    next_call_is_right(world)


@pytest.mark.mpi(min_size=3)
def test_all_gather_into_tensor_of_unequal_inputs_is_a_mismatch_on_every_rank(world):
    """3, 4 and 5 elements into outputs of 4 per rank: never chunks that are not the ranks' inputs."""
    n, rank = world.size, world.rank
    out = torch.zeros(4 * n)
    tensor = torch.full((3 + rank % 3,), float(rank))
    expect_error(lambda: dist.all_gather_into_tensor(out, tensor), mt.CollectiveMismatchError, "rank")
    next_call_is_right(world)
    # Every rank's output right for its own input, the inputs unequal: the check's mismatch of shapes.
    out = torch.zeros((3 + rank % 3) * n)
    expect_error(lambda: dist.all_gather_into_tensor(out, tensor), mt.CollectiveMismatchError, "shape")
    next_call_is_right(world)


def test_all_to_all_single_split_sizes_against_the_senders(world):
    """A rank whose output split sizes differ from what its peers send: a mismatch on every rank."""
    n, rank = world.size, world.rank
    sends = [1 + (rank + j) % 2 for j in range(n)]  # what this rank sends rank j
    receives = [1 + (i + rank) % 2 for i in range(n)]  # what rank i sends this rank
    if rank == 0:  # one row more from rank 0 and one less from rank 1: the same total
        receives = [receives[0] + 1, receives[1] - 1, *receives[2:]]
    out = torch.zeros(sum(receives))
    expect_error(lambda: dist.all_to_all_single(out, torch.ones(sum(sends)), receives, sends),
                 mt.CollectiveMismatchError, "output_split_sizes")
    next_call_is_right(world)


# -- barrier against monitored_barrier -------------------------------------------------------


@pytest.mark.parametrize("monitored", [0, 1])
def test_barrier_against_monitored_barrier_is_a_mismatch_on_every_rank(world, monitored):
    """One rank's dist.barrier() against the others' monitored_barrier: an error on every rank at once."""
    start = time.monotonic()
    if world.rank == monitored:
        call = lambda: dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))  # noqa: E731
    else:
        call = dist.barrier
    expect_error(call, mt.CollectiveMismatchError, "called barrier", "called scan")
    assert time.monotonic() - start < 30, "the mismatch took as long as a timeout"
    next_call_is_right(world)
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=60), wait_all_ranks=True)
    dist.barrier()
    next_call_is_right(world)


# -- parameters, conjugate views -------------------------------------------------------------


def test_parameters_are_written_as_gloo_writes_them(world):
    """dist.broadcast and dist.all_reduce of an nn.Parameter write its values; it stays a leaf that requires grad."""
    arrays = inputs("parameter", (3, 2), world.size)
    for root in range(world.size):
        param = torch.nn.Parameter(torch.from_numpy(arrays[world.rank].copy()))
        dist.broadcast(param, src=root)
        np.testing.assert_array_equal(param.detach().numpy(), arrays[root])
        assert param.requires_grad and param.is_leaf
    param = torch.nn.Parameter(torch.from_numpy(arrays[world.rank].copy()))
    dist.all_reduce(param)
    np.testing.assert_allclose(param.detach().numpy(), np.sum(arrays, axis=0), rtol=1e-12)
    big = torch.nn.Parameter(torch.ones(40_000))  # above 64 KiB: the in-place path
    dist.all_reduce(big, async_op=True).wait()
    assert bool((big.detach() == world.size).all())
    next_call_is_right(world)


def _complex(name: str, size: int) -> list[np.ndarray]:
    real, imag = inputs(name + "-re", (4,), size), inputs(name + "-im", (4,), size)
    return [(re + 1j * im).astype(np.complex64) for re, im in zip(real, imag)]


@pytest.mark.parametrize("async_op", [False, True])
def test_conjugate_views_carry_the_values_they_show(world, async_op):
    """z.conj() in all_reduce, broadcast, all_gather and all_gather_into_tensor: NumPy's result of the views' values."""
    n, rank = world.size, world.rank
    shown = [np.conj(z) for z in _complex("conj", n)]  # what each rank's view shows
    mine = torch.from_numpy(np.conj(shown[rank]).copy())  # z, whose .conj() shows shown[rank]

    def done(work: Any) -> None:
        if async_op:
            work.wait()

    view = mine.clone().conj()
    done(dist.all_reduce(view, async_op=async_op))
    assert view.is_conj()
    np.testing.assert_allclose(view.resolve_conj().numpy(), np.sum(shown, axis=0), rtol=1e-5)
    view = mine.clone().conj()
    done(dist.broadcast(view, src=n - 1, async_op=async_op))
    np.testing.assert_array_equal(view.resolve_conj().numpy(), shown[n - 1])
    outs = [torch.zeros(4, dtype=torch.complex64).conj() for _ in range(n)]
    done(dist.all_gather(outs, mine.conj(), async_op=async_op))
    for out, expected in zip(outs, shown):
        np.testing.assert_array_equal(out.resolve_conj().numpy(), expected)
    into = torch.zeros(4 * n, dtype=torch.complex64)
    done(dist.all_gather_into_tensor(into, mine.conj(), async_op=async_op))
    np.testing.assert_array_equal(into.numpy(), np.concatenate(shown))
    next_call_is_right(world)


def test_send_and_recv_of_conjugate_views(world):
    n, rank = world.size, world.rank
    shown = [np.conj(z) for z in _complex("p2p", n)]
    right, left = (rank + 1) % n, (rank - 1) % n
    if rank % 2 == 0:
        dist.send(torch.from_numpy(np.conj(shown[rank]).copy()).conj(), dst=right)
        got = torch.zeros(4, dtype=torch.complex64).conj()
        dist.recv(got, src=left)
    else:
        got = torch.zeros(4, dtype=torch.complex64).conj()
        dist.recv(got, src=left)
        dist.send(torch.from_numpy(np.conj(shown[rank]).copy()).conj(), dst=right)
    if n % 2 == 0 or rank != 0:
        np.testing.assert_array_equal(got.resolve_conj().numpy(), shown[left])
    next_call_is_right(world)


# -- point to point ---------------------------------------------------------------------------


def test_a_send_refused_on_its_rank_is_an_error_at_the_receiver(world):
    """A sparse tensor's send raises on the sender; the receiver raises too, naming it, instead of waiting."""
    if world.rank == 0:
        expect_error(lambda: dist.send(torch.zeros(4).to_sparse(), dst=1), ValueError, "dense tensors")
    elif world.rank == 1:
        expect_error(lambda: dist.recv(torch.zeros(4), src=0), mt.CollectiveMismatchError, "rank 0")
    _a_message_goes_through(world)


def test_a_recv_refused_on_its_rank_takes_its_message(world):
    """A receive refused there still takes the message it was for: the sender completes, the next pair is right."""
    if world.rank == 0:
        dist.send(torch.full((4,), 9.0), dst=1)
    elif world.rank == 1:
        expect_error(lambda: dist.recv(torch.zeros(4).to_sparse(), src=0), ValueError, "dense tensors")
    _a_message_goes_through(world)


def _a_message_goes_through(world: mt.DistributedContext) -> None:
    arrays = inputs("message", (2, 3), 2)
    if world.rank == 0:
        dist.send(torch.from_numpy(arrays[0].copy()).t(), dst=1)  # a non-contiguous tensor is sent as it shows
    elif world.rank == 1:
        got = torch.zeros(3, 2, dtype=torch.float64)
        dist.recv(got, src=0)
        np.testing.assert_array_equal(got.numpy(), arrays[0].T)
    next_call_is_right(world)


# -- object collectives -------------------------------------------------------------------------


def test_an_object_that_does_not_pickle_takes_its_turn(world):
    """broadcast_object_list with a lock on the source: it raises there, the peers raise naming it."""
    objects = [threading.Lock(), 1] if world.rank == 0 else [None, None]
    if world.rank == 0:
        expect_error(lambda: dist.broadcast_object_list(objects, src=0), TypeError, "pickle")
    else:
        expect_error(lambda: dist.broadcast_object_list(objects, src=0), mt.CollectiveMismatchError,
                     "rank 0's broadcast failed on that rank", "pickle")
    next_call_is_right(world)
    everyone = [None] * world.size
    mine = threading.Lock() if world.rank == world.size - 1 else world.rank
    if world.rank == world.size - 1:
        expect_error(lambda: dist.all_gather_object(everyone, mine), TypeError, "pickle")
    else:
        expect_error(lambda: dist.all_gather_object(everyone, mine), mt.CollectiveMismatchError, "pickle")
    next_call_is_right(world)
    objects = [world.rank, "x" * world.rank]
    dist.broadcast_object_list(objects, src=world.size - 1)
    assert objects == [world.size - 1, "x" * (world.size - 1)]
