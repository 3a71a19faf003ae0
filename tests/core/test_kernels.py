"""The compiled kernels (the streaming sum, MAX/MIN keys): NumPy's bits, or a refusal that writes nothing."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mpitensor._core import dtypes
from mpitensor._core.kernels import keys as compiled_keys
from mpitensor._core.kernels import streaming_add

pytestmark = pytest.mark.skipif(
    streaming_add is None and os.environ.get("MPITENSOR_EXPECT_NATIVE") != "1",
    reason="built without a C compiler, or MPITENSOR_NATIVE=0",
)


def test_it_is_built_where_the_build_has_a_compiler():
    """Where `make` ran with a C compiler (MPITENSOR_EXPECT_NATIVE=1), the kernels are there."""
    switched_off = os.environ.get("MPITENSOR_NATIVE", "").strip() == "0"
    assert streaming_add is not None or switched_off
    assert compiled_keys is not None or switched_off


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


# -- MAX/MIN keys of floats ---------------------------------------------------------------

_WORDS = {np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}


def _floats_of_every_kind(dtype: np.dtype, count: int, seed: int) -> np.ndarray:
    """Random bit patterns (NaNs with any payload and sign, subnormals, ...), then the specials."""
    word = _WORDS[dtype]
    bits = np.random.default_rng(seed).integers(0, np.iinfo(word).max, count, dtype=word, endpoint=True)
    tiny = np.finfo(dtype).tiny / 4
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, tiny, -tiny, 1.0, -1.0], dtype)
    return np.concatenate([bits.view(dtype), specials, specials[::-1]])


@pytest.mark.skipif(compiled_keys is None, reason="built without a C compiler, or MPITENSOR_NATIVE=0")
@pytest.mark.parametrize("maximum", [True, False], ids=["max", "min"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), np.dtype(np.float64)], ids=str)
def test_compiled_keys_have_numpys_bits(dtype, maximum, monkeypatch):
    """Encoding, decoding and combining in one compiled pass give the bits of OrderedKeys' and
    Extremum's NumPy code, for every kind of float (in place too)."""
    x = _floats_of_every_kind(dtype, 4000, 1)
    y = _floats_of_every_kind(dtype, 4000, 2)[::-1].copy()
    word = _WORDS[dtype]
    keys, combine = dtypes.OrderedKeys(dtype, maximum), dtypes.Extremum(dtype, maximum)
    compiled_encoded, compiled_combined = np.empty_like(x), np.empty_like(x)
    keys.encode(x, compiled_encoded)
    combine(x, y, compiled_combined)
    decoded = compiled_encoded.copy()
    keys.decode(decoded)
    monkeypatch.setattr(dtypes, "_compiled_keys", None)
    numpy_encoded, numpy_combined = np.empty_like(x), np.empty_like(x)
    keys.encode(x, numpy_encoded)
    numpy_decoded = numpy_encoded.copy()
    keys.decode(numpy_decoded)
    combine.compiled = None
    combine(x, y, numpy_combined)
    assert np.array_equal(compiled_encoded.view(word), numpy_encoded.view(word))
    assert np.array_equal(decoded.view(word), numpy_decoded.view(word))
    assert np.array_equal(compiled_combined.view(word), numpy_combined.view(word))
    in_place = x.copy()
    assert compiled_keys.extremum(in_place, y, in_place, maximum) is True
    assert np.array_equal(in_place.view(word), numpy_combined.view(word))


@pytest.mark.skipif(compiled_keys is None, reason="built without a C compiler, or MPITENSOR_NATIVE=0")
def test_compiled_keys_refuse_what_they_do_not_take():
    """Other dtypes, mixed dtypes or sizes, strided or read-only outputs: False, and nothing written."""
    x = np.ones(8, np.float32)
    out = np.full(8, 7, np.float32)
    for source, target in ((np.ones(8, np.float16), np.empty(8, np.float16)), (x, np.empty(8, np.float64)),
                           (x, np.empty(7, np.float32)), (x, np.empty(16, np.float32)[::2]),
                           (x.astype(">f4"), out)):
        assert compiled_keys.encode(source, target, True) is False
    read_only = out.copy()
    read_only.flags.writeable = False
    assert compiled_keys.decode(read_only) is False
    assert compiled_keys.extremum(x, np.ones(8), out, True) is False
    assert np.array_equal(out, np.full(8, 7, np.float32))
