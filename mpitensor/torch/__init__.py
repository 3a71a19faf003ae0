"""PyTorch data parallelism on mpitensor: a drop-in for ``DistributedDataParallel``.

Importing this module imports torch; ``import mpitensor`` alone never does, and torch is
not a dependency of the package. Wrap the model, and nothing else in a DDP training script
changes::

    import mpitensor as mt
    from mpitensor.torch import DataParallel

    with mt.DistributedContext.init():
        model = DataParallel(Net())        # rank 0's parameters and buffers everywhere
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in shard:
            opt.zero_grad()
            loss_fn(model(x), y).backward()  # gradients averaged while backward runs
            opt.step()

CPU modules are supported (their tensors travel as NumPy views of the same memory).
"""

from __future__ import annotations

from ._backend import register as _register
from ._broadcast import broadcast_optimizer_state, broadcast_parameters
from ._data_parallel import DataParallel
from ._elastic import shrink_process_group
from ._process_group import BACKEND_NAME, ProcessGroupMpitensor

__all__ = [
    "BACKEND_NAME", "DataParallel", "ProcessGroupMpitensor", "broadcast_optimizer_state", "broadcast_parameters",
    "shrink_process_group",
]

_register()
