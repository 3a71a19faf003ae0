"""torch.distributed on the "mpitensor" backend: every collective against NumPy.

Each rank's input comes from a seed and its rank, so every rank computes every other
rank's input and the NumPy reference from all of them.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Iterator

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import rank_input, seed_of

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
import mpitensor.torch as mtt  # noqa: E402 - after the skip when torch is missing

pytestmark = pytest.mark.mpi(min_size=1)

DTYPES = [torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16]
OPS = {
    "sum": (dist.ReduceOp.SUM, np.add),
    "product": (dist.ReduceOp.PRODUCT, np.multiply),
    "min": (dist.ReduceOp.MIN, np.minimum),
    "max": (dist.ReduceOp.MAX, np.maximum),
}


@pytest.fixture(scope="module")
def world(module_ctx: mt.DistributedContext) -> Iterator[mt.DistributedContext]:
    """torch's default process group on the mpitensor backend, over the module's context."""
    torch.set_num_threads(1)
    dist.init_process_group("mpitensor")
    yield module_ctx
    dist.destroy_process_group()


def numpy_of(dtype: torch.dtype) -> np.dtype:
    return np.dtype(np.float32) if dtype is torch.bfloat16 else torch.empty((), dtype=dtype).numpy().dtype


def inputs(name: str, shape: tuple[int, ...], dtype: torch.dtype, size: int) -> list[np.ndarray]:
    """Every rank's input of test `name`, as NumPy (bfloat16 values drawn exactly representable)."""
    seed = seed_of(name, str(dtype), shape)
    arrays = [rank_input(seed, rank, shape, numpy_of(dtype)) for rank in range(size)]
    if dtype is torch.bfloat16:
        arrays = [torch.from_numpy(a).to(torch.bfloat16).float().numpy() for a in arrays]
    return arrays


