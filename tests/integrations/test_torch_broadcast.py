"""mpitensor.torch.broadcast_parameters and broadcast_optimizer_state (Horovod's helpers)."""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt

torch = pytest.importorskip("torch")
from mpitensor.torch import broadcast_optimizer_state, broadcast_parameters  # noqa: E402

pytestmark = pytest.mark.mpi(min_size=1)


def rank_state(rank: int) -> dict[str, torch.Tensor]:
    """Tensors of several dtypes and shapes whose values depend on the rank."""
    return {
        "w": torch.full((3, 4), float(rank)),
        "b": torch.arange(5, dtype=torch.float64) * (rank + 1),
        "half": torch.full((7,), rank + 0.5, dtype=torch.bfloat16),
        "steps": torch.tensor(rank, dtype=torch.int64),
        "mask": torch.tensor([rank % 2 == 0, True, False]),
        "z": torch.full((2,), complex(rank, -rank), dtype=torch.complex64),
    }


@pytest.mark.parametrize("root_kind", ["first", "last"])
def test_a_state_dict_gets_the_roots_values_in_place(ctx, root_kind):
    root = 0 if root_kind == "first" else ctx.size - 1
    state = rank_state(ctx.rank)
    before = {name: tensor.data_ptr() for name, tensor in state.items()}
    broadcast_parameters(state, root=root)
    for name, expected in rank_state(root).items():
        assert torch.equal(state[name], expected), name
        assert state[name].data_ptr() == before[name], f"{name} was replaced, not written in place"


def test_named_parameters_and_plain_tensors(ctx):
    torch.manual_seed(ctx.rank)
    net = torch.nn.Linear(4, 3)
    broadcast_parameters(net.named_parameters(), root=0)
    torch.manual_seed(0)
    torch.testing.assert_close(net.weight, torch.nn.Linear(4, 3).weight, rtol=0, atol=0)
    tensors = [torch.full((2,), float(ctx.rank)), torch.full((1, 3), -float(ctx.rank))]
    broadcast_parameters(tensors)
    assert all(t.eq(0).all() for t in tensors)
    broadcast_parameters([])  # nothing to do, on every rank


def test_an_entry_that_is_not_a_tensor_is_named(ctx):
    with pytest.raises(TypeError, match=r"entry 'lr' is a float, not a torch\.Tensor"):
        broadcast_parameters({"w": torch.zeros(2), "lr": 0.1})


def _stepped(optimizer_cls, rank: int, steps: int, **kwargs):
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    opt = optimizer_cls(net.parameters(), **kwargs)
    for step in range(steps):
        opt.zero_grad()
        net(torch.full((4, 3), float(step + rank))).sum().backward()
        opt.step()
    return opt


@pytest.mark.parametrize(("cls", "kwargs"), [(torch.optim.Adam, {"betas": (0.8, 0.9)}),
                                             (torch.optim.SGD, {"momentum": 0.9})])
def test_optimizer_state_and_hyperparameters_come_from_the_root(ctx, cls, kwargs):
    # The root has stepped (it has state); the others are fresh, with another learning rate.
    opt = _stepped(cls, ctx.rank, 3 if ctx.rank == 0 else 0, lr=0.01 if ctx.rank == 0 else 0.5, **kwargs)
    broadcast_optimizer_state(opt, root=0)
    expected = _stepped(cls, 0, 3, lr=0.01, **kwargs).state_dict()
    got = opt.state_dict()
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, entries in expected["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0, msg=f"state[{index}][{key}]")
    flat = np.concatenate([t.reshape(-1).numpy() for e in got["state"].values() for t in e.values()])
    gathered = mt.all_gather(flat[None]).resolve().numpy()
    assert all(np.array_equal(row, flat) for row in gathered)
