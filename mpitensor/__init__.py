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

from ._collectives import all_gather as _all_gather
from ._collectives import all_reduce as _all_reduce
from ._collectives import all_to_all as _all_to_all
from ._collectives import barrier as _barrier
from ._collectives import broadcast as _broadcast
from ._collectives import gather as _gather
from ._collectives import objects as _objects
from ._collectives import reduce as _reduce
from ._collectives import reduce_scatter as _reduce_scatter
from ._collectives import scan as _scan
from ._collectives import scatter as _scatter
from ._collectives.common import CollectiveTensor
from ._collectives.gradient_sync import GradientSync
from ._collectives.lane import with_lane
from ._collectives.p2p import ANY_SOURCE, ReceiveTensor, recv, send
from ._core.config import DistributedConfig, ReduceOperation
from ._core.device import Device
from ._core.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    ContextBrokenError,
    ContextClosedError,
    DeviceError,
    ForkedProcessError,
    MpiFinalizedError,
    MpitensorError,
    NoContextError,
    ObjectUnpicklingError,
    RankFailedError,
    TensorInFlightError,
    ThreadMisuseError,
    TracedArrayError,
)
from ._core.mpi import defer_finalize
from ._core.tensor import Tensor, arange, as_tensor, empty, from_numpy, full, ones, tensor, zeros
from ._runtime.context import DistributedContext, current_context
from ._runtime.entry import collective_call, collective_entry
from ._runtime.tracing.exchange import set_gatherer as _set_gatherer
from ._runtime.tracing.regions import trace_region
from ._runtime.tracing.stragglers import TraceSummary

all_reduce = with_lane(collective_entry("all_reduce")(_all_reduce.all_reduce))
broadcast = collective_entry("broadcast")(_broadcast.broadcast)
reduce = collective_entry("reduce")(_reduce.reduce)
all_gather = collective_entry("all_gather")(_all_gather.all_gather)
reduce_scatter = collective_entry("reduce_scatter")(_reduce_scatter.reduce_scatter)
all_to_all = collective_entry("all_to_all")(_all_to_all.all_to_all)
barrier = collective_entry("barrier")(_barrier.barrier)
gather = collective_entry("gather")(_gather.gather)
scatter = collective_entry("scatter")(_scatter.scatter)
scan = collective_entry("scan")(_scan.scan)
exscan = collective_entry("exscan")(_scan.exscan)
broadcast_object = collective_entry("broadcast_object")(_objects.broadcast_object)
all_gather_object = collective_entry("all_gather_object")(_objects.all_gather_object)
gather_object = collective_entry("gather_object")(_objects.gather_object)
# ctx.trace_summary() gathers the ranks' records through the checked all-gather.
_set_gatherer(lambda obj: all_gather_object(obj).resolve())

__version__ = "0.1.0"

__all__ = [
    "ANY_SOURCE",
    "CollectiveMismatchError",
    "CollectiveTensor",
    "CollectiveTimeoutError",
    "ContextBrokenError",
    "ContextClosedError",
    "Device",
    "DeviceError",
    "DistributedConfig",
    "DistributedContext",
    "ForkedProcessError",
    "GradientSync",
    "MpiFinalizedError",
    "MpitensorError",
    "NoContextError",
    "ObjectUnpicklingError",
    "RankFailedError",
    "ReceiveTensor",
    "ReduceOperation",
    "Tensor",
    "TensorInFlightError",
    "ThreadMisuseError",
    "TraceSummary",
    "TracedArrayError",
    "__version__",
    "all_gather",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "arange",
    "as_tensor",
    "barrier",
    "broadcast",
    "broadcast_object",
    "collective_call",
    "current_context",
    "defer_finalize",
    "empty",
    "exscan",
    "from_numpy",
    "full",
    "gather",
    "gather_object",
    "ones",
    "recv",
    "reduce",
    "reduce_scatter",
    "scan",
    "scatter",
    "send",
    "tensor",
    "trace_region",
    "zeros",
]
