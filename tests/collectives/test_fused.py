"""The fused all-reduce of lists, tuples and dicts of tensors."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._collectives.fused import plan_buckets
from mpitensor._core.dtypes import reduce_plan
from tests.helpers import OP, assert_matches, in_shared_memory, rank_input, reference, rejects, seed_of

SPECS = [((3,), np.float32), ((2, 5), np.float64), ((), np.int32), ((4,), np.int8), ((0,), np.float32),
         ((7, 3), np.float32), ((6,), np.bool_), ((2,), np.complex128)]


def _inputs(seed: int, rank: int) -> list[np.ndarray]:
    return [rank_input(seed + i, rank, shape, dtype) for i, (shape, dtype) in enumerate(SPECS)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bucket_bytes", [16, 64, 1 << 20])
@pytest.mark.parametrize("op", list(OP), ids=lambda o: o.name)
def test_fused_equals_per_tensor_results(module_ctx, op, bucket_bytes):
    ctx = module_ctx
    seed = seed_of("fused", op.name, bucket_bytes)
    # Bitwise ops reduce the integer and bool tensors; with a float among them the call raises.
    specs_ok = [i for i, (_, dtype) in enumerate(SPECS) if not rejects(op, dtype)]
    mine = _inputs(seed, ctx.rank)
    with mt.DistributedContext.init(config=mt.DistributedConfig(bucket_bytes=bucket_bytes)):
        if len(specs_ok) < len(SPECS):
            with pytest.raises(TypeError, match="bitwise reduction"):
                mt.all_reduce(mine, op)
        results = mt.all_reduce([mine[i] for i in specs_ok], op).resolve()
        singles = [mt.all_reduce(mine[i], op).resolve() for i in specs_ok]
    assert isinstance(results, list) and len(results) == len(specs_ok)
    everyone = [_inputs(seed, r) for r in range(ctx.size)]
    for index, got, single in zip(specs_ok, results, singles):
        expected = reference(op, [inputs[index] for inputs in everyone])
        assert_matches(got, expected, op, ctx.size)
        assert_matches(got, np.asarray(single), op, ctx.size)


@pytest.mark.mpi(min_size=1)
def test_structures_are_kept(module_ctx):
    ctx = module_ctx
    pair = mt.all_reduce((np.ones(2), mt.ones(3, dtype=np.int64))).resolve()
    assert isinstance(pair, tuple) and len(pair) == 2
    named = mt.all_reduce({"w": np.ones((2, 2)), "b": np.zeros(2)}, "mean").resolve()
    assert list(named) == ["w", "b"]
    np.testing.assert_array_equal(named["w"].numpy(), np.ones((2, 2)))
    np.testing.assert_array_equal(pair[1].numpy(), np.full(3, ctx.size))
    assert mt.all_reduce([]).resolve() == []


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("shape", [(3, 4), (), (0,), (5,), (2, 0, 3)], ids=str)
@pytest.mark.parametrize("count", [1, 2, 7])
def test_tensors_of_one_shape(module_ctx, shape, count):
    """Equal shapes (unpacked as rows of the bucket) give every tensor its own result, in place order."""
    ctx = module_ctx
    seed = seed_of("one shape", shape, count)
    everyone = [[rank_input(seed + i, r, shape, np.float64) for i in range(count)] for r in range(ctx.size)]
    results = mt.all_reduce(everyone[ctx.rank]).resolve()
    for index, got in enumerate(results):
        assert_matches(got, reference(OP.SUM, [mine[index] for mine in everyone]), OP.SUM, ctx.size)
    if count > 1 and np.prod(shape) > 0:
        results[0].numpy()[...] = 7.0  # each result is its own memory
        assert not (results[1].numpy() == 7.0).all()


@pytest.mark.mpi(min_size=2)
def test_fused_results_are_bit_identical_on_every_rank(module_ctx):
    ctx = module_ctx
    mine = [rank_input(seed_of("bits", i), ctx.rank, (257,), np.float32) for i in range(20)]
    results = mt.all_reduce(mine, "mean").resolve()
    packed = np.concatenate([np.asarray(r).view(np.uint32) for r in results])
    everyone = mt.all_gather(packed[None, :]).resolve().numpy()
    assert (everyone == everyone[0]).all()


@pytest.mark.mpi(min_size=1)
def test_inputs_may_be_reused_at_once(module_ctx):
    ctx = module_ctx
    grads = [np.ones(4), np.ones(3)]
    pending = mt.all_reduce(grads)
    grads[0][:] = 100.0  # packed into the bucket at the call: this cannot change the result
    np.testing.assert_array_equal(pending.resolve()[0].numpy(), np.full(4, float(ctx.size)))


# Two float32 buckets, then one each of int32, float64 and float16 (rounded back: MPI's).
LARGE_SPECS = [((50_000,), np.float32), ((250, 200), np.float32), ((30,), np.float32), ((70_000,), np.int32),
               ((5,), np.float64), ((1000,), np.float16), ((3, 4), np.float32)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("op, factors", [(OP.SUM, (None, None)), (OP.MEAN, (None, None)), (OP.MAX, (None, None)),
                                         (OP.PROD, (None, None)), (OP.SUM, (2, 3))], ids=str)
def test_large_buckets_reduce_in_shared_memory(module_ctx, op, factors, check):
    """Buckets the shared-memory transport takes reduce there, the others through MPI, in one op.

    MAX of floats (integer keys), half precision and small buckets stay on MPI; every result equals
    NumPy's reduction of every rank's inputs, and is the same on every rank.
    """
    ctx = module_ctx
    seed = seed_of("large fused", op.name, factors)
    everyone = [[rank_input(seed + i, r, shape, dtype) for i, (shape, dtype) in enumerate(LARGE_SPECS)]
                for r in range(ctx.size)]
    prescale, postscale = factors
    config = mt.DistributedConfig(bucket_bytes=256 << 10, shared_memory=True, check=check)
    with mt.DistributedContext.init(config=config):
        results = mt.all_reduce(everyone[ctx.rank], op, prescale_factor=prescale,
                                postscale_factor=postscale).resolve()
        after = mt.all_reduce(np.full(100_000, float(ctx.rank))).resolve()  # the group's next operation
        for index, got in enumerate(results):
            inputs = [mine[index] for mine in everyone]
            if prescale is not None:
                inputs = [(array * np.asarray(prescale, array.dtype)).astype(array.dtype) for array in inputs]
            expected = reference(op, inputs)
            if postscale is not None:
                expected = (expected * np.asarray(postscale, expected.dtype)).astype(expected.dtype)
            dtype = LARGE_SPECS[index][1]
            assert_matches(got, expected, op, ctx.size * (1 if dtype != np.float16 else 64))
            # The float64 tensor's bucket is its own, of 40 B: small buckets stay on MPI.
            on_mpi = dtype in (np.float64, np.float16) or (op is OP.MAX and dtype != np.int32)
            assert in_shared_memory(got) != on_mpi, (index, dtype, op)
        np.testing.assert_array_equal(after.numpy(), np.full(100_000, float(sum(range(ctx.size)))))
    packed = np.concatenate([np.asarray(r).reshape(-1).view(np.uint8) for r in results])
    assert len(set(ctx.comm.allgather(zlib.crc32(packed.tobytes())))) == 1


def test_bucket_plan_packs_in_order_and_splits_by_size_and_dtype():
    f32 = reduce_plan(OP.SUM, np.dtype(np.float32))
    i64 = reduce_plan(OP.SUM, np.dtype(np.int64))
    buckets = plan_buckets([10, 10, 3, 100, 5], [f32, f32, i64, f32, i64], bucket_bytes=80)
    assert [(b.plan.work_dtype.name, b.members, b.offsets) for b in buckets] == [
        ("float32", [0, 1], [0, 10]),
        ("int64", [2, 4], [0, 3]),
        ("float32", [3], [0]),
    ]


def test_bucket_plan_of_one_kind_packs_greedily_in_order():
    f32 = reduce_plan(OP.SUM, np.dtype(np.float32))
    buckets = plan_buckets([10, 10, 3, 100, 5, 0], [f32] * 6, bucket_bytes=80)
    assert [(b.members, b.offsets, b.elements) for b in buckets] == [
        ([0, 1], [0, 10], 20),
        ([2], [0], 3),
        ([3], [0], 100),
        ([4, 5], [0, 5], 5),
    ]
