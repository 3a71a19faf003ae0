"""mpitensor's collectives for JAX programs: inside ``jax.jit``, ``grad``, ``jvp`` and ``vmap``.

The functions here take and give JAX arrays (nothing to resolve)::

    import jax, jax.numpy as jnp
    import mpitensor as mt
    import mpitensor.jax as mtj

    with mt.DistributedContext.init():
        @jax.jit
        def step(x):
            return mtj.all_reduce(x * 2, op="sum")
        print(step(jnp.ones(4)))

Each call compiles to a custom call into mpitensor (XLA's FFI), which runs the eager
collective on XLA's own buffers: no copy in or out, and the consistency check, timeouts
and fail-fast of every mpitensor call (a mismatch between ranks raises on every rank, as
``jax.errors.JaxRuntimeError`` carrying mpitensor's message). The calls keep their order
(an ordered effect), so a compiled program never reorders two collectives. A compiled
program uses whichever context is open when it runs. CPU arrays only for now.

The derivative rules are in `mpitensor.jax._rules`' docstring; in short, a sum all-reduce
transposes to the identity (as mpi4jax's), broadcast to a reduce to the root,
all-gather and reduce-scatter to each other, all-to-all to itself.
"""

from __future__ import annotations

from ._collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scan,
    scatter,
    sendrecv,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scan",
    "scatter",
    "sendrecv",
]
