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

from ._all_gather import all_gather
from ._all_reduce import all_reduce
from ._all_to_all import all_to_all
from ._broadcast import broadcast
from ._collective import CollectiveTensor
from ._config import DistributedConfig, ReduceOperation
from ._context import DistributedContext, barrier, current_context
from ._device import Device
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
)
from ._gradient_sync import GradientSync
from ._mpi import defer_finalize
from ._p2p import recv, send
from ._reduce import reduce
from ._reduce_scatter import reduce_scatter
from ._tensor import Tensor, arange, as_tensor, empty, from_numpy, full, ones, tensor, zeros

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
