"""Python-object collectives: broadcast_object, all_gather_object, gather_object."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import mpitensor as mt
from tests.conftest import GROUP_KINDS, group_members
from tests.helpers import agree, every_rank_settings

pytestmark = pytest.mark.mpi(min_size=1)

OBJECTS = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)


def _object(seed: int, rank: int, pool: list[object]) -> object:
    """Rank `rank`'s object: one of the drawn ones (ranks differ, and so do sizes)."""
    return pool[(seed + rank) % len(pool)]


@every_rank_settings(50)
@given(
    kind=st.sampled_from(["broadcast_object", "all_gather_object", "gather_object"]),
    pool=st.lists(OBJECTS, min_size=1, max_size=4),
    group_kind=st.sampled_from(GROUP_KINDS),
    seed=st.integers(0, 2**31 - 1),
)
def test_objects_arrive_in_rank_order(module_ctx, kind, pool, group_kind, seed):
    ctx = module_ctx
    members = group_members(group_kind, ctx.size, ctx.rank)
    if members is None:
        agree(True, "outside")
        return
    objects = {r: _object(seed, r, pool) for r in members}
    root = members[seed % len(members)]
    if kind == "broadcast_object":
        got = mt.broadcast_object(objects[ctx.rank] if ctx.rank == root else None, root, devices=members).resolve()
        ok = got == objects[root]
    elif kind == "all_gather_object":
        got = mt.all_gather_object(objects[ctx.rank], devices=members).resolve()
        ok = got == [objects[r] for r in members]
    else:
        got = mt.gather_object(objects[ctx.rank], root, devices=members).resolve()
        ok = got == [objects[r] for r in members] if ctx.rank == root else got is None
    agree(ok, f"{kind} on {members}")


def test_the_result_is_a_copy_on_the_root_too(module_ctx):
    config = {"lr": 0.1, "layers": [1, 2]}
    got = mt.broadcast_object(config if module_ctx.rank == 0 else None).resolve()
    assert got == {"lr": 0.1, "layers": [1, 2]}
    assert got is not config


def test_arrays_and_large_objects(module_ctx):
    ctx = module_ctx
    big = np.arange(100_000 * (ctx.rank + 1))
    got = mt.all_gather_object({"rank": ctx.rank, "data": big}).resolve()
    assert [g["rank"] for g in got] == list(range(ctx.size))
    assert all(np.array_equal(g["data"], np.arange(100_000 * (r + 1))) for r, g in enumerate(got))


def test_check_off():
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        assert mt.all_gather_object(ctx.rank * "x").resolve() == [r * "x" for r in range(ctx.size)]
        assert mt.broadcast_object("hello" if ctx.rank == 0 else None).resolve() == "hello"


def test_an_unpicklable_object_raises_on_its_rank(module_ctx):
    with pytest.raises((TypeError, AttributeError), match="pickle"):
        mt.all_gather_object(lambda: None)
    assert mt.all_reduce(np.ones(1)).resolve().item() == module_ctx.size


def test_a_root_outside_the_group_raises_on_every_rank(module_ctx):
    with pytest.raises(ValueError, match="gather_object: root 99 is not in the group"):
        mt.gather_object(1, root=99).resolve()
    assert mt.all_reduce(np.ones(1)).resolve().item() == module_ctx.size


class _Fussy:
    """An object whose unpickling fails on every rank but the one that sent it."""

    def __init__(self, sender: int) -> None:
        self.sender = sender

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return _rebuild_fussy, (self.sender,)


def _rebuild_fussy(sender: int) -> _Fussy:
    here = mt.current_context().rank
    if here != sender:
        raise RuntimeError(f"made on rank {sender}, not rebuildable on rank {here}")
    return _Fussy(sender)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["broadcast_object", "all_gather_object", "gather_object"])
def test_an_object_that_fails_to_unpickle_is_an_mpitensor_error_on_the_receiving_rank(module_ctx, kind):
    ctx = module_ctx
    root = ctx.size - 1
    if kind == "broadcast_object":
        handle = mt.broadcast_object(_Fussy(ctx.rank) if ctx.rank == root else None, root)
        fails, sender = ctx.rank != root, root
    elif kind == "all_gather_object":
        handle = mt.all_gather_object(_Fussy(ctx.rank))
        fails, sender = True, 1 if ctx.rank == 0 else 0  # the first peer in rank order
    else:
        handle = mt.gather_object(_Fussy(ctx.rank), root)
        fails, sender = ctx.rank == root, 0
    if fails:
        with pytest.raises(mt.ObjectUnpicklingError) as info:
            handle.resolve()
        assert isinstance(info.value, mt.MpitensorError) and isinstance(info.value, TypeError)
        assert str(info.value) == (
            f"rank {sender}'s object cannot be unpickled on this rank: RuntimeError: made on rank {sender}, "
            f"not rebuildable on rank {ctx.rank}; objects must be of classes every rank can import and rebuild"
        )
        assert isinstance(info.value.__cause__, RuntimeError)
    else:
        got = handle.resolve()
        assert (got.sender if kind == "broadcast_object" else got) == (root if kind == "broadcast_object" else None)
    # The next collective pairs as it should: every rank's input, summed as NumPy sums them.
    inputs = [np.arange(4.0) * (r + 1) for r in range(ctx.size)]
    np.testing.assert_array_equal(mt.all_reduce(inputs[ctx.rank]).resolve().numpy(), np.sum(inputs, axis=0))
