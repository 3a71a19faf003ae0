"""Rank 0's parameters, buffers and optimizer state to every rank (Horovod's helpers).

Tensors travel packed into one byte buffer, one ``MPI_Ibcast`` for all of them whatever
their dtypes, and are written back in place on the other ranks.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

import mpitensor as mt

from ._arrays import ALIGN

__all__ = ["broadcast_optimizer_state", "broadcast_parameters", "broadcast_tensors"]


def _offsets(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return offsets, total


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a flat uint8 array (a view where it is a contiguous CPU tensor)."""
    flat = tensor.detach().reshape(-1)
    if flat.dtype is torch.bool:
        flat = flat.view(torch.uint8)
    return flat.view(torch.uint8).cpu().numpy()


def broadcast_tensors(tensors: list[torch.Tensor], root: int = 0, keep_versions: bool = False) -> None:
    """Overwrite `tensors` on every rank with the root's, in place, in one broadcast.

    Args:
        tensors: the same shapes and dtypes, in the same order, on every rank.
        root: the rank whose values everyone gets.
        keep_versions: write through ``tensor.data``, leaving autograd's version counters
            as they are (as DDP's buffer broadcast does): a graph of an earlier forward that
            saved a buffer (BatchNorm's running statistics) stays valid for its backward.

    Raises:
        CollectiveMismatchError: the ranks' tensors add up to different sizes.
    """
    if not tensors:
        return
    offsets, total = _offsets(tensors)
    packed = np.zeros(total, dtype=np.uint8)
    ctx = mt.current_context()
    if ctx.rank == root:
        for tensor, offset in zip(tensors, offsets):
            raw = _bytes_of(tensor)
            packed[offset : offset + raw.size] = raw
    received = mt.broadcast(packed, root=root).resolve().numpy()
    if ctx.rank == root:
        return
    with torch.no_grad():
        for tensor, offset in zip(tensors, offsets):
            raw = received[offset : offset + tensor.numel() * tensor.element_size()]
            raw = raw if raw.flags.writeable and raw.ctypes.data % ALIGN == 0 else raw.copy()
            source = torch.from_numpy(raw).view(tensor.dtype).view(tensor.shape)
            (tensor.data if keep_versions else tensor).copy_(source)


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a mapping (sorted by name, as Horovod does) or an iterable.

    Raises:
        TypeError: an entry that is not a tensor.
    """
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda item: str(item[0]))
    else:
        items = [item if isinstance(item, tuple) else (f"#{index}", item) for index, item in enumerate(params)]
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"broadcast_parameters: entry {name!r} is a {type(value).__name__}, not a torch.Tensor")
    return [(str(name), value) for name, value in items]


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root: int = 0) -> None:
    """Give every rank the root's values of `params`, written in place (Horovod's semantics).

    Call it once after building the model (and after loading a checkpoint on the root),
    so that every replica starts from the same weights.

    Args:
        params: a state dict (``model.state_dict()``), ``model.named_parameters()``, or an
            iterable of tensors; the same on every rank.
        root: the rank whose values everyone gets.

    Raises:
        TypeError: an entry is not a tensor.
        CollectiveMismatchError: the ranks' tensors differ in total size.
        NoContextError: no context is open.
    """
    broadcast_tensors([tensor for _, tensor in _named_tensors(params)], root)


class _Slot:
    """Where a tensor of the optimizer's state sits in the pickled skeleton."""

    def __init__(self, index: int, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.index, self.shape, self.dtype = index, shape, dtype


def _hollow(value: Any, tensors: list[torch.Tensor]) -> Any:
    """`value` with each tensor replaced by a `_Slot` (the tensor appended to `tensors`)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1, tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {key: _hollow(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_hollow(item, tensors) for item in value)
    return value


def _fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of `_hollow`: slots replaced by `tensors`."""
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, dict):
        return {key: _fill(item, tensors) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_fill(item, tensors) for item in value)
    return value


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0) -> None:
    """Give every rank the root's optimizer state and hyperparameters (Horovod's semantics).

    The root's ``state_dict()`` (state tensors such as momentum buffers and step counts,
    and every entry of the parameter groups: learning rate, momentum, betas, ...) is
    loaded on the other ranks with ``load_state_dict``, so it works whether their state is
    empty (a fresh optimizer) or not.

    Args:
        optimizer: an optimizer over the same parameters, in the same groups, on every rank.
        root: the rank whose state everyone gets.

    Raises:
        ValueError: the optimizer's parameter groups differ from the root's (from torch).
        NoContextError: no context is open.
    """
    ctx = mt.current_context()
    tensors: list[torch.Tensor] = []
    skeleton = b""
    if ctx.rank == root:
        # The skeleton travels between ranks of one job, as MPI's own data does; pickle
        # keeps the hyperparameters' types (tuples, None, bools) as they are.
        skeleton = pickle.dumps(_hollow(optimizer.state_dict(), tensors))
    length = mt.broadcast(np.array([len(skeleton)], dtype=np.int64), root=root).resolve().item()
    raw = np.frombuffer(skeleton, dtype=np.uint8) if ctx.rank == root else np.empty(length, dtype=np.uint8)
    received = mt.broadcast(raw, root=root).resolve().numpy()
    if ctx.rank == root:
        broadcast_tensors(tensors, root)
        return
    hollow = pickle.loads(received.tobytes())  # the root of this job sent it
    slots: list[_Slot] = []
    _collect_slots(hollow, slots)
    tensors = [torch.empty(slot.shape, dtype=slot.dtype) for slot in sorted(slots, key=lambda s: s.index)]
    broadcast_tensors(tensors, root)
    optimizer.load_state_dict(_fill(hollow, tensors))


def _collect_slots(value: Any, slots: list[_Slot]) -> None:
    if isinstance(value, _Slot):
        slots.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _collect_slots(item, slots)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _collect_slots(item, slots)
