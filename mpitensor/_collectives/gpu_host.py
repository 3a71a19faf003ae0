"""CuPy inputs of the collectives that run on host memory only: staged through the host.

The GPU tensor is copied to (pinned) host memory at the call, the host collective runs on
the copy, and `resolve()` brings the result back to the input's GPU, as the staged path of
`broadcast` and `all_gather` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from .._runtime.context import DistributedContext
from .._runtime.engine import Group
from .._transport.gpu.staging import stage_now
from .._transport.gpu.streams import gpu_call
from .common import CollectiveTensor, Input
from .gpu_staged import StagedCollective, cuda_result_device

__all__ = ["staged"]


def staged(
    ctx: DistributedContext,
    source: Input,
    group: Group,
    run: Callable[[np.ndarray, Any], CollectiveTensor],
) -> CollectiveTensor:
    """Run a host collective on a host copy of a CuPy input; results go back to its GPU.

    Args:
        ctx: the context.
        source: the checked CuPy input.
        group: the group.
        run: ``run(host_array, devices)`` starts the host collective on the copy.

    Returns:
        A handle whose `resolve()` gives the result's tensors on the input's GPU (None stays None).
    """
    call = gpu_call(source.buffer)
    host = stage_now(call, source.buffer)
    device = cuda_result_device(ctx, source, call.device)
    members = None if group.size == ctx.size else [ctx.devices[m] for m in group.members]
    return StagedCollective(ctx, run(host, members), call, device)
