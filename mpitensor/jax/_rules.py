"""Derivatives and batching of the collectives: JVP, transpose and vmap rules.

The rules, per collective (each rank differentiates its own program):

- ``all_reduce`` with ``sum``: the result is one value that every rank holds, so its
  derivative with respect to this rank's input is the identity: the transpose is the
  identity on the cotangent, and transposing that again gives the all-reduce back (as
  mpi4jax's, and as JAX's ``psum`` under ``shard_map``). ``mean`` is the same scaled by
  1/size. Other ops are not differentiable here (NotImplementedError).
- ``broadcast``: every rank's result is the root's input; the transpose is a sum reduce of
  the cotangents to the root (zeros on the other ranks).
- ``all_gather`` and ``reduce_scatter`` (sum) are each other's transpose; ``all_to_all`` is
  its own.
- ``reduce`` (sum): the root gets the sum, the others keep their input; the transpose is a
  broadcast of the root's cotangent, plus the rank's own cotangent off the root.
- ``sendrecv``: the cotangent of what came from `source` goes back to it (a sendrecv with
  source and dest swapped).

Every collective is linear in its input (for the ops above), so its JVP is the collective
of the tangent; the tangent of an integer or bool value (float0, no data) gives a float0
zero without a collective. vmap runs one collective on the whole batch: element-wise collectives keep
the batch axis where it is; those that cut or join along the first axis move it to axis 1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching

import mpitensor as mt

Transpose = Callable[..., Any]


def linear(primitive: Primitive, transpose: Transpose, *, ops: tuple[str, ...] | None = None) -> None:
    """Give `primitive` its JVP (itself on the tangent) and its transpose rule.

    Args:
        primitive: the collective's primitive.
        transpose: ``transpose(cotangent, input_shape, **params)``, the cotangent of the input.
        ops: the ``op`` values it is differentiable for (None: it has no op).
    """

    def jvp(primals: Any, tangents: Any, **params: Any) -> tuple[Any, Any]:
        _differentiable(primitive, params, ops)
        (x,), (t,) = primals, tangents
        result = primitive.bind(x, **params)
        if _holds_no_data(t):  # an integer or bool input's: every rank's result's is zero too
            return result, ad.Zero(jax.core.ShapedArray(result.shape, jax.dtypes.float0))
        return result, primitive.bind(ad.instantiate_zeros(t), **params)

    def transposed(cotangent: Any, x: Any, **params: Any) -> tuple[Any]:
        _differentiable(primitive, params, ops)
        return (transpose(ad.instantiate_zeros(cotangent), x.aval.shape, **params),)

    ad.primitive_jvps[primitive] = jvp
    ad.primitive_transposes[primitive] = transposed


def _holds_no_data(tangent: Any) -> bool:
    """True for a float0 tangent (of an integer or bool value): nothing to communicate."""
    aval = tangent.aval if isinstance(tangent, ad.Zero) else tangent
    return aval.dtype == jax.dtypes.float0


def _differentiable(primitive: Primitive, params: dict[str, Any], ops: tuple[str, ...] | None) -> None:
    if ops is not None and params["op"] not in ops:
        raise NotImplementedError(
            f"{primitive.name} with op={params['op']!r} has no derivative here; "
            f"differentiate with op in {ops} (or compute the derivative of this op yourself)"
        )


def elementwise_batching(primitive: Primitive) -> None:
    """Vmap of an element-wise collective: one call on the batch, the batch axis kept."""

    def rule(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
        return primitive.bind(args[0], **params), dims[0]

    batching.primitive_batchers[primitive] = rule


def first_axis_batching(primitive: Primitive) -> None:
    """Vmap of a collective that cuts or joins along axis 0: the batch moves to axis 1."""

    def rule(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
        x = args[0]
        if x.ndim == 1:  # a batch of 0-d inputs: each counts as one element along axis 0
            return primitive.bind(x[None, :], **params), 1
        return primitive.bind(jnp.moveaxis(x, dims[0], 1), **params), 1

    batching.primitive_batchers[primitive] = rule


def received_batching(primitive: Primitive) -> None:
    """Batching (vmap) of a point-to-point exchange: one message of the batch, its receive shape batched too."""

    def rule(args: Any, dims: Any, **params: Any) -> tuple[Any, Any]:
        x = jnp.moveaxis(args[0], dims[0], 0)
        params["recv_shape"] = (x.shape[0], *params["recv_shape"])
        return primitive.bind(x, **params), 0

    batching.primitive_batchers[primitive] = rule


def rank() -> int:
    """This rank's number in the open context."""
    return mt.current_context().rank


def size(devices: tuple[int, ...] | None) -> int:
    """The number of ranks in the group `devices` (None: the whole context)."""
    return len(devices) if devices is not None else mt.current_context().size
