"""The store torch gets with the ``mpitensor`` backend: a ``TCPStore`` rank 0 serves, found over MPI.

The backend's own collectives need no store, but torch's other groups do: a
``dist.new_group(backend="gloo")`` beside the ``mpitensor`` group (Lightning's
``prepare_data`` barrier, Fabric's ``rank_zero_first``, a checkpointing group) and an NCCL
group rendezvous through the default group's store, under a prefix of their own. So rank 0
serves a ``TCPStore`` (on every interface) on a port the kernel picks as it binds it (no
other process can take it in between), and MPI tells every rank where: rank 0's host name (or ``MASTER_ADDR``
where the launcher set it) and the port. A rank on rank 0's host connects over the
loopback.

Where that fails (rank 0 cannot open a port, or a rank cannot reach it: a firewall between
nodes, a host name that does not resolve), every rank falls back to a store of its own
process and warns once, saying why: the ``mpitensor`` group works as before, and a torch
group that needs a rendezvous (a gloo or NCCL sub-group) waits for its store's timeout.
"""

from __future__ import annotations

import os
import socket
import warnings
from datetime import timedelta
from typing import Any

import numpy as np
import torch.distributed as dist

import mpitensor as mt

__all__ = ["rendezvous_store"]

# How long a rank tries to reach rank 0's store before it gives up and the ranks fall back:
# connecting takes milliseconds; a firewalled port would otherwise hold start-up for the
# group's whole timeout (30 minutes by default).
_CONNECT_SECONDS = 60.0


def rendezvous_store(ctx: Any, timeout: timedelta) -> Any:
    """The store of a process group of the ``mpitensor`` backend; collective over every rank of `ctx`.

    Args:
        ctx: the open mpitensor context (every rank of the job).
        timeout: how long the store's waits may take (the group's timeout).

    Returns:
        A ``TCPStore`` every rank shares, or, where one cannot be opened or reached, a
        ``HashStore`` of this process (after a ``RuntimeWarning`` on every rank saying why).
    """
    store, address, problem = None, None, None
    if ctx.rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, ctx.size, True, timeout=timeout, wait_for_workers=False)
            address = (os.environ.get("MASTER_ADDR") or socket.gethostname(), store.port, socket.gethostname())
        except Exception as exc:
            problem = f"rank 0 could not open a port for it ({type(exc).__name__}: {exc})"
    address = mt.broadcast_object(address, root=0).resolve()
    if address is not None and ctx.rank != 0:
        store, problem = _connect(address, timeout)
    failed = np.array([problem is not None], np.uint8)
    if mt.all_reduce(failed, mt.ReduceOperation.MAX).resolve().numpy()[0]:
        return _fall_back(ctx, problem)
    return store


def _connect(address: tuple[str, int, str], timeout: timedelta) -> tuple[Any, str | None]:
    """A client of rank 0's store, or None and why it could not reach it."""
    host, port, server_host = address
    if host == server_host and socket.gethostname() == server_host:
        host = "127.0.0.1"  # rank 0's own host: the loopback, whatever its name resolves to
    connect = timedelta(seconds=min(_CONNECT_SECONDS, timeout.total_seconds()))
    try:
        store = dist.TCPStore(host, port, None, False, timeout=connect)
    except Exception as exc:
        return None, f"this rank could not reach rank 0's store at {host}:{port} ({type(exc).__name__}: {exc})"
    store.set_timeout(timeout)
    return store, None


def _fall_back(ctx: Any, problem: str | None) -> Any:
    """Every rank's own ``HashStore``, with a warning naming the first rank that failed and why."""
    first = np.array([ctx.rank if problem is not None else ctx.size], np.int64)
    first_rank = int(mt.all_reduce(first, mt.ReduceOperation.MIN).resolve().numpy()[0])
    why = mt.broadcast_object(problem, root=first_rank).resolve()
    where = "" if first_rank == 0 else f"rank {first_rank}: "
    warnings.warn(
        f"init_process_group('mpitensor'): no store shared by the ranks ({where}{why}); the mpitensor group "
        "works without one, but a torch group that needs a rendezvous (dist.new_group(backend='gloo'), an "
        "NCCL group) will wait for its timeout. Let the ranks reach rank 0's host on a TCP port, set "
        "MASTER_ADDR to an address of rank 0 they can reach, or pass init_process_group a store of your own",
        RuntimeWarning,
        stacklevel=4,
    )
    return dist.HashStore()
