"""`scatter`: the root's tensor split along an axis, one block per rank."""

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


def _whole(seed: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if dtype.kind == "V":  # bfloat16
        return rank_input(seed, 1000, shape, np.float32).astype(dtype)
    return rank_input(seed, 1000, shape, dtype)


@every_rank_settings(60)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 3), min_size=0, max_size=2).map(tuple),
    axis=st.integers(-3, 2),
    uneven=st.booleans(),
    none_elsewhere=st.booleans(),
    group_kind=st.sampled_from(GROUP_KINDS),
    root_pick=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_scatter_matches_numpy_split(module_ctx, dtype, shape, axis, uneven, none_elsewhere, group_kind,
                                     root_pick, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    n = len(members)
    axis = axis % (len(shape) + 1)
    counts = [(seed + 5 * k) % 3 for k in range(n)] if uneven else None
    length = sum(counts) if uneven else n * (seed % 3)
    full_shape = (*shape[:axis], length, *shape[axis:])
    whole = _whole(seed, full_shape, dtype)
    root = members[root_pick % n]
    mine = whole if ctx.rank == root else (None if none_elsewhere else np.zeros_like(whole))
    got = mt.scatter(mine, root, axis=axis, counts=counts, shape=full_shape, dtype=dtype, devices=members).resolve()
    blocks = counts or [length // n] * n
    edges = np.cumsum([0, *blocks])
    index = members.index(ctx.rank)
    expected = np.take(whole, np.arange(edges[index], edges[index + 1]), axis=axis)
    agree(isinstance(got, mt.Tensor) and same(got, expected),
          f"scatter {dtype} {full_shape} axis {axis} counts {counts} root {root} on {members}")


def test_scatter_rows_with_counts(module_ctx):
    ctx = module_ctx
    n = ctx.size
    counts = list(range(1, n + 1))
    whole = np.arange(sum(counts) * 2).reshape(-1, 2)
    got = mt.scatter(whole if ctx.rank == 0 else None, 0, counts=counts, shape=whole.shape, dtype=whole.dtype)
    start = sum(counts[: ctx.rank])
    assert got.resolve().numpy().tolist() == whole[start : start + counts[ctx.rank]].tolist()


def test_the_root_must_pass_a_tensor(module_ctx):
    with pytest.raises(TypeError, match="scatter: the root must pass the tensor to split, got None"):
        mt.scatter(None, module_ctx.rank, shape=(4,), dtype=np.float32, devices=[module_ctx.rank])


@pytest.mark.mpi(min_size=2)
def test_a_non_root_without_shape_and_dtype_is_told(ctx):
    root = (ctx.rank + 1) % ctx.size
    with pytest.raises(TypeError, match="a non-root rank passing input=None must give shape= and dtype="):
        mt.scatter(None, root)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"counts": [1]}, ValueError, "counts must give {n} non-negative lengths"),
        ({"counts": "ab"}, TypeError, "counts must be a sequence of ints"),
        ({"counts": [1.5]}, TypeError, "counts must be a sequence of ints"),
        ({"axis": 1}, ValueError, "axis 1 is out of range for a tensor of 1 dimension"),
    ],
    ids=["wrong-count", "string", "float", "axis"],
)
def test_bad_arguments_are_rejected_on_every_rank(module_ctx, kwargs, error, message):
    ctx = module_ctx
    whole = np.ones(ctx.size + 1)
    with pytest.raises(error, match=message.format(n=ctx.size)):
        mt.scatter(whole, 0, **kwargs)
    assert mt.all_reduce(np.ones(1)).resolve().item() == ctx.size


@pytest.mark.mpi(min_size=2)
def test_a_length_that_does_not_divide_is_rejected(module_ctx):
    ctx = module_ctx
    with pytest.raises(ValueError, match=f"does not split into {ctx.size} equal blocks; pass counts="):
        mt.scatter(np.ones(ctx.size + 1), 0)
    with pytest.raises(ValueError, match="got a 0-d one"):
        mt.scatter(np.array(1.0), 0)


def _blocks_of(whole: np.ndarray, counts: list[int], rank: int, axis: int = 0) -> np.ndarray:
    """Rank `rank`'s block of `whole` split along `axis` by `counts` (the NumPy reference)."""
    return np.split(whole, np.cumsum(counts)[:-1], axis=axis)[rank]


def test_counts_give_a_non_root_the_length_of_a_1d_tensor(module_ctx):
    ctx = module_ctx
    counts = [(k % 3) + 1 for k in range(ctx.size)]
    whole = rank_input(21, 1000, (sum(counts),), np.float32)
    mine = whole if ctx.rank == 0 else None
    got = mt.scatter(mine, 0, counts=counts, dtype=np.float32).resolve()
    assert isinstance(got, mt.Tensor) and same(got, _blocks_of(whole, counts, ctx.rank))


@pytest.mark.parametrize(("axis", "trailing"), [(0, (None, 3)), (1, (2, None)), (-1, (2, None))],
                         ids=["first", "second", "negative"])
