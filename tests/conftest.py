"""Fixtures shared by the tests: contexts, and the MPI size and rank."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import mpitensor as mt


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "subprocess: launches its own child mpiexec job")


@pytest.fixture
def ctx() -> Iterator[mt.DistributedContext]:
    """A fresh context over every rank, closed after the test."""
    context = mt.DistributedContext.init()
    yield context
    if not context.closed and not context.broken:
        context.close()


@pytest.fixture(scope="module")
def module_ctx() -> Iterator[mt.DistributedContext]:
    """One context for a whole module of quick tests."""
    context = mt.DistributedContext.init()
    yield context
    if not context.closed and not context.broken:
        context.close()


def group_members(kind: str, size: int, rank: int) -> list[int] | None:
    """The members of a test group this rank belongs to, or None when it has no such group.

    world: every rank; tail: every rank but 0; self: this rank alone; halves: evens or odds.
    """
    if kind == "world":
        return list(range(size))
    if kind == "tail":
        return list(range(1, size)) if rank != 0 else None
    if kind == "self":
        return [rank]
    if kind == "halves":
        return [r for r in range(size) if r % 2 == rank % 2]
    raise ValueError(kind)


GROUP_KINDS = ["world", "tail", "self", "halves"]
