"""Every collective with torch and JAX tensors and Python numbers: results in the same library."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from mpitensor._core.config import parse_op
from tests.helpers import rank_input, reference

pytestmark = pytest.mark.mpi(min_size=1)

OP = mt.ReduceOperation
torch = pytest.importorskip("torch")
jax = pytest.importorskip("jax")
jnp = jax.numpy

SMALL, LARGE = (3, 4), (64, 1024)  # 48 bytes and 256 KiB of float32: a copy and a lazy clone


def _inputs(seed, size, shape, dtype=np.float32):
    return [rank_input(seed, rank, shape, dtype) for rank in range(size)]


def _as_numpy(value):
    if isinstance(value, torch.Tensor):
        return value.numpy()
    return np.asarray(value)


def _check(result, kind, expected, exact=False):
    assert isinstance(result, kind), type(result)
    if exact:
        np.testing.assert_array_equal(_as_numpy(result), expected)
    else:
        np.testing.assert_allclose(_as_numpy(result), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small", "large"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_all_reduce_of_torch_and_jax(module_ctx, shape, op):
    ctx = module_ctx
    inputs = _inputs(11, ctx.size, shape)
    expected = reference(parse_op(op), inputs)
    mine = inputs[ctx.rank]
    from_torch = mt.all_reduce(torch.from_numpy(mine.copy()), op)
    from_jax = mt.all_reduce(jnp.asarray(mine), op)
    _check(from_torch.resolve(), torch.Tensor, expected)
    assert from_torch.resolve() is from_torch.resolve()
    assert from_torch.resolve().dtype == torch.float32
    _check(from_jax.resolve(), jax.Array, expected)


@pytest.mark.mpi
def test_a_large_torch_tensor_written_in_flight_sends_what_it_held(module_ctx):
    ctx = module_ctx
    inputs = _inputs(12, ctx.size, LARGE)
    tensor = torch.tensor(inputs[ctx.rank])  # torch's own memory: sent through a lazy clone
    handle = mt.all_reduce(tensor, "sum")
    tensor.mul_(100)  # the tensor gets fresh memory; the data in flight stays
    _check(handle.resolve(), torch.Tensor, reference(OP.SUM, inputs))
    np.testing.assert_allclose(tensor.numpy(), inputs[ctx.rank] * 100)


@pytest.mark.mpi
def test_torch_results_stay_valid_while_buffers_are_reused(module_ctx):
    ctx = module_ctx
    kept = [mt.all_reduce(torch.full(LARGE, float(i)), "sum").resolve() for i in range(4)]
    for _ in range(4):
        mt.all_reduce(np.zeros(LARGE, np.float32), "sum").resolve()
    for i, result in enumerate(kept):
        assert torch.all(result == i * ctx.size)


@pytest.mark.mpi
def test_requires_grad_tensors_and_parameters_are_reduced(module_ctx):
    ctx = module_ctx
    param = torch.nn.Parameter(torch.full((5,), float(ctx.rank + 1)))
    leaf = torch.full((5,), 2.0, requires_grad=True)
    got_param = mt.all_reduce(param, "mean").resolve()
    got_leaf = mt.all_reduce(leaf * 1.0, "sum").resolve()  # not a leaf: has a grad_fn
    _check(got_param, torch.Tensor, np.full(5, (ctx.size + 1) / 2))
    _check(got_leaf, torch.Tensor, np.full(5, 2.0 * ctx.size))
    assert not got_param.requires_grad


@pytest.mark.mpi
def test_bfloat16_torch_tensors(module_ctx):
    ctx = module_ctx
    tensor = torch.full((7,), 0.5 * (ctx.rank + 1), dtype=torch.bfloat16)
    result = mt.all_reduce(tensor, "sum").resolve()
    assert result.dtype == torch.bfloat16
    expected = torch.full((7,), 0.5 * sum(range(1, ctx.size + 1)), dtype=torch.bfloat16)
    assert torch.equal(result, expected)
    gathered = mt.all_gather(tensor).resolve()
    assert gathered.dtype == torch.bfloat16 and gathered.shape == (7 * ctx.size,)


@pytest.mark.mpi
def test_numbers_and_dicts_of_metrics(module_ctx):
    ctx = module_ctx
    metrics = mt.all_reduce({"loss": 0.25 * (ctx.rank + 1), "acc": 0.5}, "mean").resolve()
    assert metrics == {"loss": pytest.approx(0.25 * (ctx.size + 1) / 2), "acc": 0.5}
    assert all(type(v) is float for v in metrics.values())
    total = mt.all_reduce(ctx.rank + 1, "sum").resolve()
    assert type(total) is int and total == ctx.size * (ctx.size + 1) // 2
    flag = mt.all_reduce(ctx.rank == 0, "max").resolve()
    assert flag is True
    scalar = mt.all_reduce(np.float32(1.5), "sum").resolve()
    assert type(scalar) is np.float32 and scalar == 1.5 * ctx.size
    assert mt.all_gather(float(ctx.rank)).resolve() == [float(r) for r in range(ctx.size)]
    mixed = mt.all_reduce([torch.ones(2), jnp.ones(2), 1.0, np.ones(2)], "sum").resolve()
    assert [type(v) for v in mixed[:3]] == [torch.Tensor, type(jnp.ones(1)), float]
    assert isinstance(mixed[3], mt.Tensor) and mixed[2] == ctx.size


@pytest.mark.mpi
@pytest.mark.parametrize("library", ["torch", "jax"])
def test_every_other_collective(module_ctx, library):
    ctx = module_ctx
    size, rank = ctx.size, ctx.rank
    wrap = torch.from_numpy if library == "torch" else jnp.asarray
    kind = torch.Tensor if library == "torch" else jax.Array
    inputs = _inputs(13, size, (2 * size, 3))
    mine = inputs[rank].copy()
    _check(mt.broadcast(wrap(mine), root=0).resolve(), kind, inputs[0], exact=True)
    reduced = mt.reduce(wrap(mine), "sum", root=0).resolve()
    if rank == 0:
        _check(reduced, kind, reference(OP.SUM, inputs))
    else:
        assert reduced is None
    _check(mt.all_gather(wrap(mine)).resolve(), kind, np.concatenate(inputs), exact=True)
    block = reference(OP.SUM, inputs)[2 * rank : 2 * rank + 2]
    _check(mt.reduce_scatter(wrap(mine), "sum").resolve(), kind, block)
    exchanged = np.concatenate([inputs[r][2 * rank : 2 * rank + 2] for r in range(size)])
    _check(mt.all_to_all(wrap(mine)).resolve(), kind, exchanged, exact=True)


@pytest.mark.mpi(min_size=2)
def test_send_and_recv_of_torch(module_ctx):
    ctx = module_ctx
    if ctx.rank == 0:
        mt.send(torch.arange(4, dtype=torch.float32), 1, tag=3).resolve()
    elif ctx.rank == 1:
        got = mt.recv(torch.empty(4), 0, tag=3).resolve()
        assert isinstance(got, torch.Tensor) and torch.equal(got, torch.arange(4, dtype=torch.float32))
    if ctx.rank == 1:
        mt.send(jnp.ones(2), 0, tag=4).resolve()
    elif ctx.rank == 0:
        got = mt.recv(None, 1, shape=(2,), dtype=jnp.float32, tag=4).resolve()
        np.testing.assert_array_equal(got.numpy(), [1.0, 1.0])


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float32, jnp.float32, np.float32], ids=["torch", "jax", "numpy"])
def test_broadcast_takes_dtypes_of_every_library(module_ctx, dtype):
    ctx = module_ctx
    value = np.arange(3, dtype=np.float32) if ctx.rank == 0 else None
    result = mt.broadcast(value, root=0, shape=(3,), dtype=dtype).resolve()
    assert result.dtype == np.float32
    np.testing.assert_array_equal(result.numpy(), [0.0, 1.0, 2.0])


@pytest.mark.mpi
def test_gradient_sync_of_a_torch_model(module_ctx):
    ctx = module_ctx
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    sync = mt.GradientSync(dict(model.named_parameters()), op="avg")
    for name, param in reversed(list(model.named_parameters())):
        sync.submit(name, torch.full_like(param, float(ctx.rank)))
    averaged = sync.wait()
    assert list(averaged) == [name for name, _ in model.named_parameters()]
    for name, param in model.named_parameters():
        _check(averaged[name], torch.Tensor, np.full(tuple(param.shape), (ctx.size - 1) / 2))


@pytest.mark.mpi
def test_errors_name_the_library_type(module_ctx):
    with pytest.raises(TypeError, match=r"expects input to be .* got object"):
        mt.all_reduce(object())
    with pytest.raises(mt.DeviceError, match=r"all_reduce got torch.Tensor on meta"):
        mt.all_reduce(torch.ones(2, device="meta"))
    with pytest.raises(TypeError, match=r"every tensor of the dict .* got str"):
        mt.all_reduce({"a": torch.ones(1), "b": "text"})
    huge = torch.nn.Parameter(torch.ones(1000))
    with pytest.raises(TypeError) as raised:
        mt.GradientSync({"w": (huge,)})
    assert str(raised.value).endswith("got tuple")  # named by type: no parameter values dumped
    with pytest.raises(TypeError, match=r"parameter 'w': expected \(shape, dtype\) .* got str$"):
        mt.GradientSync({"w": "abc"})
