"""JAX primitives for mpitensor's collectives: abstract evaluation and lowering.

Every collective is one primitive with static parameters. Its abstract evaluation gives the
result's shape and dtype and the ordered `COLLECTIVE` effect; its lowering (CPU) is a custom
call to the handler's target, carrying the ordered effect's token in and out and the number
of its call site (see `_handler`). ``adjoint=True`` marks the identity that a transposed
sum all-reduce is (no communication, no effect).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax._src.core import abstract_token
from jax.extend.core import Primitive
from jax.interpreters import mlir, xla

from . import _handler, _runners
from ._effect import COLLECTIVE

Shape = Callable[..., tuple[int, ...]]


def make(kind: str, shape: Shape) -> Primitive:
    """A primitive for the collective `kind`, whose result shape `shape(in_shape, **params)` gives.

    The result has the input's dtype, or ``params["recv_dtype"]`` where the call names one.
    """
    primitive = Primitive(f"mpitensor_{kind}")
    primitive.def_impl(functools.partial(xla.apply_primitive, primitive))

    def abstract(x: Any, **params: Any) -> tuple[Any, set[Any]]:
        dtype = np.dtype(params.get("recv_dtype", x.dtype))
        result = jax.core.ShapedArray(shape(x.shape, **params), _result_dtype(kind, dtype, params))
        return result, set() if params.get("adjoint") else {COLLECTIVE}

    primitive.def_effectful_abstract_eval(abstract)
    mlir.register_lowering(primitive, functools.partial(_lower, kind), platform="cpu")
    return primitive


def _result_dtype(kind: str, dtype: np.dtype, params: dict[str, Any]) -> np.dtype:
    if params.get("op") == "mean" and not jax.numpy.issubdtype(dtype, jax.numpy.inexact):
        raise TypeError(f"mpitensor.jax.{kind} with op='mean' needs a floating or complex array, got {dtype}")
    return dtype


def _lower(kind: str, ctx: Any, x: Any, **params: Any) -> list[Any]:
    if params.get("adjoint"):
        return [x]
    (aval_in,) = ctx.avals_in
    (aval_out,) = ctx.avals_out
    key = (kind, aval_in.shape, str(aval_in.dtype), aval_out.shape, tuple(sorted(params.items())))
    number = _handler.site(key, _runners.make(kind, aval_in, aval_out, params))
    with_token = ctx.replace(avals_in=(*ctx.avals_in, abstract_token), avals_out=(*ctx.avals_out, abstract_token))
    lowering = jax.ffi.ffi_lowering(_handler.TARGET, has_side_effect=True)
    results = list(lowering(with_token, x, ctx.tokens_in.get(COLLECTIVE), site=np.int64(number)))
    ctx.set_tokens_out(mlir.TokenSet({COLLECTIVE: results.pop()}))
    return results
