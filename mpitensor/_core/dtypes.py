"""Lookup tables from NumPy dtypes and `ReduceOperation` to MPI datatypes and ops.

A reduction is planned once per (op, dtype) pair and cached: which MPI op, which MPI
datatype, whether the input is first converted (``MEAN`` of integers reduces in float64)
and whether the result is divided by the group size afterwards.

MAX and MIN of floating-point numbers follow NumPy (``np.maximum``/``np.minimum``: a NaN on
any rank gives NaN), with results that are the same bits on every rank and on every path.
MPI's own MAX and MIN of floats do neither: implementations compute ``a > b ? a : b``,
which drops a NaN or keeps it depending on the operand order, and that order differs
between ranks (MPICH gave one rank ``[1, nan]`` and the other ``[nan, 1]``). So MPI
reduces integer keys instead (`OrderedKeys`): the IEEE bit pattern read as a signed
integer, with the magnitude bits of negative numbers flipped, orders exactly like the
floats, with -0.0 below +0.0. NaNs are first replaced by one canonical NaN whose key is
above every other key for MAX (a positive quiet NaN) and below every other for MIN (a
negative quiet NaN). Integer MAX/MIN is exact and commutative, so every rank gets the same
bits. Half precision needs no widening for this: the result is one of the inputs.

Where NumPy does the reducing (the shared-memory path, user-defined ops), `ReducePlan.combine`
gives the same bits directly on the floats: NumPy's extremum, with equal values' bits
combined so that the order does not matter (+0.0 wins MAX, -0.0 wins MIN) and NaN made the
canonical one. Complex MAX/MIN (NumPy's lexicographic order) and 16-byte long double have
no integer keys and use that combine as a user-defined MPI op (`CanonicalNan` makes the NaNs
of their inputs canonical, for groups of one rank, where MPI applies no op).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import mpi_arithmetic
from .config import ReduceOperation
from .kernels import keys as _compiled_keys
from .mpi import MPI, on_finalize

__all__ = [
    "BoolBytes",
    "CanonicalNan",
    "Extremum",
    "OrderedKeys",
    "ReducePlan",
    "mpi_datatype",
    "reduce_plan",
    "supported_dtype_names",
    "transfer_dtype",
]

# The MPI datatype of each dtype MPI carries as it is, by name: looked up in mpi4py.MPI at
# the first use, so that importing mpitensor does not import it.
_NATIVE_NAMES: dict[np.dtype, str] = {
    np.dtype(np.bool_): "C_BOOL",
    np.dtype(np.int8): "INT8_T",
    np.dtype(np.int16): "INT16_T",
    np.dtype(np.int32): "INT32_T",
    np.dtype(np.int64): "INT64_T",
    np.dtype(np.uint8): "UINT8_T",
    np.dtype(np.uint16): "UINT16_T",
    np.dtype(np.uint32): "UINT32_T",
    np.dtype(np.uint64): "UINT64_T",
    np.dtype(np.float32): "FLOAT",
    np.dtype(np.float64): "DOUBLE",
    np.dtype(np.longdouble): "LONG_DOUBLE",
    np.dtype(np.complex64): "C_FLOAT_COMPLEX",
    np.dtype(np.complex128): "C_DOUBLE_COMPLEX",
}
# float16 has no name in MPI 3; implementations that know it expose it under several names.
# It travels either way: as 2-byte words where MPI has no float16 (it is reduced in float32).
_FLOAT16_NAMES = ("FLOAT16_T", "C_FLOAT16", "SHORT_FLOAT", "REAL2")
_CARRIED = frozenset((*_NATIVE_NAMES, np.dtype(np.float16)))


class _Tables:
    """The MPI datatypes and ops of dtypes and reductions, made at their first use."""

    def __init__(self) -> None:
        self._native: dict[np.dtype, Any] | None = None
        self._ops: tuple[dict[ReduceOperation, Any], dict[ReduceOperation, Any]] | None = None

    @property
    def native(self) -> dict[np.dtype, Any]:
        """Dtype -> MPI datatype, for the dtypes MPI knows."""
        if self._native is None:
            native = {dtype: getattr(MPI, name) for dtype, name in _NATIVE_NAMES.items()}
            for name in _FLOAT16_NAMES:
                found = getattr(MPI, name, MPI.DATATYPE_NULL)
                if found != MPI.DATATYPE_NULL:
                    native[np.dtype(np.float16)] = found
                    break
            else:
                native[np.dtype(np.float16)] = MPI.UINT16_T
            self._native = native
        return self._native

    @property
    def arithmetic(self) -> dict[ReduceOperation, Any]:
        """ReduceOperation -> MPI op, for numbers."""
        return self._op_tables()[0]

    @property
    def logical(self) -> dict[ReduceOperation, Any]:
        """ReduceOperation -> MPI op, for bool (NumPy's rules: + is or, * is and, ...)."""
        return self._op_tables()[1]

    def _op_tables(self) -> tuple[dict[ReduceOperation, Any], dict[ReduceOperation, Any]]:
        if self._ops is None:
            arithmetic = {
                ReduceOperation.SUM: MPI.SUM, ReduceOperation.MEAN: MPI.SUM, ReduceOperation.PROD: MPI.PROD,
                ReduceOperation.MAX: MPI.MAX, ReduceOperation.MIN: MPI.MIN, ReduceOperation.BAND: MPI.BAND,
                ReduceOperation.BOR: MPI.BOR, ReduceOperation.BXOR: MPI.BXOR,
            }
            # MPI's bitwise ops are defined on integers only, so bool's bitwise ops are the logical ones.
            logical = {
                ReduceOperation.SUM: MPI.LOR, ReduceOperation.PROD: MPI.LAND, ReduceOperation.MAX: MPI.LOR,
                ReduceOperation.MIN: MPI.LAND, ReduceOperation.BAND: MPI.LAND, ReduceOperation.BOR: MPI.LOR,
                ReduceOperation.BXOR: MPI.LXOR,
            }
            self._ops = (arithmetic, logical)
        return self._ops


_tables = _Tables()
_BITWISE = (ReduceOperation.BAND, ReduceOperation.BOR, ReduceOperation.BXOR)


@dataclass(frozen=True)
class ReducePlan:
    """How to run one (op, dtype) reduction through MPI.

    Attributes:
        mpi_op: the MPI op.
        datatype: the MPI datatype of one element of the buffer sent.
        work_dtype: the dtype of the buffers MPI reduces (the input is converted to it
            when it differs from the input's dtype).
        divide: divide the result by the group size afterwards (``MEAN``).
        result_dtype: the dtype of the result (the work dtype, except for half precision,
            which is reduced in float32 and rounded back once at the end).
        combine: ``combine(a, b, out=...)``: the same reduction of two work arrays done by
            NumPy (a ufunc, or an `Extremum`), giving the bits MPI's op gives; `out` may be
            `a` or `b`. For MAX/MIN of floats it works on the floats themselves.
        codec: for MAX/MIN of floats and complex numbers, what buffers handed to MPI go
            through: ``codec.encode(source, out)`` before (into a private buffer of the
            work dtype, which may be `source`) and ``codec.decode(out)`` after, in place.
            An `OrderedKeys` for floats (MPI reduces integer keys), a `CanonicalNan` for
            complex numbers and 16-byte long doubles, a `BoolBytes` for bool (its bytes
            made 0 and 1). None for every other plan.
    """

    mpi_op: Any
    datatype: Any
    work_dtype: np.dtype
    divide: bool
    result_dtype: np.dtype | None = None
    combine: Any = None
    codec: OrderedKeys | CanonicalNan | BoolBytes | None = None
    # Derived once (plans are looked up on every call): the result tensor's dtype, and
    # whether the reduced work buffer is rounded back into it.
    out_dtype: np.dtype = field(init=False)
    rounds_back: bool = field(init=False)

    def __post_init__(self) -> None:
        out = self.work_dtype if self.result_dtype is None else self.result_dtype
        object.__setattr__(self, "out_dtype", out)
        object.__setattr__(self, "rounds_back", out != self.work_dtype)


def supported_dtype_names() -> str:
    """The dtypes collectives accept, as a comma-separated list for error messages."""
    return ", ".join(sorted(str(dt) for dt in _CARRIED))


def _native(dtype: np.dtype) -> np.dtype:
    return dtype if dtype.isnative else dtype.newbyteorder("=")


def transfer_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a buffer of `dtype` travels as (native byte order).

    Raises:
        TypeError: MPI cannot carry `dtype` (object, string, structured, ...).
    """
    native = _native(np.dtype(dtype))
    if native in _CARRIED:
        return native
    from .halfprec import is_bfloat16

    if is_bfloat16(native):
        return native
    raise TypeError(
        f"dtype {dtype} cannot be communicated: expected one of {supported_dtype_names()} "
        "or bfloat16 (from ml_dtypes)"
    )


def mpi_datatype(dtype: np.dtype) -> Any:
    """The MPI datatype of one element of `dtype` (bytes for types MPI does not know).

    Raises:
        TypeError: `dtype` cannot be communicated.
    """
    native = transfer_dtype(dtype)
    found = _tables.native.get(native)
    if found is not None:
        return found
    return _byte_type(native.itemsize)


@functools.cache
def _byte_type(itemsize: int) -> Any:
    if itemsize == 2:
        return MPI.UINT16_T
    datatype = MPI.BYTE.Create_contiguous(itemsize).Commit()
    on_finalize(datatype.Free)
    return datatype


_PLANS: dict[tuple[int, np.dtype], ReducePlan] = {}


def reduce_plan(op: ReduceOperation, dtype: np.dtype) -> ReducePlan:
    """Plan the reduction of `dtype` tensors with `op` (cached).

    Raises:
        TypeError: `dtype` cannot be reduced (or `op` is bitwise and `dtype` is no integer
            or bool type).
    """
    # Keyed by the member's id: hashing an Enum member runs Python code, and this lookup
    # is on the path of every reducing collective.
    key = (id(op), dtype)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(op, dtype)
        # An integer sum planned before MPI could be probed is planned again once it can.
        if mpi_arithmetic.wrong_sums() is not None or op is not ReduceOperation.SUM or plan.work_dtype.kind not in "iu":
            _PLANS[key] = plan
    return plan


def _sum_dtype(dtype: np.dtype) -> np.dtype:
    """The integer dtype MPI sums `dtype` in: `dtype`, or a wider one where MPI's own sum of it is wrong.

    A wrapping sum in a wider type of the same signedness, cast back, is the wrapping sum of
    `dtype` (see `mpi_arithmetic`).
    """
    wrong = mpi_arithmetic.probe() if MPI.Is_initialized() and not MPI.Is_finalized() else frozenset()
    work = dtype
    while work in wrong and work.itemsize < 8:
        work = np.dtype(f"={work.kind}{work.itemsize * 2}")
    return work


def _plan(op: ReduceOperation, dtype: np.dtype) -> ReducePlan:
    dtype = transfer_dtype(dtype)
    if op in _BITWISE and dtype.kind not in "biu":
        raise TypeError(
            f"{op.name} is a bitwise reduction, defined for integer and bool tensors only, got {dtype}; "
            "reduce a view of the bits (array.view(np.uint32), ...) or use SUM/MAX/MIN"
        )
    divide = op is ReduceOperation.MEAN
    extremum = op is ReduceOperation.MAX or op is ReduceOperation.MIN
    if dtype.kind in "biu":
        if divide:
            return ReducePlan(MPI.SUM, MPI.DOUBLE, np.dtype(np.float64), True, combine=np.add)
        if dtype.kind == "b":
            return ReducePlan(_tables.logical[op], _tables.native[dtype], dtype, False, combine=_LOGICAL_UFUNCS[op],
                              codec=_BOOL_BYTES)
        table, ufuncs = _tables.arithmetic, _UFUNCS
        work = _sum_dtype(dtype) if op is ReduceOperation.SUM and dtype.kind in "iu" else dtype
        if work != dtype:
            return ReducePlan(MPI.SUM, _tables.native[work], work, False, dtype, combine=np.add)
        return ReducePlan(table[op], _tables.native[dtype], dtype, False, combine=ufuncs[op])
    if extremum:
        maximum = op is ReduceOperation.MAX
        combine = Extremum(dtype, maximum)
        if dtype.kind == "c" or dtype.itemsize not in _FLOAT_LAYOUTS:
            # Complex (lexicographic, as NumPy orders it), and 16-byte long double: NumPy
            # reduces, through a user-defined op.
            codec: Any = CanonicalNan(combine.fill)
            native = _tables.native[dtype]
            return ReducePlan(_numpy_op(op, dtype), native, dtype, False, combine=combine, codec=codec)
        codec = OrderedKeys(dtype, maximum)
        keys = _tables.native[codec.int_dtype]
        return ReducePlan(_tables.arithmetic[op], keys, dtype, False, combine=combine, codec=codec)
    if dtype.itemsize == 2 and dtype.kind in "fV":
        # float16 and bfloat16: reduced in float32, rounded back once (see _halfprec).
        return ReducePlan(_tables.arithmetic[op], MPI.FLOAT, np.dtype(np.float32), divide, dtype, combine=_UFUNCS[op])
    return ReducePlan(_tables.arithmetic[op], _tables.native[dtype], dtype, divide, combine=_UFUNCS[op])


_UFUNCS = {
    ReduceOperation.SUM: np.add,
    ReduceOperation.MEAN: np.add,
    ReduceOperation.PROD: np.multiply,
    ReduceOperation.MAX: np.maximum,
    ReduceOperation.MIN: np.minimum,
    ReduceOperation.BAND: np.bitwise_and,
    ReduceOperation.BOR: np.bitwise_or,
    ReduceOperation.BXOR: np.bitwise_xor,
}
_LOGICAL_UFUNCS = {
    ReduceOperation.SUM: np.logical_or,
    ReduceOperation.PROD: np.logical_and,
    ReduceOperation.MAX: np.logical_or,
    ReduceOperation.MIN: np.logical_and,
    ReduceOperation.BAND: np.logical_and,
    ReduceOperation.BOR: np.logical_or,
    ReduceOperation.BXOR: np.logical_xor,
}

# IEEE binary formats by size: (mantissa bits, exponent bits). bfloat16 is told apart
# from float16 by its kind (ml_dtypes' types are kind "V"). A long double of 8 bytes is a
# double; one of 16 bytes (x87 extended, or quad) has no key here.
_FLOAT_LAYOUTS = {2: (10, 5), 4: (23, 8), 8: (52, 11)}
_BFLOAT16_LAYOUT = (7, 8)
# Up to this many bytes `Extremum` combines float32/float64 arrays in its compiled pass.
_COMPILED_EXTREMUM = 32 << 10
# From this many elements `OrderedKeys.encode` checks for NaNs before replacing them.
_LOOK_FOR_NAN = 1 << 16


class OrderedKeys:
    """The map between IEEE floats and signed integer keys that order like them.

    The key of bit pattern ``s`` (read as a signed integer) is ``s`` for a positive sign and
    ``s ^ 0x7f...f`` for a negative one: larger floats get larger keys, -0.0 gets -1 and
    +0.0 gets 0. The map is its own inverse. NaNs are given the key of one canonical NaN,
    above every other key for MAX (a positive quiet NaN) and below every other for MIN (a
    negative quiet NaN), so that the integer MAX/MIN of the keys is NumPy's extremum, and
    the same bits whatever the order of the operands.

    Args:
        dtype: the float dtype (float16, bfloat16, float32, float64 or an 8-byte long double).
        maximum: True for MAX, False for MIN.
    """

    __slots__ = ("_constants", "dtype", "int_dtype", "mask", "maximum", "nan_bits", "nan_key", "shift")

    def __init__(self, dtype: np.dtype, maximum: bool) -> None:
        self.dtype = dtype
        self.maximum = maximum
        size = dtype.itemsize
        mantissa, exponent = _BFLOAT16_LAYOUT if dtype.kind == "V" else _FLOAT_LAYOUTS[size]
        int_dtype = self.int_dtype = np.dtype(f"=i{size}")
        bits = 8 * size
        mask = (1 << (bits - 1)) - 1
        quiet = (((1 << exponent) - 1) << mantissa) | (1 << (mantissa - 1))
        # Signed values of the canonical NaN's bits, and of its key.
        nan_bits = quiet if maximum else quiet - (1 << (bits - 1))
        self.shift = int_dtype.type(bits - 1)
        self.mask = int_dtype.type(mask)
        self.nan_bits = int_dtype.type(nan_bits)
        self.nan_key = int_dtype.type(nan_bits if nan_bits >= 0 else nan_bits ^ mask)
        # NumPy takes 0-d arrays in a ufunc call faster than scalars (about half the cost, at
        # the sizes where the call is the cost); CuPy takes only the scalars.
        self._constants = tuple(np.array(c, int_dtype) for c in (self.shift, self.mask, self.nan_key))

    def encode(self, source: Any, out: Any, xp: Any = np) -> None:
        """Write the keys of the floats `source` into `out`, which keeps the float dtype.

        Args:
            source: a C-contiguous array of the float dtype.
            out: a C-contiguous array of the same shape and dtype; it may be `source`.
            xp: the array module (NumPy, or CuPy for device arrays).
        """
        if xp is np and _compiled_keys is not None and _compiled_keys.encode(source, out, self.maximum):
            return
        shift, mask, nan_key = self._constants if xp is np else (self.shift, self.mask, self.nan_key)
        in_place = out is source
        if source.ndim == 0:  # a 0-d operand would make the temporaries scalars
            source, out = source.reshape(1), out.reshape(1)
        int_dtype = self.int_dtype
        bits = source.view(int_dtype)
        keys = out.view(int_dtype)
        nan = xp.isnan(source)
        # keys = bits ^ ((bits >> (n - 1)) & mask); in place needs a temporary.
        sign = xp.right_shift(bits, shift) if in_place else xp.right_shift(bits, shift, out=keys)
        xp.bitwise_and(sign, mask, out=sign)
        xp.bitwise_xor(sign, bits, out=keys)
        # Large NumPy inputs are usually free of NaN, and looking costs a fifth of writing.
        if xp is not np or nan.size < _LOOK_FOR_NAN or nan.any():
            xp.copyto(keys, nan_key, where=nan)

    def decode(self, array: Any, xp: Any = np) -> None:
        """Turn the keys in `array` (of the float dtype, C-contiguous) back into floats, in place."""
        if xp is np and _compiled_keys is not None and _compiled_keys.decode(array):
            return
        shift, mask, _ = self._constants if xp is np else (self.shift, self.mask, None)
        keys = array.view(self.int_dtype) if array.ndim else array.reshape(1).view(self.int_dtype)
        sign = xp.right_shift(keys, shift)
        xp.bitwise_and(sign, mask, out=sign)
        xp.bitwise_xor(keys, sign, out=keys)


class BoolBytes:
    """The codec of bool reductions: every byte made 0 or 1 before MPI reduces it.

    A bool array may hold other bytes (a ``.view(bool)`` of uint8 data), which NumPy reads as
    True. MPI's logical ops may combine the bytes themselves (Open MPI's gave 2 | 1 = 3, and
    2 for True XOR True), so MPI gets the canonical bytes. Nothing to decode.
    """

    __slots__ = ()

    def encode(self, source: Any, out: Any, xp: Any = np) -> None:
        """Write `source`'s truth values into `out` (bool; it may be `source`), as bytes 0 and 1."""
        xp.not_equal(source.view(xp.uint8), 0, out=out)

    def decode(self, array: Any, xp: Any = np) -> None:
        """Nothing: the result is already bool."""


