"""mpitensor.torch.DataParallel beside torch DDP on gloo, case by case: every rank's gradients compared."""

from __future__ import annotations

import contextlib
import datetime
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import mpitensor as mt

torch = pytest.importorskip("torch")
from mpitensor.torch import DataParallel  # noqa: E402 - after the skip when torch is missing
from tests.integrations.torch_gloo import gloo_store, leave_gloo  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)
Grads = list[list[Any]]  # per step, each parameter's gradient (None where it has none)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread per rank: several ranks share the machine's cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def beside_gloo(ctx: mt.DistributedContext, run: Callable[[], Any]) -> Any:
    """Run `run` inside a gloo process group, and end the group whatever happens.

    DDP lives only in `run`: its result holds no DDP, and a failure's frames are cleared,
    so that DDP is gone before `leave_gloo`.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=60)
    dist.init_process_group("gloo", store=gloo_store(dist, ctx, timeout), rank=ctx.rank, world_size=ctx.size,
                            timeout=timeout)
    try:
        return run()
    except BaseException as exc:
        traceback.clear_frames(exc.__traceback__)
        raise
    finally:
        mt.barrier()  # no rank tears its connections down while another still reads from them
        leave_gloo(dist)


def grads_of(model: torch.nn.Module) -> list[Any]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def assert_like_ddp(ctx: mt.DistributedContext, ddp: Grads, ours: Grads, names: list[str], record: Any,
                    atol: float = 1e-15) -> float:
    """Each step's gradients on this rank equal DDP's; records and returns the largest difference."""
    assert len(ours) == len(ddp), f"rank {ctx.rank}: {len(ours)} steps against DDP's {len(ddp)}"
    worst = 0.0
    for step, (theirs, mine) in enumerate(zip(ddp, ours)):
        for name, a, b in zip(names, theirs, mine):
            where = f"rank {ctx.rank}, step {step}, {name}.grad"
            assert (a is None) == (b is None), f"{where}: DDP's is {a}, DataParallel's is {b}"
            if a is not None:
                worst = max(worst, (a - b).abs().max().item())
                torch.testing.assert_close(b, a, rtol=1e-13, atol=atol, msg=where)
    record("max_grad_difference_to_ddp", worst)
    return worst


class Branchy(torch.nn.Module):
    """`extra` is used by even ranks only, `never` by no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(6, 5, dtype=torch.float64)
        self.extra = torch.nn.Linear(5, 5, dtype=torch.float64)
        self.never = torch.nn.Linear(5, 5, dtype=torch.float64)
        self.head = torch.nn.Linear(5, 2, dtype=torch.float64)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(torch.tanh(self.extra(h)) if use_extra else h)


def inputs(step: int, rank: int, rows: int = 4, cols: int = 6) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(100 * step + rank), dtype=torch.float64)


def test_parameters_some_ranks_leave_unused_need_no_flag(ctx, record_property):
    """DDP needs find_unused_parameters=True for this; DataParallel gives the same gradients without it."""

    def train(model: torch.nn.Module) -> Grads:
        opt, steps = torch.optim.SGD(model.parameters(), lr=0.1), []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            model(inputs(step, ctx.rank), ctx.rank % 2 == 0).square().sum().backward()
            steps.append(grads_of(model))
            opt.step()
        return steps

    def run() -> tuple[Grads, Grads]:
        ddp = torch.nn.parallel.DistributedDataParallel(Branchy(), find_unused_parameters=True)
        return train(ddp), train(DataParallel(Branchy(), bucket_bytes=128))

    ddp, ours = beside_gloo(ctx, run)
    names = [name for name, _ in Branchy().named_parameters()]
    assert_like_ddp(ctx, ddp, ours, names, record_property)
    assert ours[0][names.index("never.weight")] is None


class Checkpointed(torch.nn.Module):
    """Four tanh layers; those in `segments` run in reentrant activation checkpoints, one each."""

    def __init__(self, segments: tuple[int, ...]) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6, dtype=torch.float64) for _ in range(4))
        self.segments = segments

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for number, layer in enumerate(self.layers):
            step = lambda h, layer=layer: torch.tanh(layer(h))  # noqa: E731 - one layer's segment
            x = checkpoint(step, x, use_reentrant=True) if number in self.segments else step(x)
        return x


