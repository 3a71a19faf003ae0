"""mpitensor: SPMD tensors on MPI, with non-blocking collectives that overlap compute.

Every MPI rank runs the same program, owns one device (a CPU, or a GPU through CuPy) and
its own tensors. Ranks combine tensors with collectives that start at once and return a
`CollectiveTensor`, resolved when the data is needed::

    import mpitensor as mt

    with mt.DistributedContext.init() as ctx:
        grad = mt.tensor([1.0, 2.0]) * (ctx.rank + 1)
        pending = mt.all_reduce(grad, mt.ReduceOperation.MEAN)
        ...  # compute here overlaps the communication
        mean = pending.resolve()

The API mirrors the distributed module of the Burn framework.
"""

from __future__ import annotations

from . import _all_gather, _all_reduce, _all_to_all, _broadcast, _context, _reduce, _reduce_scatter
from ._collective import CollectiveTensor
from ._config import DistributedConfig, ReduceOperation
from ._context import DistributedContext, current_context
from ._device import Device
from ._entry import collective_entry
from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ContextBrokenError,
    ContextClosedError,
    DeviceError,
    MpiFinalizedError,
    MpitensorError,
    NoContextError,
    TensorInFlightError,
    ThreadMisuseError,
)
from ._gradient_sync import GradientSync
from ._mpi import defer_finalize
from ._p2p import recv, send
from ._tensor import Tensor, arange, as_tensor, empty, from_numpy, full, ones, tensor, zeros

all_reduce = collective_entry("all_reduce")(_all_reduce.all_reduce)
broadcast = collective_entry("broadcast")(_broadcast.broadcast)
reduce = collective_entry("reduce")(_reduce.reduce)
all_gather = collective_entry("all_gather")(_all_gather.all_gather)
reduce_scatter = collective_entry("reduce_scatter")(_reduce_scatter.reduce_scatter)
all_to_all = collective_entry("all_to_all")(_all_to_all.all_to_all)
barrier = collective_entry("barrier")(_context.barrier)

__version__ = "0.1.0"

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTensor",
    "CollectiveTimeoutError",
    "ContextBrokenError",
    "ContextClosedError",
    "Device",
    "DeviceError",
    "DistributedConfig",
    "DistributedContext",
    "GradientSync",
    "MpiFinalizedError",
    "MpitensorError",
    "NoContextError",
    "ReduceOperation",
    "Tensor",
    "TensorInFlightError",
    "ThreadMisuseError",
    "__version__",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "arange",
    "as_tensor",
    "barrier",
    "broadcast",
    "current_context",
    "defer_finalize",
    "empty",
    "from_numpy",
    "full",
    "ones",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
    "tensor",
    "zeros",
]