def test_counts_stand_for_the_split_length_of_a_shape(module_ctx, axis, trailing):
    ctx = module_ctx
    counts = [k + 1 for k in range(ctx.size)]
    full = tuple(sum(counts) if d is None else d for d in trailing)
    whole = rank_input(22, 1000, full, np.int32)
    mine = whole if ctx.rank == ctx.size - 1 else None
    got = mt.scatter(mine, ctx.size - 1, axis=axis, counts=counts, shape=trailing, dtype="int32").resolve()
    assert same(got, _blocks_of(whole, counts, ctx.rank, axis))


def test_a_torch_dtype_describes_the_root_tensor(module_ctx):
    torch = pytest.importorskip("torch")
    ctx = module_ctx
    whole = np.arange(2 * ctx.size, dtype=np.float32)
    got = mt.scatter(whole if ctx.rank == 0 else None, 0, counts=[2] * ctx.size, dtype=torch.float32).resolve()
    assert same(got, whole[2 * ctx.rank : 2 * ctx.rank + 2])


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dtype": np.float32, "shape": (None, 3)}, TypeError,
         r"shape \(None, 3\) leaves the length along axis 0 to counts=, which was not given"),
        ({"dtype": np.float32, "shape": (2, None), "counts": "each"}, ValueError,
         r"shape may give None only as the length along axis 0 \(the sum of counts\), got \(2, None\)"),
        ({"dtype": np.float32, "shape": (None, None), "counts": "each"}, ValueError,
         "shape may give None only as the length along axis 0"),
        ({"dtype": np.float32, "shape": "ab", "counts": "each"}, TypeError,
         "shape must be a tuple of ints .None for the length along axis., got 'ab'"),
        ({"counts": "each"}, TypeError, "must give shape= and dtype= of the root's whole tensor .with counts="),
        ({"dtype": np.float32}, TypeError, "must give shape= and dtype= of the root's whole tensor"),
    ],
    ids=["none-without-counts", "none-elsewhere", "two-nones", "bad-shape", "no-dtype", "no-shape-no-counts"],
)
@pytest.mark.mpi(min_size=2)
def test_a_non_root_describing_badly_is_told_and_the_root_learns_of_it(module_ctx, kwargs, error, message):
    ctx = module_ctx
    kwargs = dict(kwargs)
    if kwargs.get("counts") == "each":
        kwargs["counts"] = [1] * ctx.size
    whole = np.ones((ctx.size, 3), np.float32)
    if ctx.rank == 0:
        with pytest.raises(mt.CollectiveMismatchError, match=r"scatter failed on that rank: " + error.__name__):
            mt.scatter(whole, 0, counts=kwargs.get("counts")).resolve()
    else:
        with pytest.raises(error, match=message):
            mt.scatter(None, 0, **kwargs)
    assert mt.all_reduce(np.ones(1)).resolve().item() == ctx.size


@pytest.mark.mpi(min_size=2)
def test_a_trailing_shape_the_counts_complete_wrongly_is_a_mismatch(module_ctx):
    ctx = module_ctx
    counts = [1] * ctx.size
    mine = np.ones((ctx.size, 3), np.float32) if ctx.rank == 0 else None  # elsewhere 1-D from counts alone
    with pytest.raises(mt.CollectiveMismatchError,
                       match=rf"Mismatched scatter tensor shapes: .*\({ctx.size}, 3\).*\({ctx.size},\)"):
        mt.scatter(mine, 0, counts=counts, dtype=np.float32).resolve()
    assert mt.all_reduce(np.ones(1)).resolve().item() == ctx.size


@pytest.mark.mpi(min_size=2)
def test_a_shape_too_large_to_allocate_is_named_and_the_root_learns_of_it(module_ctx):
    """A non-root's shape= whose block no process can hold (256 TiB): a MemoryError naming the shape and
    what shape= must be, not NumPy's bare one; the root gets that message, and the next collective works."""
    ctx = module_ctx
    length = ctx.size << 45  # each rank's block: 2**45 float64, 256 TiB, beyond a process's address space
    if ctx.rank == 0:
        with pytest.raises(mt.CollectiveMismatchError) as caught:
            mt.scatter(np.ones(ctx.size), 0).resolve()
        assert "scatter failed on that rank: MemoryError: scatter: cannot allocate this rank's block of 256.0 TiB" \
            in str(caught.value), str(caught.value)
    else:
        with pytest.raises(MemoryError) as caught:
            mt.scatter(None, 0, shape=(length,), dtype=np.float64)
        assert str(caught.value) == (
            f"scatter: cannot allocate this rank's block of 256.0 TiB ({1 << 45} of the {length} slices along "
            f"axis 0 of a float64 tensor of shape ({length},), from the shape= this rank passed). A non-root "
            "rank's shape= must be the root's whole shape (what the root splits), not a size to reserve; check "
            "it, or split the tensor over more ranks or with counts="
        )
    assert mt.all_reduce(np.ones(1)).resolve().item() == ctx.size
