"""torch.distributed's gloo group beside mpitensor in the tests: its store, and its teardown."""

from __future__ import annotations

import datetime
import gc
import threading
import warnings
from typing import Any

import numpy as np

import mpitensor as mt

__all__ = ["gloo_store", "leave_gloo"]


def gloo_store(dist: Any, ctx: mt.DistributedContext, timeout: datetime.timedelta) -> Any:
    """gloo's rendezvous store: rank 0 serves it on a port the kernel picks, and MPI tells the others.

    The kernel picks the port as the server binds it, so no other process can take it in
    between (as it could with a port found free first and bound later).
    """
    store = None
    port = 0
    if ctx.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, ctx.size, True, timeout=timeout, wait_for_workers=False)
        port = store.port
    port = int(mt.broadcast(np.array([port]), root=0).resolve().item())
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, ctx.size, False, timeout=timeout)
    return store


def leave_gloo(dist: Any, bound: float = 60.0) -> None:
    """End gloo's process group: ``dist.destroy_process_group()``, then its last reference.

    Call it once DDP is out of scope. Whoever drops the last reference to the process group
    waits there for gloo's worker threads, and a worker that frees a finished work may need
    the GIL to do it. DDP's reducer holds the GIL as it drops its reference (torch binds the
    reducer without releasing it), so where the reducer drops the last one the rank hangs
    for good: seen here about once in a hundred runs, with the main thread in
    ``~ProcessGroupGloo`` and a worker in ``~AsyncAllreduceWork`` waiting for the GIL. So
    DDP's garbage is collected first, while this function holds a reference of the process
    group's own binding, which releases the GIL as it ends the group; that reference goes last.

    ``destroy_process_group`` runs in a daemon thread, waited for at most `bound` seconds:
    past the bound, this rank warns and goes on (nothing later in the suite uses
    torch.distributed) rather than stop the whole suite.
    """
    group = dist.group.WORLD
    gc.collect()  # DDP's modules and hooks hold cycles: its reducer must go now, not at a later collection
    done = threading.Event()

    def leave() -> None:
        dist.destroy_process_group()
        done.set()

    threading.Thread(target=leave, name="gloo teardown", daemon=True).start()
    if not done.wait(bound):
        warnings.warn(f"torch.distributed's gloo teardown did not return within {bound:g} s; left behind",
                      RuntimeWarning, stacklevel=2)
    del group  # the last reference: the process group ends here, with the GIL released
