"""A call that fails after it protected its input leaves the input writable, and says what was wrong.

A collective makes its input read-only while MPI reads it; a call refused after that (an
`out=` of the wrong shape, over the input itself, bad splits) must lift the protection, on
the rank that failed, or the input would stay read-only for good; and an `out=` over the
input is reported as overlapping it, not as "read-only" (which the input's own protection
made it). Every rank makes the same bad call here (each raises its own error), then the next
collective is checked against NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest

import mpitensor as mt
from tests.helpers import still_usable

pytestmark = pytest.mark.mpi(min_size=1)


def _calls(size: int) -> dict[str, tuple]:
    """Per collective: (a call of x with out=, the out of a wrong shape)."""
    return {
        "all_gather": (lambda x, out: mt.all_gather(x, out=out), np.empty(size * 4 + 1)),
        "all_to_all": (lambda x, out: mt.all_to_all(x, out=out), np.empty(3)),
        "all_to_all splits": (lambda x, out: mt.all_to_all(x, splits=[4] * size, out=out), np.empty((3, 2))),
        "reduce_scatter": (lambda x, out: mt.reduce_scatter(x, out=out), np.empty(7)),
        "all_reduce": (lambda x, out: mt.all_reduce(x, out=out), np.empty(5)),
    }


@pytest.mark.parametrize("kind", ["all_gather", "all_to_all", "all_to_all splits", "reduce_scatter", "all_reduce"])
@pytest.mark.parametrize("bad", ["wrong shape", "the input itself"])
def test_a_refused_out_leaves_the_input_writable(ctx, kind, bad):
    call, wrong = _calls(ctx.size)[kind]
    x = np.arange(4.0 * ctx.size)
    # Over the input: the input itself, or (reduce_scatter's result being one block) its first block.
    over = x[:4] if kind == "reduce_scatter" else x
    out = wrong if bad == "wrong shape" else over
    with pytest.raises(ValueError) as info:
        call(x, out).resolve()
    message = str(info.value)
    if bad == "the input itself":
        assert "overlaps the input" in message, message
    else:
        assert "out= has shape" in message, message
    assert x.flags.writeable, "the input must not stay read-only after a refused call"
    x[0] = -1.0  # and writes through it work
    still_usable(ctx)
