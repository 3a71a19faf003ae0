"""``python -m mpitensor info``: every rank's row, and whether the compiled parts are on."""

from __future__ import annotations

import pytest

import mpitensor as mt
from mpitensor._collectives import native
from mpitensor._core.kernels import keys, streaming_add
from mpitensor._tools.info import collect, format_table

pytestmark = pytest.mark.mpi(min_size=1)


def test_the_table_has_a_row_per_rank_and_says_what_is_compiled():
    """One row per rank in rank order, and the compiled lane's streaming sum's and keys' state below it."""
    with mt.DistributedContext.init(config=mt.DistributedConfig(check=False)) as ctx:
        rows = collect(ctx)
        text = format_table(rows)
    assert [row["rank"] for row in rows] == list(range(ctx.size))
    assert f"{ctx.size} rank(s) on" in text
    assert f"compiled lane of small all-reduces: {native.status()}" in text, text
    assert ("streaming sum of large shared-memory all-reduces: " + ("on" if streaming_add else "off")) in text, text
    assert ("compiled MAX/MIN keys of float32 and float64: " + ("on" if keys else "off")) in text, text
