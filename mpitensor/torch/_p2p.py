"""``send`` and ``recv`` of the ``mpitensor`` backend: what each side does when its own call fails.

Point-to-point calls take no turns (they pair by source and tag, not by call order), so a
failed call cannot post a failed check as a collective does. Instead:

- A send takes every dense tensor (a conjugate or negative view resolved, a non-contiguous
  one copied, any number of dimensions: tensors travel flat). What it still refuses (a
  sparse tensor, a dtype with no NumPy counterpart, a list of other than one tensor) it
  refuses after sending the receiver a *notice* in the tensor's place: the error's text as
  a 2-d ``uint8`` message, which no receive of this backend expects (they expect flat
  tensors), so the receiver raises instead of waiting forever (`CollectiveMismatchError`
  naming the sender, with the check on).
- A receive that refuses its tensor still takes the message it was posted for (and
  discards it), so the sender never waits for it and the next receive gets the next message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

import mpitensor as mt

__all__ = ["discard", "notice_error", "send_notice", "sendable"]


def sendable(tensors: Sequence[torch.Tensor], check_dtype: Any) -> torch.Tensor:
    """The one tensor of a send, flat, with the values it shows (a conjugate view resolved).

    Args:
        tensors: torch's list (one tensor).
        check_dtype: the backend's dtype check, ``check_dtype(dtype, what)``.

    Raises:
        ValueError, TypeError: not one tensor, or one mpitensor cannot carry.
    """
    if len(tensors) != 1:
        raise ValueError(f"send: the mpitensor backend takes one tensor per call, got {len(tensors)}")
    tensor = tensors[0]
    if tensor.layout is not torch.strided:
        raise ValueError(f"send: the mpitensor backend takes dense tensors, got one with layout {tensor.layout}")
    check_dtype(tensor.dtype, "send")
    return tensor.detach().resolve_conj().resolve_neg().reshape(-1)


def send_notice(dest: int, tag: int, error: BaseException) -> None:
    """Send `dest` the notice that this rank's send (of `tag`) failed with `error`."""
    text = f"{type(error).__name__}: {error}".encode()
    notice = np.frombuffer(text, dtype=np.uint8).reshape(1, -1)
    try:
        mt.send(notice, dest, tag=tag)  # completes on its own: mpitensor keeps it until sent
    except (ValueError, TypeError):  # the destination or tag itself is bad: the receiver refuses it too
        pass


def notice_error(result: Any, source: int) -> mt.CollectiveMismatchError | None:
    """The error a received notice carries (a 2-d ``uint8`` message), or None for data."""
    array = result.numpy() if isinstance(result, mt.Tensor) else result
    if not isinstance(array, np.ndarray) or array.ndim != 2 or array.dtype != np.uint8:
        return None
    text = array.tobytes().decode(errors="replace")
    return mt.CollectiveMismatchError(f"recv: rank {source}'s send failed on that rank: {text}")


def discard(source: int, tag: int) -> None:
    """Take (and drop) the next message of `source` with `tag`: the one a refused receive was for."""
    try:
        mt.recv(None, source, tag=tag)  # mpitensor completes it on its own
    except (ValueError, TypeError):  # a bad source or tag: no message can come
        pass
