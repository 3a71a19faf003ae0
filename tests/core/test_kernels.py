"""The streaming sum of the shared-memory all-reduce: NumPy's bits, or a refusal that writes nothing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mpitensor._core.kernels import streaming_add

pytestmark = pytest.mark.skipif(
    streaming_add is None and os.environ.get("MPITENSOR_EXPECT_NATIVE") != "1",
    reason="built without a C compiler, or MPITENSOR_NATIVE=0",
)


def test_it_is_built_where_the_build_has_a_compiler():
    """Where `make` ran with a C compiler (MPITENSOR_EXPECT_NATIVE=1), the kernel is there."""
    assert streaming_add is not None or os.environ.get("MPITENSOR_NATIVE", "").strip() == "0"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [0, 1, 3, 5, 64, 1001, 1 << 18])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_sums_have_numpys_bits(dtype, count, offset):
    """out = a + b and its copy, bit for bit NumPy's, at every alignment of the destinations."""
    if streaming_add is None:
        pytest.skip("switched off")
    rng = np.random.default_rng([count, offset])
    a = rng.standard_normal(count + offset).astype(dtype)[offset:]
    b = rng.standard_normal(count + offset).astype(dtype)[offset:]
    a[: min(count, 3)] = [np.inf, -0.0, np.finfo(dtype).tiny / 3][: min(count, 3)]  # inf, signed zero, subnormal
    out = np.full(count + offset, 7, dtype)[offset:]
    copy = np.full(count + offset, 7, dtype)[offset:]
    assert streaming_add(a, b, out, copy) is True
    expected = a + b
    assert out.tobytes() == expected.tobytes() and copy.tobytes() == expected.tobytes()
    alone = np.empty_like(out)
    assert streaming_add(a, b, alone) is True and alone.tobytes() == expected.tobytes()


def test_what_it_does_not_take_is_left_alone():
    """Other dtypes, shapes, aliasing and destinations aligned apart: False, and nothing written."""
    if streaming_add is None:
        pytest.skip("switched off")
    ints = np.ones(8, np.int32)
    floats = np.ones(8, np.float32)
    out = np.zeros(8, np.float32)
    assert streaming_add(ints, ints, ints.copy()) is False
    assert streaming_add(floats, floats, np.zeros(9, np.float32)) is False
    assert streaming_add(floats.reshape(2, 4), floats.reshape(2, 4), out.reshape(2, 4)) is False
    assert streaming_add(floats, floats, floats) is False, "in place: NumPy's"
    assert streaming_add(floats, floats, np.zeros(8, np.float64)) is False
    apart = np.zeros(12, np.float32)[1:9]
    assert streaming_add(floats, floats, out, apart) is False and not out.any() and not apart.any()
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    assert streaming_add(floats, floats, frozen) is False
