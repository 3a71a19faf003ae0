"""Which dtypes mpitensor.jax's collectives take: decided while the call is traced, on the calling rank.

A collective takes the dtypes the eager collectives take (bool, the integer types of 8 to
64 bits, float16, bfloat16, float32, float64, complex64, complex128), and a reduction the
(op, dtype) pairs the eager reductions plan. Every other dtype is refused with a
`TypeError` while the call is traced, inside its door (`mt.collective_call`), so the peers'
compiled call fails with `CollectiveMismatchError` instead of waiting for this rank or
pairing with its next call. Refused (JAX has them, MPI and the consistency check do not):

- the packed types of fewer than 8 bits (int4, uint4, int2, uint2, float4_e2m1fn...): XLA
  packs their values several to a byte, so a buffer is not one byte per element, a block
  of an odd number of 4-bit values starts inside a byte, and a sum of packed bytes is not
  the packed sums;
- the float8 family: MPI has no float8 type and the consistency check could not tell one
  float8 format from another (or from a packed type): every one is a 1-byte opaque type;
- float0, the type of the tangent of an integer or bool value, which holds no data (a
  derivative of such a value is zero without a collective: see `_rules`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import integration

FLOAT0 = np.dtype(jax.dtypes.float0)


def checked(kind: str, dtype: np.dtype, op: str | None = None) -> np.dtype:
    """`dtype`, where collective `kind` (with `op`, for a reduction) can communicate arrays of it.

    Args:
        kind: the collective's name, for messages.
        dtype: the dtype of an array the call sends or receives.
        op: the reduction's name, or None for a collective that does not reduce.

    Returns:
        `dtype`.

    Raises:
        TypeError: the collective cannot communicate `dtype` (or reduce it with `op`).
    """
    if op == "mean" and not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(f"mpitensor.jax.{kind} with op='mean' needs a floating or complex array, got {dtype}")
    if dtype == FLOAT0:
        raise TypeError(
            f"mpitensor.jax.{kind} cannot communicate float0 arrays: float0 is JAX's type of the tangent of "
            "an integer or bool value, and holds no data; communicate the values themselves (their "
            "derivatives are zero without a collective)"
        )
    try:
        integration.check_dtype(dtype)
    except TypeError as exc:
        raise TypeError(_refusal(kind, dtype, exc)) from None
    if op is not None:
        try:
            integration.check_dtype(dtype, op)
        except TypeError as exc:
            raise TypeError(f"mpitensor.jax.{kind}: {exc}") from None
    return dtype


def _refusal(kind: str, dtype: np.dtype, eager: TypeError) -> str:
    bits = jax.dtypes.itemsize_bits(dtype)
    if bits < 8:
        wider = "bfloat16" if jnp.issubdtype(dtype, jnp.floating) else (
            "uint8" if jnp.issubdtype(dtype, jnp.unsignedinteger) else "int8")
        return (
            f"mpitensor.jax.{kind} cannot communicate {dtype} arrays: a {dtype} value has {bits} bits, and XLA "
            f"packs such values several to a byte, which MPI can neither move nor reduce value by value; "
            f"convert to a whole-byte type first (x.astype(jnp.{wider}), and back after: exact for every "
            f"{dtype} value)"
        )
    if jnp.issubdtype(dtype, jnp.floating):
        return (
            f"mpitensor.jax.{kind} cannot communicate {dtype} arrays: MPI has no {dtype} type, and the "
            f"ranks' calls could not be checked to agree on it; convert to bfloat16 first (x.astype("
            "jnp.bfloat16), and back after: exact for every 8-bit float), or move the bits as uint8 "
            "(jax.lax.bitcast_convert_type(x, jnp.uint8), and back after)"
        )
    return f"mpitensor.jax.{kind}: {eager}"
