"""The shared-memory all-reduce's sizes and environment: when it applies, how big its pieces are."""

from __future__ import annotations

import mmap
import os
from typing import Any

from ..._core.limits import SHARED_MEMORY_MIN_BYTES

__all__ = ["MAX_CACHED_BYTES", "MAX_PEER_MAP_BYTES", "PAGE", "PIECE_BYTES", "cpu_count", "may_apply", "min_bytes"]

DEFAULT_MIN_BYTES = SHARED_MEMORY_MIN_BYTES
# Reduce in pieces that stay in the core's cache, so that copying a reduced piece to the
# peers' result blocks reads it from cache instead of memory.
PIECE_BYTES = 1 << 20
PAGE = mmap.PAGESIZE
MAX_CACHED_BYTES = 512 << 20
# Peers' blocks stay mapped (least recently used dropped first) up to this many bytes: a
# block its owner has freed lives on while mapped here.
MAX_PEER_MAP_BYTES = 1 << 30

_min_bytes: int | None = None


def min_bytes() -> int:
    """The message size from which the fast path is used when ``shared_memory`` is None.

    ``MPITENSOR_SHM_MIN_BYTES`` overrides the default (512 KiB); it is read here, and
    all-reduces use the value read last (the first all-reduce reads it).

    Raises:
        ValueError: the variable is set but not a non-negative integer.
    """
    global _min_bytes
    raw = os.environ.get("MPITENSOR_SHM_MIN_BYTES", "").strip()
    if not raw:
        value = DEFAULT_MIN_BYTES
    else:
        try:
            value = int(raw)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"MPITENSOR_SHM_MIN_BYTES must be a non-negative integer, got {raw!r}")
    _min_bytes = value
    return value


def may_apply(config: Any, nbytes: int) -> bool:
    """Whether a message of `nbytes` may take the fast path under `config` (by size alone).

    Args:
        config: the context's `DistributedConfig` (its ``shared_memory`` setting).
        nbytes: the message size in bytes.

    Returns:
        False when the shared-memory transport cannot apply, whatever the group and dtype.

    Raises:
        ValueError: ``MPITENSOR_SHM_MIN_BYTES`` is malformed (read on first use).
    """
    setting = config.shared_memory
    if setting is False or nbytes == 0:
        return False
    return setting is True or nbytes >= (_min_bytes if _min_bytes is not None else min_bytes())


def cpu_count() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