def as_torch(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(array.copy()).to(dtype)  # a copy: the collectives write in place


def check(got: torch.Tensor, expected: np.ndarray, dtype: torch.dtype) -> None:
    assert got.dtype is dtype
    values = got.float().numpy() if dtype is torch.bfloat16 else got.numpy()
    expected = np.asarray(expected)
    if dtype.is_floating_point or dtype.is_complex:
        tol = 1e-2 if dtype is torch.bfloat16 else 1e-5
        np.testing.assert_allclose(values, expected.astype(values.dtype), rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(values, expected.astype(values.dtype))


def test_the_default_group_is_the_mpi_job(world):
    assert dist.is_initialized()
    assert dist.get_backend() == "mpitensor"
    assert (dist.get_rank(), dist.get_world_size()) == (world.rank, world.size)
    assert isinstance(dist.group.WORLD, mtt.ProcessGroupMpitensor)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_all_reduce(world, dtype, op):
    arrays = inputs("all_reduce", (3, 5), dtype, world.size)
    torch_op, ufunc = OPS[op]
    tensor = as_torch(arrays[world.rank], dtype)
    dist.all_reduce(tensor, op=torch_op)
    check(tensor, ufunc.reduce(np.stack(arrays)), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64], ids=str)
def test_all_reduce_avg(world, dtype):
    arrays = inputs("avg", (4,), dtype, world.size)
    tensor = as_torch(arrays[world.rank], dtype)
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    mean = np.mean(np.stack(arrays).astype(np.float64), axis=0)
    check(tensor, mean if dtype.is_floating_point else np.trunc(mean), dtype)


def test_all_reduce_of_views_and_of_tensors_numpy_cannot_show(world):
    """A slice of a larger tensor is reduced in its own memory only; a tensor that requires
    grad (written as gloo writes it) or is bfloat16 (no NumPy view) takes the general path,
    one of 64 KiB the small one's and one larger the in-place one's, alike."""
    arrays = inputs("views", (3, 6), torch.float32, world.size)
    base = torch.full((5, 6), -1.0)
    base[1:4] = as_torch(arrays[world.rank], torch.float32)
    dist.all_reduce(base[1:4])
    check(base[1:4], np.sum(arrays, axis=0), torch.float32)
    assert bool((base[0] == -1).all() and (base[4] == -1).all()), "the rows around the slice are untouched"
    leaf = torch.ones(2, requires_grad=True)
    dist.all_reduce(leaf)
    check(leaf.detach(), np.full(2, float(world.size)), torch.float32)
    for dtype, shape in ((torch.bfloat16, (4,)), (torch.float32, (16384,)), (torch.float32, (16385,))):
        arrays = inputs("general", shape, dtype, world.size)
        tensor = as_torch(arrays[world.rank], dtype)
        dist.all_reduce(tensor)
        check(tensor, np.sum(arrays, axis=0), dtype)


LARGE_OPS = [
    ("sum", torch.float32), ("sum", torch.int32), ("sum", torch.complex128), ("max", torch.float64),
    ("min", torch.int64), ("product", torch.float64), ("avg", torch.float32), ("avg", torch.int64),
    ("sum", torch.bfloat16), ("sum", torch.int8),
]


@pytest.mark.parametrize("op,dtype", LARGE_OPS, ids=str)
@pytest.mark.parametrize("elements", [20_000, 700_000])  # 80 KiB to 5.6 MB
@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_of_large_tensors_in_their_own_memory(world, op, dtype, elements, async_op):
    """Tensors above 64 KiB are reduced in place (MPI's in-place all-reduce), or through the
    general path where that cannot be (MAX of floats, AVG of integers, bfloat16)."""
    arrays = inputs("large", (elements,), dtype, world.size)
    tensor = as_torch(arrays[world.rank], dtype)
    address = tensor.data_ptr()
    stack = np.stack(arrays).astype(np.float64 if op == "avg" else arrays[0].dtype)
    if op == "avg":
        torch_op, expected = dist.ReduceOp.AVG, np.mean(stack, axis=0)
        expected = expected if dtype.is_floating_point else np.trunc(expected)
    else:
        torch_op, ufunc = OPS[op]
        expected = ufunc.reduce(stack)
    work = dist.all_reduce(tensor, op=torch_op, async_op=async_op)
    if async_op:
        work.wait()
    assert tensor.data_ptr() == address
    check(tensor, expected, dtype)


def test_all_reduce_of_large_tensors_numpy_cannot_show_as_they_are(world):
    """A negative view (torch's negative bit) is reduced by its values, through a private copy."""
    arrays = inputs("negative", (30_000,), torch.float64, world.size)
    tensor = torch._neg_view(torch.from_numpy(-arrays[world.rank]))  # arrays[rank], with the negative bit
    assert tensor.is_neg()
    dist.all_reduce(tensor)
    check(tensor.resolve_neg(), np.sum(arrays, axis=0), torch.float64)


@pytest.mark.mpi(min_size=2)
def test_a_large_dist_all_reduce_against_a_peers_mt_all_reduce_is_a_mismatch_on_every_rank(world):
    """The in-place all-reduce and mpitensor's own are told apart by the check (never two algorithms)."""
    tensor = torch.ones(50_000)
    with pytest.raises(mt.CollectiveMismatchError, match="in_place"):
        if world.rank == 0:
            dist.all_reduce(tensor)
        else:
            mt.all_reduce(tensor).resolve()
    dist.all_reduce(tensor)  # the group is still usable
    check(tensor, np.full(50_000, float(world.size)), torch.float32)


@pytest.mark.parametrize("factor", [2.5, "tensor"])
def test_all_reduce_premul_sum(world, factor):
    arrays = inputs("premul", (6,), torch.float64, world.size)
    tensor = as_torch(arrays[world.rank], torch.float64)
    scale = torch.tensor([0.5], dtype=torch.float64) if factor == "tensor" else factor
    dist.all_reduce(tensor, op=dist._make_nccl_premul_sum(scale))
    check(tensor, np.sum(arrays, axis=0) * (0.5 if factor == "tensor" else 2.5), torch.float64)


@pytest.mark.parametrize("op", [dist.ReduceOp.BAND, dist.ReduceOp.BOR, dist.ReduceOp.BXOR], ids=str)
def test_all_reduce_bitwise(world, op):
    arrays = [np.array([rank + 1, 7 * rank, 255 - rank], dtype=np.int64) for rank in range(world.size)]
    ufunc = {dist.ReduceOp.BAND: np.bitwise_and, dist.ReduceOp.BOR: np.bitwise_or,
             dist.ReduceOp.BXOR: np.bitwise_xor}[op]
    tensor = torch.from_numpy(arrays[world.rank].copy())
    dist.all_reduce(tensor, op=op)
    check(tensor, ufunc.reduce(np.stack(arrays)), torch.int64)


def test_all_reduce_coalesced_and_the_coalescing_manager(world):
    first = inputs("coalesced-a", (5,), torch.float32, world.size)
    second = inputs("coalesced-b", (2, 2), torch.float32, world.size)
    a, b = as_torch(first[world.rank], torch.float32), as_torch(second[world.rank], torch.float32)
    dist.all_reduce_coalesced([a, b])
    check(a, np.sum(first, axis=0), torch.float32)
    check(b, np.sum(second, axis=0), torch.float32)
    from torch.distributed.distributed_c10d import _coalescing_manager

    c, d = as_torch(first[world.rank], torch.float32), as_torch(first[world.rank], torch.float32)
    with _coalescing_manager(async_ops=True) as manager:
        dist.all_reduce(c)
        dist.all_reduce(d)
    manager.wait()
    check(c, np.sum(first, axis=0), torch.float32)
    check(d, np.sum(first, axis=0), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_from_every_root(world, dtype):
    arrays = inputs("broadcast", (2, 3), dtype, world.size)
    for root in range(world.size):
        tensor = as_torch(arrays[world.rank], dtype)
        dist.broadcast(tensor, src=root)
        check(tensor, arrays[root], dtype)


def test_reduce_to_every_root(world):
    arrays = inputs("reduce", (7,), torch.float64, world.size)
    for root in range(world.size):
        tensor = as_torch(arrays[world.rank], torch.float64)
        dist.reduce(tensor, dst=root, op=dist.ReduceOp.SUM)
        check(tensor, np.sum(arrays, axis=0) if world.rank == root else arrays[world.rank], torch.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_gather_and_all_gather_into_tensor(world, dtype):
    arrays = inputs("all_gather", (2, 3), dtype, world.size)
    mine = as_torch(arrays[world.rank], dtype)
    outputs = [torch.zeros(2, 3, dtype=dtype) for _ in range(world.size)]
    dist.all_gather(outputs, mine)
    for output, expected in zip(outputs, arrays):
        check(output, expected, dtype)
    into = torch.zeros(world.size * 2, 3, dtype=dtype)
    dist.all_gather_into_tensor(into, mine)
    check(into, np.concatenate(arrays), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16], ids=str)
def test_reduce_scatter_and_reduce_scatter_tensor(world, dtype):
    n = world.size
    arrays = inputs("reduce_scatter", (n * 2, 3), dtype, n)
    total = np.sum(arrays, axis=0)
    out = torch.zeros(2, 3, dtype=dtype)
    dist.reduce_scatter_tensor(out, as_torch(arrays[world.rank], dtype))
    check(out, total[2 * world.rank: 2 * world.rank + 2], dtype)
    pieces = list(as_torch(arrays[world.rank], dtype).chunk(n))
    out = torch.zeros(2, 3, dtype=dtype)
    dist.reduce_scatter(out, pieces, op=dist.ReduceOp.MAX)
    check(out, np.max(arrays, axis=0)[2 * world.rank: 2 * world.rank + 2], dtype)


def test_all_to_all_single_even_and_with_splits(world):
    n, rank = world.size, world.rank
    arrays = inputs("all_to_all", (n * 2, 3), torch.float64, n)
    out = torch.zeros(n * 2, 3, dtype=torch.float64)
    dist.all_to_all_single(out, as_torch(arrays[rank], torch.float64))
    check(out, np.concatenate([arrays[src][2 * rank: 2 * rank + 2] for src in range(n)]), torch.float64)
    # Rank i sends i + j + 1 rows to rank j.
    rows = [[i + j + 1 for j in range(n)] for i in range(n)]
    sent = [np.arange(sum(rows[i]) * 2, dtype=np.float64).reshape(-1, 2) + 100 * i for i in range(n)]
    out = torch.zeros(sum(rows[i][rank] for i in range(n)), 2, dtype=torch.float64)
    dist.all_to_all_single(out, torch.from_numpy(sent[rank].copy()),
                           output_split_sizes=[rows[i][rank] for i in range(n)], input_split_sizes=rows[rank])
    expected = [sent[i][sum(rows[i][:rank]): sum(rows[i][: rank + 1])] for i in range(n)]
    check(out, np.concatenate(expected), torch.float64)


def test_all_to_all_of_lists_with_unequal_sizes(world):
    n, rank = world.size, world.rank
    sent = [[np.full(i + j + 1, 10.0 * i + j) for j in range(n)] for i in range(n)]
    outputs = [torch.zeros(i + rank + 1, dtype=torch.float64) for i in range(n)]
    dist.all_to_all(outputs, [torch.from_numpy(a.copy()) for a in sent[rank]])
    for i, output in enumerate(outputs):
        check(output, sent[i][rank], torch.float64)


def test_gather_and_scatter_at_every_root(world):
    n, rank = world.size, world.rank
    arrays = inputs("gather", (4,), torch.float32, n)
    for root in range(n):
        gathered = [torch.zeros(4) for _ in range(n)] if rank == root else None
        dist.gather(as_torch(arrays[rank], torch.float32), gathered, dst=root)
        if rank == root:
            for output, expected in zip(gathered, arrays):
                check(output, expected, torch.float32)
        out = torch.zeros(4)
        pieces = [as_torch(a, torch.float32) for a in arrays] if rank == root else None
        dist.scatter(out, pieces, src=root)
        check(out, arrays[rank], torch.float32)


def test_object_collectives(world):
    n, rank = world.size, world.rank
    everyone = [None] * n
    dist.all_gather_object(everyone, {"rank": rank, "name": "r" * (rank + 1)})
    assert everyone == [{"rank": r, "name": "r" * (r + 1)} for r in range(n)]
    objects = [rank, "x" * rank]
    dist.broadcast_object_list(objects, src=n - 1)
    assert objects == [n - 1, "x" * (n - 1)]
    gathered = [None] * n if rank == 0 else None
    dist.gather_object(("from", rank), gathered, dst=0)
    if rank == 0:
        assert gathered == [("from", r) for r in range(n)]
    out = [None]
    dist.scatter_object_list(out, [f"to {r}" for r in range(n)] if rank == 0 else None, src=0)
    assert out == [f"to {rank}"]


@pytest.mark.mpi(min_size=2)
def test_send_recv_and_batch_isend_irecv_around_a_ring(world):
    n, rank = world.size, world.rank
    right, left = (rank + 1) % n, (rank - 1) % n
    arrays = inputs("ring", (3,), torch.float64, n)
    got = torch.zeros(3, dtype=torch.float64)
    ops = [dist.P2POp(dist.isend, as_torch(arrays[rank], torch.float64), right),
           dist.P2POp(dist.irecv, got, left)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    check(got, arrays[left], torch.float64)
    if rank == 0:
        dist.send(torch.arange(4, dtype=torch.int32), dst=1, tag=3)
    elif rank == 1:
        received = torch.zeros(4, dtype=torch.int32)
        dist.recv(received, src=0, tag=3)
        check(received, np.arange(4), torch.int32)
    dist.barrier()


def test_async_work_and_its_future_complete_without_wait(world):
    arrays = inputs("async", (3,), torch.float32, world.size)
    tensor = as_torch(arrays[world.rank], torch.float32)
    work = dist.all_reduce(tensor, async_op=True)
    chained = work.get_future().then(lambda fut: fut.value()[0] * 2)
    # Nobody calls work.wait(): the future completes on its own.
    doubled = chained.wait()
    assert work.is_completed()
    check(tensor, np.sum(arrays, axis=0), torch.float32)
    check(doubled, 2 * np.sum(arrays, axis=0), torch.float32)
    assert work.wait() is True


def _completer_threads() -> int:
    import threading

    return sum(thread.name == "mpitensor-torch-completer" for thread in threading.enumerate())


def test_a_destroyed_groups_completer_thread_ends(world):
    before = _completer_threads()
    group = dist.new_group(list(range(world.size)))
    arrays = inputs("completer", (4,), torch.float64, world.size)
    tensor = as_torch(arrays[world.rank], torch.float64)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    work.get_future().wait()  # a future asked before wait(): the group's completer thread finishes it
    check(tensor, np.sum(arrays, axis=0), torch.float64)
    assert _completer_threads() == before + 1
    dist.destroy_process_group(group)
    import time

    deadline = time.monotonic() + 5
    while _completer_threads() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _completer_threads() == before, "the destroyed group's completer thread is still running"


def test_sub_groups_from_new_group(world):
    n, rank = world.size, world.rank
    evens, odds = list(range(0, n, 2)), list(range(1, n, 2))
    groups = {tuple(evens): dist.new_group(evens)}
    if odds:
        groups[tuple(odds)] = dist.new_group(odds)
    mine = evens if rank % 2 == 0 else odds
    group = groups[tuple(mine)]
    arrays = inputs("sub", (2,), torch.float64, n)
    tensor = as_torch(arrays[rank], torch.float64)
    dist.all_reduce(tensor, group=group)
    check(tensor, np.sum([arrays[r] for r in mine], axis=0), torch.float64)
    assert dist.get_rank(group) == mine.index(rank) and dist.get_world_size(group) == len(mine)
    # src is a global rank: the group's last member.
    tensor = as_torch(arrays[rank], torch.float64)
    dist.broadcast(tensor, src=mine[-1], group=group)
    check(tensor, arrays[mine[-1]], torch.float64)
    outputs = [torch.zeros(2, dtype=torch.float64) for _ in mine]
    dist.all_gather(outputs, as_torch(arrays[rank], torch.float64), group=group)
    for output, member in zip(outputs, mine):
        check(output, arrays[member], torch.float64)


def test_distributed_sampler_shards_the_dataset(world):
    sampler = torch.utils.data.DistributedSampler(list(range(23)), shuffle=True, seed=3)
    mine = list(sampler)
    everyone = [None] * world.size
    dist.all_gather_object(everyone, mine)
    seen = sorted(i for part in everyone for i in part)
    assert set(seen) == set(range(23)) and len(seen) == world.size * len(mine)


def test_monitored_barrier_passes_when_every_rank_arrives(world):
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)


def test_ranks_that_disagree_get_a_mismatch_error_on_every_rank(world):
    tensor = torch.zeros(3 + (world.rank == 0 and world.size > 1))
    if world.size == 1:
        dist.all_reduce(tensor)
        return
    with pytest.raises(mt.CollectiveMismatchError):
        dist.all_reduce(tensor)
    tensor = torch.ones(2)
    dist.all_reduce(tensor)  # the group is still usable
    check(tensor, np.full(2, float(world.size)), torch.float32)


def test_bad_tensors_are_clear_errors(world):
    with pytest.raises(ValueError, match="contiguous"):
        dist.all_reduce(torch.zeros(4, 4).t())
    with pytest.raises(mt.CollectiveMismatchError, match="input has 4 elements, but its output of 3"):
        dist.all_gather_into_tensor(torch.zeros(3), torch.zeros(4))


def test_fully_shard_gradients_equal_one_process_on_the_whole_batch(world):
    """FSDP2 (``fully_shard``) on a CPU device mesh: all-gathers in place, reduce-scatters the gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    single = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (world.size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.from_numpy(np.concatenate(inputs("fsdp", (4, 8), torch.float32, world.size)))
    model(x[4 * world.rank: 4 * world.rank + 4]).square().mean().backward()
    single(x).square().mean().backward()
    for param, expected in zip(model.parameters(), single.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), expected.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_tensors_take_the_gpu_paths(world):
    if world.device.kind != "cuda":
        pytest.skip("the context's device is the CPU (CuPy missing, or no GPU for this rank)")
    device = torch.device("cuda", world.device.index)
    arrays = inputs("cuda", (5,), torch.float32, world.size)
    tensor = as_torch(arrays[world.rank], torch.float32).to(device)
    dist.all_reduce(tensor)
    assert tensor.device == device
    check(tensor.cpu(), np.sum(arrays, axis=0), torch.float32)
    tensor = as_torch(arrays[world.rank], torch.float32).to(device)
    dist.broadcast(tensor, src=world.size - 1)
    check(tensor.cpu(), arrays[-1], torch.float32)
    gathered = torch.zeros(world.size * 5, device=device)
    dist.all_gather_into_tensor(gathered, as_torch(arrays[world.rank], torch.float32).to(device))
    check(gathered.cpu(), np.concatenate(arrays), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.complex64], ids=str)
def test_all_gather_coalesced_of_tensors_of_several_shapes(world, dtype):
    """Output list k gets rank k's inputs (shapes [2, 2], [0], [3]), all in one all-gather."""
    shapes = [(2, 2), (0,), (3,)]
    arrays = [[rank_input(seed_of("coalesced", str(dtype), shape), rank, shape, torch.empty((), dtype=dtype)
                          .numpy().dtype) for shape in shapes] for rank in range(world.size)]
    outputs = [[torch.full(shape, -1, dtype=dtype) for shape in shapes] for _ in range(world.size)]
    dist.all_gather_coalesced(outputs, [torch.from_numpy(a.copy()) for a in arrays[world.rank]])
    for got_list, expected_list in zip(outputs, arrays):
        for got, expected in zip(got_list, expected_list):
            np.testing.assert_array_equal(got.numpy(), expected)
    next_all_reduce_is_right(world, "after all_gather_coalesced")


def test_all_gather_coalesced_inputs_that_differ_are_a_mismatch_on_every_rank(world):
    if world.size == 1:
        pytest.skip("needs a peer")
    size = 2 + (world.rank == 0)  # each rank's outputs agree with its own input: they differ across ranks
    outputs = [[torch.zeros(size)] for _ in range(world.size)]
    with pytest.raises(mt.CollectiveMismatchError, match="shape"):
        dist.all_gather_coalesced(outputs, [torch.zeros(size)])
    next_all_reduce_is_right(world, "after a mismatched all_gather_coalesced")


def test_sparse_all_reduce_sums_every_ranks_entries(world):
    """A sparse COO tensor's all-reduce (SUM, as gloo): every rank's entries at their indices, summed."""
    dense = [np.zeros((4, 3)) for _ in range(world.size)]
    for rank in range(world.size):
        dense[rank][rank % 4, :] = rank + 1.0  # one row each; ranks 0 and 4 share a row
        dense[rank][3, rank % 3] = 10.0 * (rank + 1)
    tensor = torch.from_numpy(dense[world.rank].copy()).to_sparse()
    dist.all_reduce(tensor)
    assert tensor.is_sparse
    np.testing.assert_array_equal(tensor.to_dense().numpy(), np.sum(dense, axis=0))
    with pytest.raises(ValueError, match="SUM only"):
        dist.all_reduce(torch.zeros(3).to_sparse(), op=dist.ReduceOp.MAX)  # on every rank: no turn owed
    next_all_reduce_is_right(world, "after sparse all_reduce")


def test_sequence_numbers_count_the_groups_collectives(world):
    """torch's sequence number: the same on every rank, one more for each collective of the group."""
    group = dist.new_group()  # counting from its start (every rank of this module's group counts its own calls)
    assert group._get_sequence_number_for_group() == 0
    for i in range(1, 4):
        dist.all_reduce(torch.ones(1), group=group)
        dist.broadcast(torch.ones(1), src=0, group=group)
        dist.barrier(group=group)
        assert group._get_sequence_number_for_group() == 3 * i
    every = mt.all_gather_object(group._get_sequence_number_for_group()).resolve()
    assert every == [9] * world.size
    dist.destroy_process_group(group)


def test_the_group_declares_the_cpu_and_cuda(world):
    """torch reads a group's devices from it (dcp.async_save wants the CPU among them)."""
    assert set(dist.group.WORLD._device_types) == {torch.device("cpu"), torch.device("cuda")}


def next_all_reduce_is_right(world: mt.DistributedContext, name: str) -> None:
    arrays = inputs(name, (3,), torch.float64, world.size)
    tensor = as_torch(arrays[world.rank], torch.float64)
    dist.all_reduce(tensor)
    check(tensor, np.sum(arrays, axis=0), torch.float64)
