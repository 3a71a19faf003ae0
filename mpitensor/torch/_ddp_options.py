"""DDP's keyword arguments as `DataParallel` takes them: each one's meaning here, or why it is refused.

One table, one entry per argument of ``DistributedDataParallel``: an entry checks the value
and returns what it sets in `Options` (nothing, for the hints DataParallel does not need).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["Options", "resolve"]

_DDP_ON_THE_BACKEND = "DistributedDataParallel on the 'mpitensor' backend (docs/torch.md)"


@dataclass(frozen=True)
class Options:
    """What the keyword arguments set: the bucket size and the buffer and start-up syncs."""

    bucket_bytes: int | None = None
    forward_buffers: bool = True  # rank 0's buffers before each forward
    init_buffers: bool = True  # rank 0's buffers at construction
    init_sync: bool = True  # rank 0's parameters (and buffers) at construction


def resolve(bucket_bytes: int | None, ddp: dict[str, Any]) -> Options:
    """Check DDP's keyword arguments and return the options they set.

    Raises:
        TypeError: an argument DataParallel does not take (saying what to use instead), a
            value of the wrong type, or both `bucket_bytes` and `bucket_cap_mb`.
        ValueError: a device for a CPU module, or a bucket size that is not positive.
    """
    if bucket_bytes is not None and ddp.get("bucket_cap_mb") is not None:
        raise TypeError("DataParallel: pass bucket_bytes or bucket_cap_mb, not both")
    options = Options(bucket_bytes=bucket_bytes)
    for name, value in ddp.items():
        check = _TABLE.get(name)
        if check is None:
            raise TypeError(f"DataParallel() got an unexpected keyword argument {name!r}")
        options = replace(options, **check(name, value))
    sync_buffers = ddp.get("forward_sync_buffers")
    if sync_buffers is None:  # DDP's rule: the older broadcast_buffers=False also skips them at start-up
        sync_buffers = ddp.get("broadcast_buffers")
        sync_buffers = True if sync_buffers is None else sync_buffers
        options = replace(options, init_buffers=sync_buffers)
    return replace(options, forward_buffers=sync_buffers)


def _flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"DataParallel: {name} must be a bool, got {type(value).__name__}")
    return value


def _hint(name: str, value: Any) -> dict[str, Any]:
    """Accepted with DDP's meaning, which DataParallel has anyway or does not need (see docs)."""
    _flag(name, value)
    return {}


def _optional_flag(name: str, value: Any) -> dict[str, Any]:
    if value is not None:
        _flag(name, value)
    return {}  # read by `resolve`, which applies DDP's rule between the two buffer flags


def _init_sync(name: str, value: Any) -> dict[str, Any]:
    return {"init_sync": _flag(name, value)}


def _bucket_cap_mb(name: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"DataParallel: bucket_cap_mb must be a number of MiB, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"DataParallel: bucket_cap_mb must be positive, got {value}")
    return {"bucket_bytes": max(1, int(value * 1024 * 1024))}  # as DDP rounds it


def _cpu_only(name: str, value: Any) -> dict[str, Any]:
    if value is None or (isinstance(value, (list, tuple)) and not value and name == "device_ids"):
        return {}
    raise ValueError(f"DataParallel trains CPU modules: {name} must be None (DDP's rule for CPU modules), "
                     f"got {value!r}")


def _dim(name: str, value: Any) -> dict[str, Any]:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"DataParallel: dim must be an int, got {type(value).__name__}")
    return {}  # DDP scatters inputs along it only across one process's devices, never for CPU modules


def _refused(instead: str) -> Callable[[str, Any], dict[str, Any]]:
    def check(name: str, value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        raise TypeError(f"DataParallel does not support {name}; {instead}")

    return check


_TABLE: dict[str, Callable[[str, Any], dict[str, Any]]] = {
    "device_ids": _cpu_only,
    "output_device": _cpu_only,
    "dim": _dim,
    "broadcast_buffers": _optional_flag,
    "forward_sync_buffers": _optional_flag,
    "init_sync": _init_sync,
    "bucket_cap_mb": _bucket_cap_mb,
    "find_unused_parameters": _hint,  # not needed: unused parameters are always handled
    "check_reduction": _hint,  # deprecated in DDP, and without effect there
    "gradient_as_bucket_view": _hint,  # DataParallel's gradients are always bucket views
    "static_graph": _hint,  # not needed: reentrant checkpoints and unused parameters work without
    "skip_all_reduce_unused_params": _hint,
    "batched_grad_copy": _hint,
    "process_group": _refused("it runs over every rank of the open mpitensor context (pass None); for a "
                              f"sub-group use {_DDP_ON_THE_BACKEND} with process_group=dist.new_group(ranks)"),
    "device_mesh": _refused(f"it runs over every rank of the open mpitensor context; use {_DDP_ON_THE_BACKEND}"),
    "mixed_precision": _refused("cast the module (module.to(torch.bfloat16)) or run the forward under "
                                f"torch.autocast, or use {_DDP_ON_THE_BACKEND}"),
    "bucket_cap_mb_list": _refused(f"use bucket_cap_mb (or bucket_bytes), or {_DDP_ON_THE_BACKEND}"),
    "delay_all_reduce_named_params": _refused(f"use {_DDP_ON_THE_BACKEND}"),
    "param_to_hook_all_reduce": _refused(f"use {_DDP_ON_THE_BACKEND}"),
}