class CountedAllReduce:
    """`mt.all_reduce` that counts its calls (how many a backward posts)."""

    def __init__(self) -> None:
        self.calls, self.inner = 0, mt.all_reduce

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner(*args, **kwargs)


@pytest.mark.parametrize("segments", [(0, 1), (2, 3), (0, 1, 2, 3)], ids=["first", "last", "every"])
def test_reentrant_checkpointing_gives_ddps_gradients(ctx, record_property, monkeypatch, segments):
    counted = CountedAllReduce()

    def train(model: torch.nn.Module) -> Grads:
        opt, steps = torch.optim.SGD(model.parameters(), lr=0.1), []
        for step in range(2):
            opt.zero_grad()
            x = inputs(step, ctx.rank).requires_grad_(True)  # reentrant checkpoints need an input that does
            model(x).square().sum().backward()
            steps.append(grads_of(model))
            opt.step()
        return steps

    def run() -> tuple[Grads, Grads, int]:
        ddp = torch.nn.parallel.DistributedDataParallel(Checkpointed(segments))
        ours = DataParallel(Checkpointed(segments), bucket_bytes=128)
        monkeypatch.setattr(mt, "all_reduce", counted)
        return train(ddp), train(ours), len(ours.bucket_names)

    ddp, ours, buckets = beside_gloo(ctx, run)
    # One end of backward, after the outermost one: each bucket once, no second round.
    assert counted.calls == 2 * buckets, f"{counted.calls} all-reduces in 2 backwards of {buckets} buckets"
    assert_like_ddp(ctx, ddp, ours, [name for name, _ in Checkpointed(segments).named_parameters()], record_property)


def tanh_net() -> torch.nn.Module:
    torch.manual_seed(6)
    return torch.nn.Sequential(torch.nn.Linear(5, 7, dtype=torch.float64), torch.nn.Tanh(),
                               torch.nn.Linear(7, 1, dtype=torch.float64))


def full_batch(ctx: mt.DistributedContext, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rows stacked (3 each), and this rank's."""
    rows = torch.cat([inputs(step, rank, rows=3, cols=5) for rank in range(ctx.size)])
    return rows, rows[3 * ctx.rank : 3 * ctx.rank + 3]


def assert_grads(model: torch.nn.Module, expected: list[torch.Tensor], what: str, record: Any) -> None:
    worst = max((p.grad - want).abs().max().item() for p, want in zip(model.parameters(), expected))
    record(f"max_difference_to_one_process_{what}", worst)
    for (name, p), want in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.grad, want, rtol=1e-12, atol=1e-14, msg=f"{what}: {name}.grad")


def test_create_graph_gives_the_average_and_its_derivative(ctx, record_property):
    """backward(create_graph=True), then a penalty on the gradients: one process on the whole batch."""
    model = DataParallel(tanh_net())
    everything, mine = full_batch(ctx)
    model(mine).square().mean().backward(create_graph=True)
    assert all(p.grad.requires_grad for p in model.parameters())
    reference = tanh_net()
    grads = torch.autograd.grad(reference(everything).square().mean(), list(reference.parameters()), create_graph=True)
    assert_grads(model, [g.detach() for g in grads], "first_order", record_property)
    penalty = sum(p.grad.square().sum() for p in model.parameters())
    model.zero_grad(set_to_none=True)
    penalty.backward()
    want = torch.autograd.grad(sum(g.square().sum() for g in grads), list(reference.parameters()))
    assert_grads(model, list(want), "penalty", record_property)
    model.zero_grad(set_to_none=False)  # and a plain step after it: the bucket views again
    model(mine).square().mean().backward()
    reference.zero_grad()
    reference(everything).square().mean().backward()
    assert_grads(model, [p.grad for p in reference.parameters()], "next_step", record_property)


def test_an_input_gradient_penalty_averages_once(ctx, record_property, monkeypatch):
    """WGAN-GP: torch.autograd.grad on the inputs posts nothing; the total loss's backward averages."""
    model = DataParallel(tanh_net())
    counted = CountedAllReduce()
    monkeypatch.setattr(mt, "all_reduce", counted)

    def objective(net: torch.nn.Module, x: torch.Tensor, shards: int) -> torch.Tensor:
        x = x.clone().requires_grad_(True)
        out = net(x)
        (dx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        return out.mean() + ((dx.norm(dim=1) - 1) ** 2).sum() / (3 * shards)

    everything, mine = full_batch(ctx)
    objective(model, mine, 1).backward()
    buckets = len(model.bucket_names)
    assert counted.calls == buckets, f"{counted.calls} all-reduces for {buckets} buckets"
    reference = tanh_net()
    objective(reference, everything, ctx.size).backward()  # the mean over ranks of each rank's objective
    assert_grads(model, [p.grad for p in reference.parameters()], "input_penalty", record_property)


def small_cnn(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, dtype=torch.float64), torch.nn.Tanh(), torch.nn.Flatten(),
                               torch.nn.Linear(2 * 4 * 4, 3, dtype=torch.float64))


