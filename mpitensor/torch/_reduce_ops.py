"""torch's ``ReduceOp`` as mpitensor's `ReduceOperation` (and a premultiplier)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import mpitensor as mt

__all__ = ["known_operation", "reduce_operation"]

# Keyed by the enum's integer value: comparing torch's enum objects costs a microsecond.
_KINDS = {
    kind.value: ours
    for kind, ours in (
        (dist.ReduceOp.SUM, mt.ReduceOperation.SUM),
        (dist.ReduceOp.AVG, mt.ReduceOperation.MEAN),
        (dist.ReduceOp.PRODUCT, mt.ReduceOperation.PROD),
        (dist.ReduceOp.MIN, mt.ReduceOperation.MIN),
        (dist.ReduceOp.MAX, mt.ReduceOperation.MAX),
        (dist.ReduceOp.BAND, mt.ReduceOperation.BAND),
        (dist.ReduceOp.BOR, mt.ReduceOperation.BOR),
        (dist.ReduceOp.BXOR, mt.ReduceOperation.BXOR),
    )
}
_PREMUL_SUM = dist.ReduceOp.PREMUL_SUM.value


def known_operation(op: dist.ReduceOp) -> mt.ReduceOperation | None:
    """The mpitensor operation for torch's `op` where it has no factor; None for ``PREMUL_SUM`` (never raises)."""
    return _KINDS.get((op.op if type(op) is dist.ReduceOp else op).value)


def reduce_operation(op: dist.ReduceOp) -> tuple[mt.ReduceOperation, float | None]:
    """The mpitensor operation for torch's `op`, and the factor of a ``PREMUL_SUM``.

    ``AVG`` is mpitensor's ``MEAN`` (integer tensors get the mean truncated toward zero,
    as NCCL's integer average); ``PREMUL_SUM`` (``dist._make_nccl_premul_sum(f)``) is a
    ``SUM`` with ``prescale_factor=f``.

    Raises:
        ValueError: an operation torch has that mpitensor does not (none today).
    """
    kind = (op.op if type(op) is dist.ReduceOp else op).value
    ours = _KINDS.get(kind)
    if ours is not None:
        return ours, None
    if kind != _PREMUL_SUM:
        raise ValueError(f"the mpitensor backend has no reduction for torch's {op}")
    factor = op.factor
    return mt.ReduceOperation.SUM, float(factor.item() if isinstance(factor, torch.Tensor) else factor)
