"""Going on after a rank died: torch's default process group rebuilt over the survivors.

With the ``"mpitensor"`` backend on a fault-tolerant context (``DistributedConfig(
on_rank_failure="raise")``, Open MPI launched with ``mpiexec --with-ft ulfm``), a rank's death
makes every survivor's next collective raise `mpitensor.RankFailedError`. A training loop
catches it and calls `shrink_process_group`, then rebuilds what holds the old group (the
``DistributedDataParallel`` wrapper, the ``DistributedSampler``) and reloads its last state.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import mpitensor as mt

from ._process_group import ProcessGroupMpitensor

__all__ = ["shrink_process_group"]


def shrink_process_group(config: mt.DistributedConfig | None = None) -> mt.DistributedContext:
    """Rebuild torch's default process group over the ranks that survive a rank's death.

    Every surviving rank calls it, after a collective raised `mpitensor.RankFailedError`.
    The mpitensor context of the default group is shrunk to the survivors
    (`mpitensor.DistributedContext.shrink`), the default group is destroyed and made again
    on the new context: ``dist.get_rank()`` and ``dist.get_world_size()`` then give the
    survivors' numbering, in their old order. Whatever holds the old group must be made
    again: wrap the model in a new ``DistributedDataParallel`` (which broadcasts rank 0's
    parameters, so every survivor starts from the same state), make a new
    ``DistributedSampler`` (it reads the new rank and size), and reload the optimizer's state
    (for example from a copy every rank kept of the last completed step). Other groups made
    with ``dist.new_group`` are destroyed with the default one.

    Args:
        config: the new context's settings; the old one's when None.

    Returns:
        The new mpitensor context (the current one). Where the old context was opened by
        ``init_process_group``, the new one is closed by ``dist.destroy_process_group()``
        as the old one was; otherwise close it yourself, as the old one.

    Raises:
        RuntimeError: no default process group of the ``"mpitensor"`` backend, or its context
            is not fault tolerant.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    if not isinstance(world, ProcessGroupMpitensor):
        raise RuntimeError(
            "shrink_process_group() rebuilds the default process group of the 'mpitensor' backend, but "
            f"{'no default group is initialized' if world is None else f'the default group is {type(world).__name__}'}"
            "; call dist.init_process_group('mpitensor') first"
        )
    old = mt.current_context()
    new = old.shrink(config)
    _destroy_default_group()
    owned = old.closed  # the old context was the group's, closed with it: the new one is too
    dist.init_process_group("mpitensor")
    if owned:
        _world().on_shutdown(new.close)
    return new


def _destroy_default_group() -> None:
    """``dist.destroy_process_group()`` of a group whose context lost a rank: it waits for nobody."""
    dist.destroy_process_group()


def _world() -> Any:
    return dist.group.WORLD