DDP_ARGUMENTS = [
    {"bucket_cap_mb": 0.0005, "gradient_as_bucket_view": True, "static_graph": True, "device_ids": None,
     "output_device": None, "dim": 0, "process_group": None, "broadcast_buffers": True, "init_sync": True,
     "find_unused_parameters": False, "check_reduction": False, "mixed_precision": None},
    {"bucket_cap_mb": 25, "gradient_as_bucket_view": False, "static_graph": False, "find_unused_parameters": True,
     "forward_sync_buffers": True, "skip_all_reduce_unused_params": False, "batched_grad_copy": True,
     "device_mesh": None, "delay_all_reduce_named_params": None, "param_to_hook_all_reduce": None},
]


@pytest.mark.parametrize("arguments", DDP_ARGUMENTS, ids=["static_graph", "find_unused"])
def test_ddps_keyword_arguments_give_ddps_gradients(ctx, record_property, arguments):
    """The same keyword arguments to both, each rank starting from its own weights (init_sync copies rank 0's)."""

    def train(model: torch.nn.Module) -> Grads:
        opt, steps = torch.optim.SGD(model.parameters(), lr=0.1), []
        for step in range(3):
            opt.zero_grad()
            model(inputs(step, ctx.rank, rows=4, cols=36).view(4, 1, 6, 6)).square().sum().backward()
            steps.append(grads_of(model))
            opt.step()
        return steps

    def run() -> tuple[Grads, Grads]:
        ddp = torch.nn.parallel.DistributedDataParallel(small_cnn(ctx.rank), **arguments)
        return train(ddp), train(DataParallel(small_cnn(ctx.rank), **arguments))

    ddp, ours = beside_gloo(ctx, run)
    assert_like_ddp(ctx, ddp, ours, [name for name, _ in small_cnn(0).named_parameters()], record_property)


def test_bucket_cap_mb_is_the_bucket_size_in_mib(ctx):
    by_mib = DataParallel(small_cnn(0), bucket_cap_mb=200 / 2**20)
    assert by_mib.bucket_names == DataParallel(small_cnn(0), bucket_bytes=200).bucket_names
    assert len(by_mib.bucket_names) == 3 and len(DataParallel(small_cnn(0), bucket_cap_mb=1).bucket_names) == 1


