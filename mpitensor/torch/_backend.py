"""The ``"mpitensor"`` backend of torch.distributed: registration and start-up.

``import mpitensor.torch`` registers the backend. Under ``mpiexec``, ``srun`` or ``sbatch``,
``dist.init_process_group("mpitensor")`` then needs nothing else: rank and world size
come from MPI (as for torch's own MPI backend), there is no MASTER_ADDR/MASTER_PORT to
set (MPI tells every rank where rank 0 serves torch's store), and an mpitensor context
over every rank is opened if none is open (it is closed again by
``dist.destroy_process_group()``).

torch looks for a rendezvous (``env://``) whenever ``init_process_group`` gets no store;
only its built-in MPI backend is exempt. So this module wraps
``torch.distributed.init_process_group`` (and ``monitored_barrier``, which torch keeps for
gloo): for the ``mpitensor`` backend the wrapper opens the context and hands torch MPI's
rank and world size and a store every rank shares (`rendezvous_store`: rank 0 serves it,
MPI tells the others where), which torch's other groups beside this one rendezvous
through (``dist.new_group(backend="gloo")``); every other call goes to torch unchanged.
It also installs `_frontends`' wrappers (conjugate views, the object collectives' turns).
"""

from __future__ import annotations

import functools
import inspect
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import mpitensor as mt

from ._frontends import FRONTENDS
from ._process_group import BACKEND_NAME, ProcessGroupMpitensor
from ._store import rendezvous_store

__all__ = ["register"]

# torch's default timeout: a group made with it leaves waits to the mpitensor context's timeout.
_TORCH_DEFAULT_TIMEOUT = timedelta(minutes=30)


def register() -> None:
    """Register the backend and wrap torch's entry points (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    # torch.distributed re-exports distributed_c10d's functions: one wrapper serves both names.
    wrappers = (("init_process_group", _wrap_init), ("monitored_barrier", _wrap_monitored_barrier), *FRONTENDS)
    for name, wrap in wrappers:
        original = getattr(c10d, name, None)
        if original is None:  # a function this torch does not have
            continue
        if not getattr(original, "_mpitensor_wrapper", False):
            wrapper = wrap(original)
            setattr(c10d, name, wrapper)
            setattr(dist, name, wrapper)


def _create(options: Any, backend_options: Any) -> ProcessGroupMpitensor:
    """The group torch asks for: the world at init, or a ``dist.new_group(ranks)``."""
    ctx = mt.current_context()
    ranks = list(options.global_ranks_in_group) or None
    size = options.group_size
    if ranks is None and (size != ctx.size or options.group_rank != ctx.rank):
        raise RuntimeError(
            f"init_process_group('mpitensor'): torch was given rank {options.group_rank} of {size}, but "
            f"this process is rank {ctx.rank} of the MPI job's {ctx.size} (the mpitensor context); launch "
            "with mpiexec or srun, and pass no rank, world_size or init_method"
        )
    timeout = options.timeout
    seconds = None if timeout is None or timeout == _TORCH_DEFAULT_TIMEOUT else timeout.total_seconds()
    if ranks is not None and ranks == list(range(ctx.size)):
        ranks = None  # the whole world: the context's own communicator and the fast lanes
    # torch makes the default group before it knows it is initialized; every later one is a
    # dist.new_group's, which belongs to the thread that first calls a collective on it.
    group = ProcessGroupMpitensor(options.group_rank, size, ranks, seconds, by_first_thread=dist.is_initialized())
    _declare_devices(group)
    return group


def _declare_devices(group: ProcessGroupMpitensor) -> None:
    """Tell torch the group serves CPU and CUDA tensors (``pg._device_types``, which ``dcp.async_save`` asks).

    torch learns a group's devices from the C++ backends registered on it; a group written
    in Python has none (torch cannot subclass its C++ backend in Python), so an empty one is
    registered per device. Every collective is the group's own Python method; a method torch
    would send to such a backend instead raises torch's "Could not retrieve or create the
    backend", as it did before with no backend at all.
    """
    for device in ("cpu", "cuda"):
        group._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, None)


def _wrap_init(init: Any) -> Any:
    signature = inspect.signature(init)

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        backend = bound.arguments.get("backend")
        if not _is_ours(backend):
            return init(*args, **kwargs)
        opened = _open_context()
        ctx = mt.current_context()
        try:
            _check_world(bound.arguments, ctx)
            if bound.arguments.get("store") is None and bound.arguments.get("init_method") is None:
                timeout = bound.arguments.get("timeout") or _TORCH_DEFAULT_TIMEOUT
                bound.arguments.update(store=rendezvous_store(ctx, timeout), rank=ctx.rank, world_size=ctx.size)
            result = init(*bound.args, **bound.kwargs)
        except BaseException:
            if opened:
                ctx.close()
            raise
        world = dist.group.WORLD
        if opened and isinstance(world, ProcessGroupMpitensor):
            world.on_shutdown(ctx.close)
        return result

    init_process_group._mpitensor_wrapper = True  # type: ignore[attr-defined]
    return init_process_group


def _is_ours(backend: Any) -> bool:
    return isinstance(backend, str) and BACKEND_NAME in backend.lower()


def _open_context() -> bool:
    """Open a context over every rank unless one is open; True when this opened it."""
    try:
        mt.current_context()
        return False
    except mt.NoContextError:
        pass
    # torch programs may init and destroy process groups more than once: MPI stays up
    # until interpreter exit.
    mt.defer_finalize()
    mt.DistributedContext.init()
    return True


def _check_world(arguments: dict[str, Any], ctx: Any) -> None:
    """Refuse a rank or world size that is not MPI's (torchrun's processes are no MPI job)."""
    rank = arguments.get("rank", -1)
    world_size = arguments.get("world_size", -1)
    env_size = os.environ.get("WORLD_SIZE")
    if env_size is not None and arguments.get("store") is None and env_size.isdigit() and int(env_size) != ctx.size:
        world_size = int(env_size)
    if world_size not in (-1, ctx.size) or rank not in (-1, ctx.rank):
        raise RuntimeError(
            f"init_process_group('mpitensor'): this process is rank {ctx.rank} of an MPI job of "
            f"{ctx.size} ranks, but torch was told rank={rank}, world_size={world_size}; the mpitensor "
            "backend takes both from MPI: launch the script with mpiexec or srun (not torchrun) and "
            "pass neither"
        )


def _wrap_monitored_barrier(monitored: Any) -> Any:
    @functools.wraps(monitored)
    def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> Any:
        pg = dist.group.WORLD if group is None else group
        if isinstance(pg, ProcessGroupMpitensor):
            return pg.monitored_barrier(timeout, wait_all_ranks)
        return monitored(group, timeout, wait_all_ranks)

    monitored_barrier._mpitensor_wrapper = True  # type: ignore[attr-defined]
    return monitored_barrier
