"""The shared-memory all-reduce (and its hierarchical scheme) against NumPy and the plain path.

Every rank builds every rank's input from a seed, so each checks its own result against a
NumPy reference of all inputs. Integer-valued floats make float sums exact, so the fast path
must equal the plain ``MPI_Iallreduce`` path exactly; with arbitrary floats it must give the
same bits on every rank and stay close to the reference.

``all_reduce`` sends inputs of up to ``SMALL_BYTES`` down its own small-message path, so
`reduce_fast` drives the fast path's op directly (as ``all_reduce`` builds it) to cover tiny
and odd sizes too; other tests go through ``mt.all_reduce``.
"""

from __future__ import annotations

import gc
import hashlib
import os
import zlib
from functools import partial

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core.dtypes import reduce_plan
from mpitensor._runtime.engine import Op
from mpitensor._transport import shm as _shm
from mpitensor._transport.base import PrivateCopy, ReduceCall
from mpitensor._transport.mpi import SMALL_BYTES
from mpitensor._transport.select import SHARED_MEMORY
from mpitensor._transport.shm import arena as _arena
from mpitensor._transport.shm import cma as _cma
from mpitensor._transport.shm import group_state as _group_state
from mpitensor._transport.shm import protocol as _protocol
from tests.helpers import in_shared_memory as via_shared_memory
from tests.helpers import run_job

mpi = pytest.mark.mpi(min_size=2)

OP = mt.ReduceOperation
OPS = [OP.SUM, OP.MEAN, OP.MAX, OP.MIN, OP.PROD]
DTYPES = [np.float32, np.float64, np.int32, np.int64]
# Element counts: fewer than the ranks, odd, not divisible by 3 or 4, several pieces.
COUNTS = [1, 3, 7, 1001, (1 << 18) + 3]
_UFUNC = {OP.SUM: np.add, OP.MEAN: np.add, OP.MAX: np.maximum, OP.MIN: np.minimum, OP.PROD: np.multiply}

# Float64s above the small-message path (which stays on MPI whatever the settings).
ABOVE_SMALL = SMALL_BYTES // 8 + 905
mt.defer_finalize()  # two contexts, one after the other
FAST = mt.DistributedConfig(shared_memory=True)
PEER_BLOCK = _group_state.GroupState.peer_block
PLAIN = mt.DistributedConfig(shared_memory=False)


def seed_of(*parts: object) -> int:
    return zlib.crc32(repr(parts).encode())


def exact_input(seed: int, rank: int, shape: tuple[int, ...], dtype: type, op: OP) -> np.ndarray:
    """Small integers (as floats too): sums and products are exact in every order."""
    rng = np.random.default_rng([seed, rank])
    low, high = (-2, 3) if op is OP.PROD else (-50, 51)
    return rng.integers(low, high, shape).astype(dtype)