_BOOL_BYTES = BoolBytes()


class CanonicalNan:
    """The codec of MAX/MIN of complex numbers and 16-byte long doubles: NaNs made canonical.

    MPI reduces these with `Extremum`, which already gives the canonical NaN; encoding the
    input does the same for a group of one rank, where MPI only copies. Nothing to decode.

    Args:
        fill: the canonical NaN, a 0-d array of the dtype (`Extremum.fill`).
    """

    __slots__ = ("fill",)

    def __init__(self, fill: np.ndarray) -> None:
        self.fill = fill

    def encode(self, source: Any, out: Any, xp: Any = np) -> None:
        """Copy `source` into `out` (which may be `source`), every NaN the canonical one."""
        if out is not source:
            xp.copyto(out, source)
        nan = xp.isnan(out)
        if nan.any():
            xp.copyto(out, xp.asarray(self.fill), where=nan)

    def decode(self, array: Any, xp: Any = np) -> None:
        """Nothing: the result is already made of floats."""


class Extremum:
    """NumPy's MAX or MIN of two arrays, with the bits independent of the operand order.

    ``np.maximum`` propagates NaN but returns either operand's bits when they compare
    equal (-0.0 and +0.0; complex numbers with signed zeros) and either NaN when both are.
    Here equal operands combine their bits (AND for MAX, so +0.0 wins; OR for MIN, so -0.0
    wins) and a NaN result is the canonical NaN of `OrderedKeys` (for complex, in both
    parts). That is commutative and associative bit for bit, and for floats it gives the
    same bits as reducing `OrderedKeys`.

    Args:
        dtype: a float, complex or long double dtype (bfloat16 included).
        maximum: True for MAX, False for MIN.
    """

    __slots__ = (
        "compiled", "compiled_limit", "dtype", "fill", "maximum", "merge", "sign_fix", "ufunc", "word", "words",
    )

    def __init__(self, dtype: np.dtype, maximum: bool) -> None:
        self.dtype = dtype
        self.maximum = maximum
        # Small float32 and float64 arrays combine in one compiled pass; from `_COMPILED_EXTREMUM`
        # bytes NumPy's vector loops (AVX-512 where the CPU has it) are faster, in three passes.
        self.compiled = _compiled_keys if dtype in (np.dtype(np.float32), np.dtype(np.float64)) else None
        self.compiled_limit = _COMPILED_EXTREMUM // dtype.itemsize
        self.ufunc = np.maximum if maximum else np.minimum
        self.merge = np.bitwise_and if maximum else np.bitwise_or
        size = dtype.itemsize
        self.word = np.dtype(f"=u{min(size, 8)}")
        self.words = max(1, size // 8)
        # Real floats of one word: for MAX the result is negative exactly when both operands
        # are, for MIN when either is, so the sign bit is fixed by ANDing the result with
        # (a & b) | magnitude bits (MAX), or ORing it with (a | b) & sign bit (MIN). Elsewhere
        # (complex, 16-byte long double) equal operands' merged bits are written where
        # they tie.
        self.sign_fix: tuple[Any, np.ndarray] | None = None
        if dtype.kind in "fV" and size in _FLOAT_LAYOUTS:
            sign = 1 << (8 * size - 1)
            self.sign_fix = (np.bitwise_or, np.array(sign - 1, self.word)) if maximum else \
                (np.bitwise_and, np.array(sign, self.word))
        # The canonical NaN, bit for bit (its padding, for long double, zero).
        part = np.dtype(f"=f{size // 2}") if dtype.kind == "c" else dtype
        fill = np.zeros(1, dtype)
        if part.itemsize in _FLOAT_LAYOUTS:
            fill.view(f"=i{part.itemsize}")[:] = OrderedKeys(part, maximum).nan_bits  # complex: both parts
        else:
            fill[0] = np.nan if maximum else -np.nan
        self.fill = fill.reshape(())

    def __call__(self, a: Any, b: Any, out: Any) -> Any:
        """``out = max(a, b)`` (or min), elementwise, for 1-d arrays of the dtype."""
        compiled = self.compiled
        if compiled is not None and a.size <= self.compiled_limit and compiled.extremum(a, b, out, self.maximum):
            return out
        word = self.word
        # What fixes ties is taken before `out` (maybe `a` or `b`) changes. Most data has
        # no ties, and then it costs one comparison.
        tie = np.equal(a, b)
        merged = self.merge(a.view(word), b.view(word)) if tie.any() else None
        if merged is not None and self.sign_fix is not None:
            apply, bits = self.sign_fix
            apply(merged, bits, out=merged)
        if self.dtype.kind == "V":
            # ml_dtypes' bfloat16 loops flag NaN operands as invalid; NaN is expected here.
            with np.errstate(invalid="ignore"):
                self.ufunc(a, b, out=out)
        else:
            self.ufunc(a, b, out=out)
        if merged is not None:
            target = out.view(word)
            if self.sign_fix is not None:
                self.merge(target, merged, out=target)
            elif self.words == 1:
                np.copyto(target, merged, where=tie)
            else:
                words = self.words
                np.copyto(target.reshape(-1, words), merged.reshape(-1, words), where=tie[:, None])
        if out.size and self._has_nan(out):
            np.copyto(out, self.fill, where=np.isnan(out))
        return out

    def _has_nan(self, array: Any) -> bool:
        if self.dtype.kind == "f":
            # NumPy's max propagates NaN: one pass that writes nothing.
            return bool(np.isnan(np.max(array)))
        with np.errstate(invalid="ignore"):
            return bool(np.isnan(array).any())


@functools.cache
def _numpy_op(op: ReduceOperation, dtype: np.dtype) -> Any:
    """A user-defined MPI op reducing `dtype` buffers with NumPy (`Extremum` for MAX and MIN).

    Used where MPI defines no op (MAX and MIN of complex numbers, which NumPy orders
    lexicographically) and for dtypes MPI does not know. MPI calls it with the GIL taken.
    The op is declared commutative: MPI may apply it in any order, and `Extremum` gives
    the same bits whatever the order.
    """
    if op is ReduceOperation.MAX or op is ReduceOperation.MIN:
        combine: Any = Extremum(dtype, op is ReduceOperation.MAX)
    else:
        combine = _UFUNCS[op]

    def apply(inbuf: Any, inoutbuf: Any, _datatype: Any) -> None:
        a = np.frombuffer(inbuf, dtype=dtype)
        b = np.frombuffer(inoutbuf, dtype=dtype)
        combine(a, b, out=b)

    mpi_op = MPI.Op.Create(apply, commute=True)
    on_finalize(mpi_op.Free)
    return mpi_op


numpy_op = _numpy_op
