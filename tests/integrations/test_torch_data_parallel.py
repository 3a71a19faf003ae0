"""mpitensor.torch.DataParallel: the same training as one process, and as torch DDP."""

from __future__ import annotations

import copy
import datetime
import gc
import traceback
from collections.abc import Iterator

import numpy as np
import pytest

import mpitensor as mt

torch = pytest.importorskip("torch")
from mpitensor.torch import DataParallel  # noqa: E402 - after the skip when torch is missing
from tests.integrations.torch_gloo import gloo_store, leave_gloo  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)
BATCH = 24  # divisible by 1, 2, 3 and 4 ranks


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread per rank: several ranks share the machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Net(torch.nn.Module):
    """A small CNN-and-MLP in float64, with an optional layer no forward uses."""

    def __init__(self, seed: int = 0, unused: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(1, 3, 3, dtype=torch.float64)
        self.fc1 = torch.nn.Linear(3 * 4 * 4, 16, dtype=torch.float64)
        self.fc2 = torch.nn.Linear(16, 4, dtype=torch.float64)
        self.unused = torch.nn.Linear(4, 4, dtype=torch.float64) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x)).flatten(1)
        return self.fc2(torch.tanh(self.fc1(h)))


def data(step: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(rows, 1, 6, 6, generator=gen, dtype=torch.float64), torch.randint(0, 4, (rows,), generator=gen)


def shard(tensor: torch.Tensor, ctx: mt.DistributedContext) -> torch.Tensor:
    per = len(tensor) // ctx.size
    return tensor[ctx.rank * per : (ctx.rank + 1) * per]


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(out, y)


def assert_same_on_every_rank(ctx: mt.DistributedContext, tensors: list[torch.Tensor]) -> None:
    """Every rank holds bit-identical `tensors` (gathered and compared on every rank)."""
    flat = torch.cat([t.detach().reshape(-1) for t in tensors]).numpy()
    gathered = mt.all_gather(flat[None, :]).resolve().numpy()
    for rank in range(ctx.size):
        np.testing.assert_array_equal(gathered[rank], flat, err_msg=f"rank {rank} differs from rank {ctx.rank}")


def train_single(model: torch.nn.Module, steps: int, lr: float = 0.1) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("bucket_bytes", [None, 512])
def test_ten_sgd_steps_equal_a_single_process_on_the_whole_batch(ctx, bucket_bytes):
    # Every rank starts from its own seed: the construction gives them rank 0's weights.
    model = DataParallel(Net(seed=ctx.rank), bucket_bytes=bucket_bytes)
    if bucket_bytes == 512:
        assert len(model.bucket_names) > 2  # several buckets, the last layer's first
        assert model.bucket_names[0][0] == "fc2.bias"
    reference = Net(seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(10):
        x, y = data(step)
        opt.zero_grad()
        loss_fn(model(shard(x, ctx)), shard(y, ctx)).backward()
        opt.step()
    train_single(reference, 10)
    for (name, mine), theirs in zip(model.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-12, msg=f"{name} differs from one process")
    assert_same_on_every_rank(ctx, list(model.parameters()))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_are_final_when_backward_returns(ctx, set_to_none):
    model = DataParallel(Net(), bucket_bytes=256)
    reference = Net()
    x, y = data(0)
    for _ in range(2):  # the second step accumulates into the bucket views, or adopts fresh grads
        model.zero_grad(set_to_none=set_to_none)
        loss_fn(model(shard(x, ctx)), shard(y, ctx)).backward()
    loss_fn(reference(x), y).backward()
    for (name, mine), theirs in zip(model.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-13, msg=f"{name}.grad")
    assert_same_on_every_rank(ctx, [p.grad for p in model.parameters()])


def test_no_sync_accumulates_and_the_next_backward_averages_the_sum(ctx):
    model = DataParallel(Net(), bucket_bytes=256)
    reference = Net()
    micro = [data(step) for step in range(3)]
    with model.no_sync():
        for x, y in micro[:2]:
            loss_fn(model(shard(x, ctx)), shard(y, ctx)).backward()
    local = [p.grad.clone() for p in model.parameters()]
    x, y = micro[2]
    loss_fn(model(shard(x, ctx)), shard(y, ctx)).backward()
    for x, y in micro:
        loss_fn(reference(x), y).backward()
    for (name, mine), theirs in zip(model.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-13, msg=f"{name}.grad")
    if ctx.size > 1:  # inside no_sync nothing was averaged: each rank had its own shard's sums
        others = mt.all_gather(torch.cat([g.reshape(-1) for g in local]).numpy()[None]).resolve().numpy()
        assert not np.array_equal(others[0], others[1])


def test_a_parameter_no_rank_uses_keeps_no_gradient_without_the_flag(ctx):
    model = DataParallel(Net(unused=True))
    reference = Net(unused=True)
    x, y = data(0)
    for _ in range(2):  # twice: the flag in the last bucket is lowered between steps
        model.zero_grad(set_to_none=True)
        loss_fn(model(shard(x, ctx)), shard(y, ctx)).backward()
    loss_fn(reference(x), y).backward()
    assert model.module.unused.weight.grad is None and model.module.unused.bias.grad is None
    for (name, mine), theirs in zip(model.module.named_parameters(), reference.parameters()):
        if theirs.grad is not None:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-13, msg=f"{name}.grad")


class Branchy(torch.nn.Module):
    """Rank 0 skips the `extra` layer; `never` is used by no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(6, 4, dtype=torch.float64)
        self.extra = torch.nn.Linear(4, 4, dtype=torch.float64)
        self.never = torch.nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor, use_extra: bool, use_never: bool = False) -> torch.Tensor:
        h = self.body(x)
        h = self.never(h) if use_never else h
        return self.extra(h) if use_extra else h


@pytest.mark.parametrize("flag", [True, False])
def test_parameters_unused_on_some_ranks_average_their_zeros(ctx, flag):
    model = DataParallel(Branchy(), find_unused_parameters=flag, bucket_bytes=64)
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randn(5, 6, generator=gen, dtype=torch.float64) for _ in range(ctx.size)]
    for _ in range(2):  # twice: the state is reset between steps
        model.zero_grad(set_to_none=True)
        model(inputs[ctx.rank], ctx.rank != 0).square().sum().backward()
    expected = {name: torch.zeros_like(p) for name, p in model.module.named_parameters()}
    for rank in range(ctx.size):
        local = Branchy()
        local(inputs[rank], rank != 0).square().sum().backward()
        for name, p in local.named_parameters():
            if p.grad is not None:
                expected[name] += p.grad / ctx.size
    for name, p in model.module.named_parameters():
        if name.startswith("never"):
            assert p.grad is None, f"{name}: unused on every rank, its grad must stay None"
        elif name.startswith("extra") and ctx.size == 1:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, expected[name], rtol=1e-13, atol=1e-13, msg=name)


def test_a_gradient_no_rank_touched_in_a_step_keeps_its_value(ctx):
    model = DataParallel(Branchy())
    x = torch.full((3, 6), 0.5 + ctx.rank, dtype=torch.float64)
    model(x, True, True).sum().backward()  # every parameter used: averaged
    before = {name: p.grad.clone() for name, p in model.module.named_parameters()}
    model(x, True).sum().backward()  # `never` unused everywhere, its gradient not zeroed
    assert torch.equal(model.module.never.weight.grad, before["never.weight"])
    assert not torch.equal(model.module.body.weight.grad, before["body.weight"])


def test_buffers_come_from_rank_0_at_construction_and_before_each_forward(ctx):
    def batchnormed(seed: int) -> torch.nn.Module:
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        with torch.no_grad():
            net[1].running_mean.fill_(seed)
            net[1].num_batches_tracked.fill_(seed)
        return net

    model = DataParallel(batchnormed(ctx.rank))
    assert model.module[1].running_mean.eq(0).all() and model.module[1].num_batches_tracked.item() == 0
    with torch.no_grad():
        model.module[1].running_mean.fill_(10 + ctx.rank)
    model.eval()
    model(torch.ones(2, 3))
    assert model.module[1].running_mean.eq(10).all()
    kept = DataParallel(batchnormed(ctx.rank), broadcast_buffers=False)
    with torch.no_grad():
        kept.module[1].running_mean.fill_(10 + ctx.rank)
    kept.eval()
    kept(torch.ones(2, 3))
    assert kept.module[1].running_mean.eq(10 + ctx.rank).all()


def _batchnormed_net() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(4, 6, dtype=torch.float64), torch.nn.BatchNorm1d(6, dtype=torch.float64),
                               torch.nn.Tanh(), torch.nn.Linear(6, 2, dtype=torch.float64))


def _two_batches(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(200 + rank)
    return torch.randn(5, 4, generator=gen, dtype=torch.float64), torch.randn(5, 4, generator=gen, dtype=torch.float64)


def test_two_forwards_through_batchnorm_before_one_backward(ctx):
    """A GAN's D(real) + D(fake): the buffer broadcast of the second forward must not break the first's graph."""
    model = DataParallel(_batchnormed_net())
    real, fake = _two_batches(ctx.rank)
    (model(real).sum() - model(fake).square().sum()).backward()
    # In training mode BatchNorm normalizes with the batch's statistics: each rank's
    # gradients are those of its own two batches, and the result is their mean over ranks.
    expected = [torch.zeros_like(p) for p in model.module.parameters()]
    for rank in range(ctx.size):
        local = _batchnormed_net()
        real, fake = _two_batches(rank)
        (local(real).sum() - local(fake).square().sum()).backward()
        for total, param in zip(expected, local.parameters()):
            total.add_(param.grad / ctx.size)
    for param, want in zip(model.module.parameters(), expected):
        torch.testing.assert_close(param.grad, want, rtol=1e-12, atol=1e-14)


def test_a_buffer_rank_0_reassigns_reaches_every_rank(ctx):
    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2, dtype=torch.float64)
            self.register_buffer("scale", torch.ones(2, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * self.scale

    model = DataParallel(Scaled())
    model.module.scale = torch.full((2,), 3.0 + ctx.rank, dtype=torch.float64)  # a new tensor, not an in-place write
    model(torch.ones(1, 2, dtype=torch.float64)).sum().backward()
    assert model.module.scale.tolist() == [3.0, 3.0]
    assert_same_on_every_rank(ctx, [model.module.scale])


def test_forward_and_state_dict_pass_through(ctx):
    net = Net()
    model = DataParallel(net)
    x, _ = data(0, rows=2)
    assert model.module is net
    torch.testing.assert_close(model(x), net(x))
    assert list(model.state_dict()) == [f"module.{key}" for key in net.state_dict()]  # as DDP's
    assert model.bucket_names == [["fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight", "conv.bias", "conv.weight"]]


def test_bad_arguments_are_clear_errors(ctx):
    with pytest.raises(ValueError, match="bucket_bytes must be positive, got 0"):
        DataParallel(Net(), bucket_bytes=0)
    with pytest.raises(TypeError, match="bucket_bytes must be an int or None, got float"):
        DataParallel(Net(), bucket_bytes=1e6)
    with pytest.raises(TypeError, match=r"wraps a torch\.nn\.Module, got function"):
        DataParallel(loss_fn)
    sparse = torch.nn.Embedding(4, 2, sparse=True)
    with pytest.raises(TypeError, match=r"'weight' needs sparse gradients"):
        DataParallel(sparse)


def _train_beside_ddp(ctx: mt.DistributedContext) -> None:
    """Three steps of torch DDP and of DataParallel from the same weights: the same gradients at each.

    DDP lives only in this function, so that it is gone before `leave_gloo`, also when a
    comparison fails.
    """
    ddp = torch.nn.parallel.DistributedDataParallel(Net(seed=ctx.rank), bucket_cap_mb=0.001)
    ours = DataParallel(copy.deepcopy(ddp.module), bucket_bytes=1024)
    model = None
    try:
        for step in range(3):
            x, y = data(step)
            for model in (ddp, ours):
                model.zero_grad()
                loss_fn(model(shard(x, ctx)), shard(y, ctx)).backward()
            for (name, a), b in zip(ddp.module.named_parameters(), ours.module.parameters()):
                torch.testing.assert_close(b.grad, a.grad, rtol=1e-13, atol=1e-15, msg=f"{name}.grad at step {step}")
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)  # the failed calls' frames would keep DDP alive
        raise
    finally:
        del ddp, model


def test_same_gradients_as_torch_ddp_on_gloo(ctx):
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=gloo_store(dist, ctx, timeout), rank=ctx.rank, world_size=ctx.size,
                            timeout=timeout)
    try:
        _train_beside_ddp(ctx)
    finally:
        mt.barrier()  # no rank tears its connections down while another still reads from them
        leave_gloo(dist)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lower_precision_gradients_are_averaged_in_their_dtype(ctx, dtype):
    torch.manual_seed(0)
    model = DataParallel(torch.nn.Linear(8, 3).to(dtype), bucket_bytes=64)
    inputs = [torch.full((2, 8), 0.25 * (rank + 1), dtype=dtype) for rank in range(ctx.size)]
    model(inputs[ctx.rank]).sum().backward()
    expected = torch.zeros(3, 8)
    for rank in range(ctx.size):
        expected += inputs[rank].float().sum(0).expand(3, 8) / ctx.size
    assert model.module.weight.grad.dtype == dtype
    torch.testing.assert_close(model.module.weight.grad.float(), expected, rtol=1e-2, atol=1e-2)
    assert_same_on_every_rank(ctx, [model.module.weight.grad.float()])


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_models_get_a_mismatch_error(ctx):
    width = 4 if ctx.rank == 0 else 5
    with pytest.raises(mt.CollectiveMismatchError):
        DataParallel(torch.nn.Linear(3, width))


def test_a_module_wrapped_again_is_averaged_once(ctx):

    net, reference = Net(), Net()
    first = DataParallel(net)
    del first
    gc.collect()
    model = DataParallel(net)
    x, y = data(0)
    loss_fn(model(shard(x, ctx)), shard(y, ctx)).backward()
    loss_fn(reference(x), y).backward()
    for (name, mine), theirs in zip(net.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-13, msg=f"{name}.grad")


@pytest.mark.mpi(min_size=2)
def test_ranks_with_different_bucket_sizes_get_a_mismatch_error(ctx):
    model = DataParallel(Net(), bucket_bytes=256 if ctx.rank == 0 else 4096)
    x, y = data(0)
    with pytest.raises(mt.CollectiveMismatchError):
        loss_fn(model(shard(x, ctx)), shard(y, ctx)).backward()
