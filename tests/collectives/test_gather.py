"""`gather`: the root gets every rank's tensor concatenated along an axis; others get None."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import ALL_DTYPES, agree, every_rank_settings, rank_input, same, with_bfloat16

pytestmark = pytest.mark.mpi(min_size=1)

DTYPES = with_bfloat16(ALL_DTYPES)


def _input(seed: int, rank: int, shape: tuple[int, ...], axis: int, dtype: np.dtype) -> np.ndarray:
    """Rank `rank`'s input: `shape` with a length along `axis` that differs between ranks."""
    mine = list(shape)
    if mine:
        mine[axis] = (seed + 3 * rank) % 4
    if dtype.kind == "V":  # bfloat16
        return rank_input(seed, rank, mine, np.float32).astype(dtype)
    return rank_input(seed, rank, mine, dtype)


@every_rank_settings(60)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 3), min_size=0, max_size=3).map(tuple),
    axis=st.integers(-3, 2),
    group_kind=st.sampled_from(GROUP_KINDS),
    root_pick=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_matches_numpy_concatenate(module_ctx, dtype, shape, axis, group_kind, root_pick, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    ndim = max(1, len(shape))
    axis = axis % ndim
    inputs = {r: _input(seed, r, shape, axis, dtype) for r in members}
    root = members[root_pick % len(members)]
    got = mt.gather(inputs[ctx.rank], root, axis=axis, devices=members).resolve()
    if ctx.rank != root:
        ok = got is None
    else:
        pieces = [inputs[r].reshape(1) if inputs[r].ndim == 0 else inputs[r] for r in members]
        ok = isinstance(got, mt.Tensor) and same(got, np.concatenate(pieces, axis=axis))
    agree(ok, f"gather {dtype} {shape} axis {axis} root {root} on {members}")


def test_scalars_become_a_vector_on_the_root(module_ctx):
    ctx = module_ctx
    got = mt.gather(np.array(float(ctx.rank)), root=ctx.size - 1).resolve()
    if ctx.rank == ctx.size - 1:
        assert got.numpy().tolist() == [float(r) for r in range(ctx.size)]
    else:
        assert got is None


def test_root_as_a_device_and_tensor_input(module_ctx):
    ctx = module_ctx
    got = mt.gather(mt.tensor([ctx.rank, ctx.rank]), root=ctx.devices[0]).resolve()
    if ctx.rank == 0:
        assert got.device == ctx.device
        assert got.numpy().tolist() == [r for r in range(ctx.size) for _ in range(2)]


def test_check_off_still_learns_the_lengths():
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        got = mt.gather(np.arange(ctx.rank + 1), root=0).resolve()
        if ctx.rank == 0:
            assert got.numpy().tolist() == [i for r in range(ctx.size) for i in range(r + 1)]


def test_a_bad_axis_is_rejected(module_ctx):
    with pytest.raises(ValueError, match="gather: axis 2 is out of range for a tensor of 2 dimension"):
        mt.gather(np.ones((2, 2)), axis=2)
    with pytest.raises(TypeError, match="gather: axis must be an int, got float"):
        mt.gather(np.ones(2), axis=1.0)
    assert mt.all_reduce(np.ones(1)).resolve().item() == module_ctx.size


def test_a_root_outside_the_group_raises_on_every_rank(module_ctx):
    with pytest.raises(ValueError, match="gather: root 99 is not in the group"):
        mt.gather(np.ones(2), root=99).resolve()
    assert mt.all_reduce(np.ones(1)).resolve().item() == module_ctx.size


def test_torch_jax_and_python_inputs_gather_into_their_kind(module_ctx):
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    ctx = module_ctx
    inputs = [rank_input(31, r, (2, 3), np.float32) for r in range(ctx.size)]
    whole = np.concatenate(inputs, axis=1)
    root = ctx.size - 1
    from_torch = mt.gather(torch.from_numpy(inputs[ctx.rank].copy()), root, axis=1).resolve()
    from_jax = mt.gather(jax.numpy.asarray(inputs[ctx.rank]), root, axis=1).resolve()
    numbers = mt.gather(float(ctx.rank) / 2, root).resolve()
    if ctx.rank != root:
        assert (from_torch, from_jax, numbers) == (None, None, None)
        return
    assert isinstance(from_torch, torch.Tensor) and from_torch.dtype == torch.float32
    np.testing.assert_array_equal(from_torch.numpy(), whole)
    assert isinstance(from_jax, jax.Array) and from_jax.dtype == np.float32
    np.testing.assert_array_equal(np.asarray(from_jax), whole)
    assert numbers == [r / 2 for r in range(ctx.size)] and all(type(n) is float for n in numbers)