def noisy_input(seed: int, rank: int, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    rng = np.random.default_rng([seed, rank])
    return rng.standard_normal(shape).astype(dtype) * 10 ** rng.uniform(-3, 3, shape).astype(dtype)


def reference(op: OP, arrays: list[np.ndarray]) -> np.ndarray:
    """The reduction in rank order, by NumPy's rules (MEAN of integers in float64)."""
    ufunc = _UFUNC[op]
    work = np.float64 if op is OP.MEAN and arrays[0].dtype.kind in "iu" else arrays[0].dtype
    acc = arrays[0].astype(work)
    for array in arrays[1:]:
        acc = ufunc(acc, array.astype(work))
    if op is OP.MEAN:
        acc = acc / len(arrays)
    return acc.astype(work)


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def same_on_every_rank(comm, array: np.ndarray) -> bool:
    return len(set(comm.allgather(digest(array)))) == 1


def reduce_fast(ctx, array: np.ndarray, op: OP, members=None) -> np.ndarray:
    """All-reduce `array` through the fast path's op, whatever its size (as all_reduce would)."""
    group = ctx.group(members)
    plan = reduce_plan(op, array.dtype)
    send = np.array(array, dtype=plan.work_dtype, order="C")
    call = ReduceCall(ctx, group, PrivateCopy(send), plan, send.nbytes)
    assert SHARED_MEMORY.applies(call), "the fast path declined"
    SHARED_MEMORY.prepare(call)
    op_ = Op("all_reduce", group, send.nbytes, partial(SHARED_MEMORY.start, call), None, keep=(call,))
    ctx.engine.submit(op_)
    ctx.engine.wait(op_, 60)
    assert via_shared_memory(call.out)
    if plan.divide:
        np.true_divide(call.out, group.size, out=call.out)
    return call.out


def group_state(ctx, members=None):
    group = ctx.group(None if members is None else members)
    return group.extra.get("shared_memory")


@pytest.fixture(params=["direct", "copy"])
def reads(request, monkeypatch):
    """How ranks read their peers' inputs: directly (process_vm_readv, where the kernel
    allows it) or from the copies in shared memory."""
    if request.param == "copy":
        monkeypatch.setattr(_cma, "_readv", False)
    return request.param


def check_reads(ctx, reads: str) -> None:
    """After the first operation every rank has decided how it reads (the same way)."""
    state = group_state(ctx)
    assert state.cma is False if reads == "copy" else state.cma in (True, False)
    assert len(set(ctx.comm.allgather(state.cma))) == 1


def pseudo_nodes(monkeypatch, size: int) -> None:
    """Split this host's ranks into nodes of `size` ranks: runs the hierarchical scheme."""
    monkeypatch.setenv("MPITENSOR_SHM_NODE_SIZE", str(size))


# -- the flat scheme: every rank of the group on one node ----------------------------------


@mpi
@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_equals_plain_path_and_reference(op, dtype, count, reads):
    seed = seed_of("flat", op.name, np.dtype(dtype).name, count)
    with mt.DistributedContext.init(config=FAST) as ctx:
        inputs = [exact_input(seed, r, (count,), dtype, op) for r in range(ctx.size)]
        fast = reduce_fast(ctx, inputs[ctx.rank], op)
        again = reduce_fast(ctx, inputs[ctx.rank], op)  # the first operation decides how to read
        np.testing.assert_array_equal(fast, again)
        assert not group_state(ctx).disabled
        check_reads(ctx, reads)
        fast = np.array(fast)
    with mt.DistributedContext.init(config=PLAIN) as ctx:
        plain = mt.all_reduce(mt.tensor(inputs[ctx.rank]), op).resolve()
        assert not via_shared_memory(plain)
        plain = np.array(plain)
    expected = reference(op, inputs)
    assert fast.dtype == plain.dtype == expected.dtype
    np.testing.assert_array_equal(fast, expected)
    np.testing.assert_array_equal(fast, plain)


@mpi
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_all_reduce_takes_the_fast_path_above_the_small_message_size(op):
    count = SMALL_BYTES // 8 + 3
    with mt.DistributedContext.init(config=FAST) as ctx:
        for dtype in (np.float64, np.int64, np.float16):
            seed = seed_of("public", op.name, np.dtype(dtype).name)
            inputs = [exact_input(seed, r, (count,), dtype, op) for r in range(ctx.size)]
            result = mt.all_reduce(mt.tensor(inputs[ctx.rank]), op).resolve()
            if dtype != np.float16:  # half precision is reduced in float32, then rounded back
                assert via_shared_memory(result)
            expected = reference(op, [a.astype(np.float32) for a in inputs]).astype(dtype) if dtype == np.float16 \
                else reference(op, inputs)
            assert result.dtype == expected.dtype
            np.testing.assert_array_equal(np.array(result), expected)


@mpi
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", [OP.SUM, OP.MEAN, OP.PROD], ids=lambda o: o.name)
def test_floats_identical_on_every_rank(op, dtype, reads):
    count = (1 << 19) + 5  # several pieces per slice
    seed = seed_of("noisy", op.name, np.dtype(dtype).name)
    with mt.DistributedContext.init(config=FAST) as ctx:
        inputs = [noisy_input(seed, r, (count,), dtype) for r in range(ctx.size)]
        for _ in range(2):
            result = np.array(mt.all_reduce(inputs[ctx.rank], op).resolve())
            assert same_on_every_rank(ctx.comm, result)
            # Each element is reduced once, in rank order: exactly NumPy's sequential result.
            np.testing.assert_array_equal(result, reference(op, inputs))
        check_reads(ctx, reads)


@mpi
def test_shapes_and_bool():
    with mt.DistributedContext.init(config=FAST) as ctx:
        for shape in [(33, 7), (2, 3, 5), (), (130, 65)]:
            seed = seed_of("shape", shape)
            inputs = [exact_input(seed, r, shape, np.float32, OP.SUM) for r in range(ctx.size)]
            result = reduce_fast(ctx, inputs[ctx.rank], OP.SUM)
            assert result.shape == shape
            np.testing.assert_array_equal(result, reference(OP.SUM, inputs))
            public = mt.all_reduce(mt.tensor(inputs[ctx.rank])).resolve()
            assert public.shape == shape
            np.testing.assert_array_equal(np.array(public), reference(OP.SUM, inputs))
        flags = [np.arange(SMALL_BYTES + 1) % (r + 2) == 0 for r in range(ctx.size)]
        for op, expected in ((OP.MAX, np.logical_or.reduce(flags)), (OP.MIN, np.logical_and.reduce(flags))):
            result = mt.all_reduce(flags[ctx.rank], op).resolve()
            assert via_shared_memory(result)
            np.testing.assert_array_equal(np.array(result), expected)
            np.testing.assert_array_equal(reduce_fast(ctx, flags[ctx.rank][:5], op), expected[:5])


@mpi
@pytest.mark.parametrize("kind", ["tail", "halves", "pair"])
def test_sub_groups(kind):
    with mt.DistributedContext.init(config=FAST) as ctx:
        size, rank = ctx.size, ctx.rank
        if kind == "tail":
            members = list(range(1, size))
        elif kind == "halves":
            members = [r for r in range(size) if r % 2 == rank % 2]
        else:
            members = [0, size - 1]
        if rank not in members:
            # Ranks outside the group run a collective of their own meanwhile.
            result = mt.all_reduce(np.full(1000, 2.0), devices=[rank]).resolve()
            np.testing.assert_array_equal(np.array(result), np.full(1000, 2.0))
            return
        seed = seed_of("group", kind, tuple(members))
        inputs = {r: exact_input(seed, r, (SMALL_BYTES // 8 + 3,), np.int64, OP.SUM) for r in members}
        result = mt.all_reduce(inputs[rank], OP.SUM, devices=members).resolve()
        if len(members) > 1:
            assert via_shared_memory(result)
        np.testing.assert_array_equal(np.array(result), reference(OP.SUM, [inputs[r] for r in members]))


# -- the hierarchical scheme: node-local reduce, leaders all-reduce, node-local copy ---------


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("node_size", [1, 2, 3])
@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_hierarchical_equals_reference(monkeypatch, op, node_size, reads):
    pseudo_nodes(monkeypatch, node_size)
    seed = seed_of("hier", op.name, node_size)
    with mt.DistributedContext.init(config=FAST) as ctx:
        layout = _shm.node_layout(ctx.hosts)
        if all(len(node) == 1 for node in layout):
            # One rank per node: nothing to share, the plain path runs.
            result = mt.all_reduce(np.ones(10), op).resolve()
            assert not via_shared_memory(result)
            return
        for dtype in (np.int32, np.float64):
            for count in (2, 1001, (1 << 17) + 1):
                inputs = [exact_input(seed, r, (count,), dtype, op) for r in range(ctx.size)]
                np.testing.assert_array_equal(reduce_fast(ctx, inputs[ctx.rank], op), reference(op, inputs))
                result = mt.all_reduce(inputs[ctx.rank], op).resolve()
                assert via_shared_memory(result) == (result.nbytes > SMALL_BYTES)
                np.testing.assert_array_equal(np.array(result), reference(op, inputs))
        noisy = [noisy_input(seed, r, (5003,), np.float32) for r in range(ctx.size)]
        result = np.array(mt.all_reduce(noisy[ctx.rank], op).resolve())
        assert same_on_every_rank(ctx.comm, result)
        np.testing.assert_allclose(result, reference(op, noisy), rtol=1e-4, atol=1e-3)
        assert not group_state(ctx).disabled
        check_reads(ctx, reads)


@pytest.mark.mpi(min_size=4)
def test_hierarchical_sub_group(monkeypatch):
    pseudo_nodes(monkeypatch, 2)
    with mt.DistributedContext.init(config=FAST) as ctx:
        members = [r for r in range(ctx.size) if r != 1]  # nodes {0}, {2, 3}, ...
        if ctx.rank not in members:
            return
        inputs = {r: exact_input(7, r, (SMALL_BYTES // 8 + 1,), np.int64, OP.SUM) for r in members}
        result = mt.all_reduce(inputs[ctx.rank], devices=members).resolve()
        assert via_shared_memory(result)
        np.testing.assert_array_equal(np.array(result), reference(OP.SUM, [inputs[r] for r in members]))


# -- lifetime of results, ordering, choice of path -------------------------------------------


@mpi
def test_results_stay_valid_after_later_calls_and_close():
    with mt.DistributedContext.init(config=FAST) as ctx:
        kept = []
        for i in range(6):
            inputs = [np.full(ABOVE_SMALL, float(i * 10 + r)) for r in range(ctx.size)]
            kept.append((mt.all_reduce(inputs[ctx.rank]).resolve(), reference(OP.SUM, inputs)))
        for _ in range(10):
            mt.all_reduce(np.full(ABOVE_SMALL, -1.0)).resolve()
        # After the first operation, ranks of one node synchronize through shared memory.
        assert group_state(ctx).flags == _protocol.ORDERED_STORES
        for result, expected in kept:
            np.testing.assert_array_equal(np.array(result), expected)
    # The context is closed; the blocks the results live in are still mapped.
    for result, expected in kept:
        np.testing.assert_array_equal(np.array(result), expected)


@mpi
def test_dropped_results_return_to_the_pool():
    with mt.DistributedContext.init(config=FAST) as ctx:
        x = np.ones(70000, np.float32)
        first = mt.all_reduce(x).resolve()
        address = first._array.ctypes.data
        del first
        gc.collect()
        again = mt.all_reduce(x).resolve()
        assert again._array.ctypes.data == address
        held = mt.all_reduce(x).resolve()
        assert held._array.ctypes.data != again._array.ctypes.data
        np.testing.assert_array_equal(np.array(held), np.full(70000, ctx.size, np.float32))


@mpi
def test_many_in_flight_resolved_in_any_order():
    with mt.DistributedContext.init(config=FAST) as ctx:
        inputs = [[np.full(3000 + i, float(i + r)) for r in range(ctx.size)] for i in range(8)]
        handles = [mt.all_reduce(inputs[i][ctx.rank]) for i in range(8)]
        small = mt.all_reduce(np.array([1.0]), devices=[ctx.rank])  # another group meanwhile
        for i in reversed(range(8)):
            np.testing.assert_array_equal(np.array(handles[i].resolve()), reference(OP.SUM, inputs[i]))
        np.testing.assert_array_equal(np.array(small.resolve()), [1.0])


@mpi
def test_default_chooses_by_size(monkeypatch):
    monkeypatch.delenv("MPITENSOR_SHM_MIN_BYTES", raising=False)
    with mt.DistributedContext.init() as ctx:
        threshold = _shm.min_bytes()
        small = mt.all_reduce(np.ones(16, np.float32)).resolve()
        large = mt.all_reduce(np.ones(threshold // 4, np.float32)).resolve()
        assert not via_shared_memory(small)
        assert via_shared_memory(large)
        mixed = [mt.all_reduce(np.full(n, 1.0, np.float32)) for n in (8, threshold // 4, 9, threshold // 2)]
        for handle, n in zip(mixed, (8, threshold // 4, 9, threshold // 2)):
            np.testing.assert_array_equal(np.array(handle.resolve()), np.full(n, ctx.size, np.float32))


@mpi
def test_off_switch_and_unsupported_ops():
    with mt.DistributedContext.init(config=PLAIN) as ctx:
        assert not via_shared_memory(mt.all_reduce(np.ones(100000)).resolve())
        assert group_state(ctx) is None
    with mt.DistributedContext.init(config=FAST) as ctx:
        # MAX of complex numbers has no MPI op (a NumPy-defined one runs instead): plain path.
        values = np.full(5000, complex(ctx.rank, -ctx.rank))
        result = mt.all_reduce(values, OP.MAX).resolve()
        assert not via_shared_memory(result)
        np.testing.assert_array_equal(np.array(result), np.full(5000, complex(ctx.size - 1, 1 - ctx.size)))


@mpi
def test_mismatched_shapes_fail_the_check_not_hang():
    with mt.DistributedContext.init(config=FAST) as ctx:
        count = ABOVE_SMALL + (ctx.rank == 0)
        with pytest.raises(mt.CollectiveMismatchError, match="shape"):
            mt.all_reduce(np.ones(count)).resolve(timeout=60)
        # The group still works afterwards.
        result = mt.all_reduce(np.ones(ABOVE_SMALL)).resolve(timeout=60)
        assert via_shared_memory(result)
        np.testing.assert_array_equal(np.array(result), np.full(ABOVE_SMALL, float(ctx.size)))


@mpi
@pytest.mark.parametrize("progress", [False, True])
def test_with_and_without_progress_thread(progress):
    config = mt.DistributedConfig(shared_memory=True, progress=progress)
    with mt.DistributedContext.init(config=config) as ctx:
        inputs = [np.full(300000, float(r + 1), np.float32) for r in range(ctx.size)]
        handles = [mt.all_reduce(inputs[ctx.rank]) for _ in range(4)]
        busy = np.sin(np.arange(200000.0)).sum()  # compute while the operations are in flight
        assert np.isfinite(busy)
        for handle in handles:
            np.testing.assert_array_equal(np.array(handle.resolve()), reference(OP.SUM, inputs))


# -- falling back when memory cannot be shared ----------------------------------------------


@mpi
def test_a_rank_that_cannot_map_a_peer_makes_every_rank_fall_back(monkeypatch):
    with mt.DistributedContext.init(config=FAST) as ctx:
        inputs = [exact_input(3, r, (20000,), np.int64, OP.SUM) for r in range(ctx.size)]
        first = mt.all_reduce(inputs[ctx.rank]).resolve()  # sets up the group
        np.testing.assert_array_equal(np.array(first), reference(OP.SUM, inputs))
        if ctx.rank == ctx.size - 1:
            def refuse(self, *args):
                raise OSError("simulated: no access to the peer's memory")

            monkeypatch.setattr(_group_state.GroupState, "peer_block", refuse)
            state = group_state(ctx)
            state.peer_maps.clear()
            state.peer_bytes = 0
        result = mt.all_reduce(inputs[ctx.rank]).resolve()
        np.testing.assert_array_equal(np.array(result), reference(OP.SUM, inputs))
        assert group_state(ctx).disabled  # on every rank: they all saw the same agreement
        again = mt.all_reduce(inputs[ctx.rank], OP.MAX).resolve()
        np.testing.assert_array_equal(np.array(again), reference(OP.MAX, inputs))


@mpi
def test_a_failed_direct_read_makes_every_rank_fall_back(monkeypatch):
    with mt.DistributedContext.init(config=FAST) as ctx:
        inputs = [exact_input(5, r, (300001,), np.float32, OP.SUM) for r in range(ctx.size)]
        np.testing.assert_array_equal(np.array(mt.all_reduce(inputs[ctx.rank]).resolve()), reference(OP.SUM, inputs))
        if not group_state(ctx).cma:
            pytest.skip("the kernel does not let ranks read each other's memory here")
        if ctx.rank == 0:
            def refuse(self, key):
                raise OSError(1, "simulated: process_vm_readv not permitted")

            monkeypatch.setattr(_cma.Remote, "__getitem__", refuse)
        result = mt.all_reduce(inputs[ctx.rank]).resolve()
        np.testing.assert_array_equal(np.array(result), reference(OP.SUM, inputs))
        assert group_state(ctx).disabled


@mpi
def test_a_rank_without_shared_memory_makes_every_rank_fall_back(monkeypatch):
    with mt.DistributedContext.init(config=FAST) as ctx:
        if ctx.rank == 0:
            def no_memory(self, nbytes):
                raise OSError("simulated: memfd_create failed")

            monkeypatch.setattr(_arena.Arena, "take", no_memory)
        inputs = [exact_input(4, r, (9999,), np.float64, OP.SUM) for r in range(ctx.size)]
        result = mt.all_reduce(inputs[ctx.rank]).resolve()
        np.testing.assert_array_equal(np.array(result), reference(OP.SUM, inputs))
        assert group_state(ctx).disabled
        assert via_shared_memory(result) == (ctx.rank != 0)


# -- file descriptors ------------------------------------------------------------------------


def memfds() -> int:
    """The shared-memory files this process holds open."""
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}").startswith("/memfd:mpitensor")
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return count


@mpi
@pytest.mark.parametrize("scheme", ["flat", "hierarchical"])
def test_peers_blocks_cost_no_file_descriptors(monkeypatch, scheme):
    # A rank keeps open only its own blocks (the descriptors its peers open): its control
    # block and one block per size of message here, however many peers it maps.
    with mt.DistributedContext.init(config=FAST) as ctx:
        if scheme == "hierarchical":
            if ctx.size < 3:
                pytest.skip("two nodes, one of two ranks, take 3 ranks")
            pseudo_nodes(monkeypatch, 2)  # read by the group's first shared-memory call
        before = memfds()
        for count in (ABOVE_SMALL, 2 * ABOVE_SMALL, 4 * ABOVE_SMALL):
            inputs = [exact_input(seed_of("fds", count), r, (count,), np.float64, OP.SUM) for r in range(ctx.size)]
            for _ in range(3):
                result = mt.all_reduce(inputs[ctx.rank]).resolve()
                assert via_shared_memory(result)
                np.testing.assert_array_equal(np.array(result), reference(OP.SUM, inputs))
                del result
        gc.collect()
        assert memfds() - before == 4
    assert memfds() == before  # closed with the context


# -- several node leaders (a child job of 6 ranks: 3 nodes of 2, then 2 nodes) --------------

_LEADERS_JOB = """
import hashlib
import os
import numpy as np
import mpitensor as mt
from mpitensor._transport.shm import group_state as _group_state

mt.defer_finalize()  # two contexts, one after the other
FAST = mt.DistributedConfig(shared_memory=True)
PEER_BLOCK = _group_state.GroupState.peer_block


def reference(arrays):
    acc = arrays[0]
    for array in arrays[1:]:
        acc = acc + array
    return acc


for node_size in ("2", "4"):
    os.environ["MPITENSOR_SHM_NODE_SIZE"] = node_size  # nodes {0, 1}, {2, 3}, {4, 5}; then {0..3}, {4, 5}
    with mt.DistributedContext.init(config=FAST) as ctx:
        for count in (5, 70001):
            ints = [np.random.default_rng([count, r]).integers(-50, 51, count).astype(np.float32)
                    for r in range(ctx.size)]
            for op, expected in ((mt.ReduceOperation.SUM, reference(ints)),
                                 (mt.ReduceOperation.MAX, np.max(ints, axis=0))):
                for _ in range(3):  # the first call by messages, the next ones through the control blocks
                    result = np.array(mt.all_reduce(ints[ctx.rank], op).resolve())
                    assert np.array_equal(result, expected), (node_size, count, op)
        noisy = [np.random.default_rng([3, r]).standard_normal(50001) for r in range(ctx.size)]
        result = np.array(mt.all_reduce(noisy[ctx.rank]).resolve())
        assert np.allclose(result, np.sum(noisy, axis=0), rtol=1e-12, atol=1e-12)
        digests = set(ctx.comm.allgather(hashlib.sha256(result.tobytes()).hexdigest()))
        assert len(digests) == 1, "different bits on different ranks"
        if node_size == "2" and ctx.rank == ctx.size - 1:
            def refuse(self, *args):
                raise OSError("simulated: no access to the peer's memory")

            _group_state.GroupState.peer_block = refuse
            state = ctx.group(None).extra["shared_memory"]
            state.peer_maps.clear()
        ints = [np.full(30001, r + 1, np.int64) for r in range(ctx.size)]
        for _ in range(2):  # the first falls back after agreeing, the next starts there
            result = np.array(mt.all_reduce(ints[ctx.rank]).resolve())
            assert np.array_equal(result, reference(ints)), node_size
        disabled = ctx.group(None).extra["shared_memory"].disabled
        assert disabled == (node_size == "2"), disabled
        _group_state.GroupState.peer_block = PEER_BLOCK
    report("done", node_size, ctx.rank)
"""


@pytest.mark.subprocess
def test_three_node_leaders_and_the_fallback_at_six_ranks(tmp_path):
    # Three leaders: one folded into another for the reduce-scatter; the fallback over 6
    # ranks folds two. Results are NumPy's, and the same bits on every rank.
    result = run_job(_LEADERS_JOB, 6, timeout=120, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert len(result.reported("done")) == 12, result.output


# -- progress when one rank waits on another operation (child jobs, so a hang fails fast) ----

_ORDER_JOB = """
import numpy as np
import mpitensor as mt
config = mt.DistributedConfig(check=False, progress={progress})
with mt.DistributedContext.init(config=config) as ctx:
    big = np.ones(1 << 18, np.float32)  # shared memory (1 MiB)
    for _ in range(3):
        if ctx.rank == 0:
            first = mt.all_reduce(big)
            second = mt.all_reduce(np.ones(4))  # a small one: plain MPI_Iallreduce
            second.resolve()  # waits while the first is still in flight
            first = first.resolve()
        else:
            first = mt.all_reduce(big).resolve()  # waits for rank 0's part of the first
            mt.all_reduce(np.ones(4)).resolve()
        assert float(np.asarray(first)[0]) == ctx.size
    report("done", ctx.rank)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("progress", [False, True])
def test_waiting_on_a_later_operation_still_progresses_shared_memory(tmp_path, progress):
    # MPI_Wait on the second operation progresses the first inside MPI; the shared-memory
    # steps only run when the engine does, so waiting must keep driving them.
    result = run_job(_ORDER_JOB.format(progress=progress), 2, timeout=20, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert len(result.reported("done")) == 2, result.output
