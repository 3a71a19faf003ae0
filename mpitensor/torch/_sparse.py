"""``dist.all_reduce`` of a sparse COO tensor (SUM, as gloo has it): every rank's entries, summed.

Each rank's coalesced indices and values travel as one object (`mpitensor.all_gather_object`;
sparse tensors are small, and their number of entries differs between ranks), with the
tensor's size and dtype, so ranks whose tensors differ raise `CollectiveMismatchError` on
every rank. The sum of all ranks' entries, coalesced, is written into the caller's tensor.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

import mpitensor as mt

__all__ = ["check_sparse", "sparse_all_reduce"]


def check_sparse(tensors: Sequence[torch.Tensor], op: mt.ReduceOperation, factor: float | None) -> torch.Tensor:
    """The one sparse COO tensor of an all-reduce, or a clear error (before any collective).

    Raises:
        ValueError: more than one tensor, another sparse layout, or an operation but SUM.
    """
    if len(tensors) != 1:
        raise ValueError(f"all_reduce: the mpitensor backend takes one sparse tensor per call, got {len(tensors)}")
    tensor = tensors[0]
    if tensor.layout is not torch.sparse_coo:
        raise ValueError(f"all_reduce: the mpitensor backend takes dense or sparse COO tensors, got {tensor.layout}")
    if op is not mt.ReduceOperation.SUM or factor is not None:
        raise ValueError(f"all_reduce: a sparse tensor is reduced with SUM only (as gloo), got {op.name}")
    if tensor.device.type != "cpu":
        raise ValueError(f"all_reduce: sparse tensors on {tensor.device} are not supported; pass a CPU tensor")
    return tensor


def sparse_all_reduce(tensor: torch.Tensor, devices: Any, timeout: float | None) -> None:
    """Write the sum over the group of every rank's sparse `tensor` into it.

    Raises:
        CollectiveMismatchError: the ranks' tensors differ in size, sparse dimensions or dtype.
    """
    local = tensor.detach().coalesce()
    mine = (tuple(tensor.shape), local.sparse_dim(), str(tensor.dtype), local.indices().numpy(),
            local.values().numpy())
    every = mt.all_gather_object(mine, devices=devices).resolve(timeout)
    kinds = {entry[:3] for entry in every}
    if len(kinds) > 1:
        described = "; ".join(f"rank {rank}: size {entry[0]}, {entry[1]} sparse dims, {entry[2]}"
                              for rank, entry in enumerate(every))
        raise mt.CollectiveMismatchError(f"all_reduce of sparse tensors: the ranks' tensors differ ({described})")
    indices = torch.cat([torch.from_numpy(entry[3]) for entry in every], dim=1)
    values = torch.cat([torch.from_numpy(entry[4]) for entry in every])
    total = torch.sparse_coo_tensor(indices, values, tensor.shape, dtype=tensor.dtype).coalesce()
    with torch.no_grad():
        tensor.copy_(total)
