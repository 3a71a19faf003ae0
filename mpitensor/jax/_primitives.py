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

from . import _dtypes, _handler, _runners
from ._effect import COLLECTIVE

Shape = Callable[..., tuple[int, ...]]


def make(kind: str, shape: Shape) -> Primitive:
    """A primitive for the collective `kind`, whose result shape `shape(in_shape, **params)` gives.

    The result has the input's dtype, or ``params["recv_dtype"]`` where the call names one;
    a dtype the collective cannot communicate raises `TypeError` as the call is traced
    (`_dtypes.checked`).
    """
    primitive = Primitive(f"mpitensor_{kind}")
    primitive.def_impl(functools.partial(xla.apply_primitive, primitive))

    def abstract(x: Any, **params: Any) -> tuple[Any, set[Any]]:
        # Checked here, while the call is traced inside its door: a dtype refused later (as
        # the program is lowered or run) would leave the peers' calls without this rank's turn.
        op = params.get("op")
        dtype = _dtypes.checked(kind, np.dtype(x.dtype), op)
        if "recv_dtype" in params:
            dtype = _dtypes.checked(kind, np.dtype(params["recv_dtype"]), op)
        result = jax.core.ShapedArray(shape(x.shape, **params), dtype)
        return result, set() if params.get("adjoint") else {COLLECTIVE}

    primitive.def_effectful_abstract_eval(abstract)
    mlir.register_lowering(primitive, functools.partial(_lower, kind), platform="cpu")
    return primitive


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
