"""send and recv between pairs of ranks."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import ALL_DTYPES, rank_input, seed_of

pytestmark = pytest.mark.mpi(min_size=2)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
def test_ring_exchange(module_ctx, dtype):
    ctx = module_ctx
    right, left = (ctx.rank + 1) % ctx.size, (ctx.rank - 1) % ctx.size
    seed = seed_of("ring", np.dtype(dtype).name)
    incoming = mt.recv(source=left, tag=7)
    outgoing = mt.send(rank_input(seed, ctx.rank, (3, 2), dtype), right, tag=7)
    got = incoming.resolve()
    assert outgoing.resolve() is None
    np.testing.assert_array_equal(got.numpy(), rank_input(seed, left, (3, 2), dtype))
    assert got.dtype == np.dtype(dtype)


def test_tags_keep_messages_apart_and_templates_are_checked(module_ctx):
    ctx = module_ctx
    if ctx.rank == 0:
        mt.send(np.arange(3.0), 1, tag=1)
        mt.send(np.arange(5, dtype=np.int32), 1, tag=2).resolve()
    elif ctx.rank == 1:
        second = mt.recv(mt.zeros(5, dtype=np.int32), 0, tag=2)
        first = mt.recv(0, shape=(3,), dtype=np.float64, tag=1)
        np.testing.assert_array_equal(first.resolve().numpy(), np.arange(3.0))
        np.testing.assert_array_equal(second.resolve().numpy(), np.arange(5))
    mt.barrier()


def test_a_receive_from_any_rank_takes_every_message_and_names_its_sender(module_ctx):
    ctx = module_ctx
    seed = seed_of("any-source")
    if ctx.rank == 0:
        got = {}
        for _ in range(ctx.size - 1):
            handle = mt.recv(source=mt.ANY_SOURCE, tag=9)
            tensor = handle.resolve()
            assert isinstance(handle, mt.ReceiveTensor) and handle.source not in got, handle.source
            got[handle.source] = tensor.numpy()
        assert sorted(got) == list(range(1, ctx.size))
        for sender, data in got.items():
            np.testing.assert_array_equal(data, rank_input(seed, sender, (2, 3), np.float32))
    else:
        mt.send(rank_input(seed, ctx.rank, (2, 3), np.float32), 0, tag=9).resolve()
    named = mt.recv(source=(ctx.rank - 1) % ctx.size, tag=10)
    mt.send(np.full(1, float(ctx.rank)), (ctx.rank + 1) % ctx.size, tag=10).resolve()
    assert named.resolve().numpy().tolist() == [float((ctx.rank - 1) % ctx.size)]
    assert named.source == (ctx.rank - 1) % ctx.size
    mt.barrier()


def test_a_shape_mismatch_names_both_sides(module_ctx):
    ctx = module_ctx
    if ctx.rank == 0:
        mt.send(np.ones(4), 1, tag=3).resolve()
    elif ctx.rank == 1:
        expected = r"rank 0 sent a tensor of shape \(4,\).*expects shape \(5,\)"
        with pytest.raises(mt.CollectiveMismatchError, match=expected):
            mt.recv(0, shape=(5,), dtype=np.float64, tag=3).resolve()
        # The unexpected message was consumed: the next receive is unaffected.
    if ctx.rank == 0:
        mt.send(np.full(2, 9.0), 1, tag=3).resolve()
    elif ctx.rank == 1:
        np.testing.assert_array_equal(mt.recv(0, tag=3).resolve().numpy(), [9.0, 9.0])
    mt.barrier()


def test_bad_peers_and_tags(module_ctx):
    ctx = module_ctx
    with pytest.raises(ValueError, match="a rank cannot send to itself"):
        mt.send(np.ones(1), ctx.rank)
    with pytest.raises(ValueError, match=rf"dest {ctx.size} is out of range"):
        mt.send(np.ones(1), ctx.size)
    with pytest.raises(ValueError, match=r"tag must be in 0\.\.16383"):
        mt.send(np.ones(1), (ctx.rank + 1) % ctx.size, tag=-1)
    with pytest.raises(TypeError, match="recv needs source="):
        mt.recv()


def test_ping_pong_sends_back_what_it_received(module_ctx):
    ctx = module_ctx
    big = 1 << 15  # large enough to be protected in flight, not copied
    if ctx.rank == 0:
        mt.send(np.arange(float(big)), 1).resolve()
        back = mt.recv(source=1).resolve()
        np.testing.assert_array_equal(back.numpy(), np.arange(float(big)))
    elif ctx.rank == 1:
        mt.send(mt.recv(source=0).resolve(), 0).resolve()
    mt.barrier()