@pytest.mark.mpi(min_size=2)
def test_init_sync_false_leaves_each_rank_its_weights(ctx):
    from tests.integrations.test_torch_data_parallel import assert_same_on_every_rank

    model = DataParallel(small_cnn(ctx.rank), init_sync=False)
    torch.testing.assert_close(model.module[3].weight, small_cnn(ctx.rank)[3].weight, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="differs"):
        assert_same_on_every_rank(ctx, list(model.parameters()))
    assert_same_on_every_rank(ctx, list(DataParallel(small_cnn(ctx.rank), init_sync=True).parameters()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize(("arguments", "at_start", "each_forward"), [
    ({"broadcast_buffers": False}, False, False),
    ({"forward_sync_buffers": False}, True, False),
    ({"broadcast_buffers": True}, True, True),
])
def test_the_buffer_flags_mean_what_they_mean_in_ddp(ctx, arguments, at_start, each_forward):
    def normed() -> torch.nn.Module:
        net = torch.nn.BatchNorm1d(2)
        net.running_mean.fill_(ctx.rank)
        return net

    model = DataParallel(normed(), **arguments)
    assert model.module.running_mean.eq(0 if at_start else ctx.rank).all()
    model.module.running_mean.fill_(10 + ctx.rank)
    model.eval()
    model(torch.ones(2, 2))
    assert model.module.running_mean.eq(10 if each_forward else 10 + ctx.rank).all()


@pytest.mark.parametrize(("arguments", "error", "message"), [
    ({"device_ids": [0]}, ValueError, r"CPU modules: device_ids must be None .* got \[0\]"),
    ({"output_device": 0}, ValueError, r"output_device must be None .* got 0"),
    ({"process_group": object()}, TypeError, r"does not support process_group; .*dist\.new_group\(ranks\)"),
    ({"device_mesh": object()}, TypeError, r"does not support device_mesh; .*'mpitensor' backend"),
    ({"mixed_precision": object()}, TypeError, r"does not support mixed_precision; cast the module .*autocast"),
    ({"bucket_cap_mb_list": [1, 25]}, TypeError, r"does not support bucket_cap_mb_list; use bucket_cap_mb"),
    ({"delay_all_reduce_named_params": []}, TypeError, r"does not support delay_all_reduce_named_params"),
    ({"param_to_hook_all_reduce": object()}, TypeError, r"does not support param_to_hook_all_reduce"),
    ({"bucket_cap_mb": 1, "bucket_bytes": 1024}, TypeError, r"pass bucket_bytes or bucket_cap_mb, not both"),
    ({"bucket_cap_mb": 0}, ValueError, r"bucket_cap_mb must be positive, got 0"),
    ({"bucket_cap_mb": "25"}, TypeError, r"bucket_cap_mb must be a number of MiB, got str"),
    ({"static_graph": "yes"}, TypeError, r"static_graph must be a bool, got str"),
    ({"dim": 0.5}, TypeError, r"dim must be an int, got float"),
    ({"sync_every": 2}, TypeError, r"unexpected keyword argument 'sync_every'"),
])
def test_ddp_arguments_it_cannot_honour_are_clear_errors(ctx, arguments, error, message):
    with pytest.raises(error, match=message):
        DataParallel(small_cnn(0), **arguments)
    DataParallel(small_cnn(0), device_ids=[], output_device=None)  # what DDP takes for a CPU module


def normed_net() -> torch.nn.Module:
    torch.manual_seed(8)
    return torch.nn.Sequential(torch.nn.Linear(6, 5, dtype=torch.float64), torch.nn.BatchNorm1d(5, dtype=torch.float64),
                               torch.nn.Tanh(), torch.nn.Linear(5, 2, dtype=torch.float64))


@pytest.mark.parametrize("divide_by_initial_world_size", [True, False])
def test_join_with_uneven_inputs_gives_ddps_gradients_and_model(ctx, record_property, divide_by_initial_world_size):
    """Rank r has 2 + r batches (every third step under no_sync); nobody hangs, and each step equals DDP's."""
    batches = 2 + ctx.rank

    def train(model: Any) -> tuple[Grads, list[Any]]:
        opt, steps = torch.optim.SGD(model.parameters(), lr=0.1), []
        with model.join(divide_by_initial_world_size=divide_by_initial_world_size):
            for step in range(batches):
                opt.zero_grad()
                with model.no_sync() if step == 1 else contextlib.nullcontext():
                    model(inputs(step, ctx.rank)).square().sum().backward()
                steps.append(grads_of(model))
                opt.step()
        return steps, [t.detach().clone() for t in [*model.module.parameters(), *model.module.buffers()]]

    def run() -> tuple[Any, Any]:
        return train(torch.nn.parallel.DistributedDataParallel(normed_net())), train(DataParallel(normed_net()))

    (ddp, ddp_model), (ours, our_model) = beside_gloo(ctx, run)
    assert_like_ddp(ctx, ddp, ours, [name for name, _ in normed_net().named_parameters()], record_property)
    for number, (a, b) in enumerate(zip(ddp_model, our_model)):  # the last joiner's model, on every rank
        torch.testing.assert_close(b, a, rtol=1e-13, atol=1e-15, msg=f"rank {ctx.rank}: tensor {number} of the model")


@pytest.mark.mpi(min_size=2)
def test_join_can_stop_every_rank_when_one_runs_out(ctx):
    model = DataParallel(normed_net())
    ran_out = r"rank\(s\) \[0\] ran out of inputs, and throw_on_early_termination"
    with pytest.raises(RuntimeError, match=ran_out), model.join(throw_on_early_termination=True):
        for step in range(1 + min(ctx.rank, 1)):  # rank 0 one step, the others two
            model(inputs(step, ctx.rank)).square().sum().backward()
