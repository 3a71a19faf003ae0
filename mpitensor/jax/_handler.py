"""The XLA side of mpitensor.jax: the FFI target, and the call sites it runs.

A compiled collective is a custom call to the one target ``mpitensor_collective`` with
an int64 attribute ``site``: the number of a *call site*, a kind of collective with its
static parameters (op, root, group, dtype...). XLA calls the compiled handler
(``native/ffi.c``) with its buffers; the handler calls `run` with NumPy views of them, and
`run` calls the site's eager collective with the result buffer as ``out=``. So a compiled
call is checked, timed out and failed fast as every eager call is, and needs no MPI handle
baked into the compiled program: it uses whichever context is open when it runs. XLA runs
it on one of its threads as often as on the caller's; `_runtime.ordering` keeps the order.
An all-reduce's later calls skip `run`: its runner hands back a fast path (see `run`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import integration

TARGET = "mpitensor_collective"

# A runner may return a fast path for its site, (ctx, run): see `run`.
Runner = Callable[[tuple[np.ndarray, ...], tuple[np.ndarray, ...]], "tuple[Any, Any] | None"]

_sites: list[Runner] = []
_numbers: dict[Any, int] = {}
_lock = threading.Lock()
_registered = False
_module: Any = None  # the compiled handler's module, once registered
_ordered = False


def site(key: Any, runner: Runner) -> int:
    """The number of the call site `key` (hashable), made with `runner` the first time.

    Called as a program holding the site is compiled: from then on the owner thread's eager
    collectives wait for the programs dispatched before them (`order_after_compiled`).
    """
    global _ordered
    if not _ordered:
        import jax

        integration.order_after_compiled(jax.effects_barrier)
        _ordered = True
    with _lock:
        number = _numbers.get(key)
        if number is None:
            number = _numbers[key] = len(_sites)
            _sites.append(runner)
        return number


def run(number: int, inputs: tuple[np.ndarray, ...], results: tuple[np.ndarray, ...]) -> None:
    """Run call site `number` on XLA's buffers (called by the compiled handler).

    XLA calls it on the thread that runs the program, often one of its own: the call is the
    owner thread's, delegated (`_runtime.ordering`).
    Where the runner returns a fast path, (ctx, run), the handler calls ``run(input, result)``
    itself from then on while `ctx` is the innermost open context (``_ffi.set_fast``).
    """
    fast = integration.run_delegated(_sites[number], inputs, results)
    if fast is not None:
        ctx, call = fast
        # Freed with the context's group when it closes: the handler then drops its paths.
        ctx.full_group.extra.setdefault(_FAST_PATHS, _FastPaths(ctx))
        _module.set_fast(number, ctx, call)


_FAST_PATHS = "mpitensor.jax fast paths"


class _FastPaths:
    """The handler's fast paths of one context, which the context frees with its group's caches."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def free(self) -> None:
        """Drop the handler's fast paths of the context (it is closing), so they do not keep it alive."""
        _module.forget(self.ctx)


def register() -> None:
    """Register the FFI target with XLA for the CPU platform (once).

    Raises:
        ImportError: the compiled handler was not built (no C compiler at install).
    """
    global _registered, _module
    if _registered:  # every eager call comes here: no lock once it is done
        return
    with _lock:
        if _registered:
            return
        import jax

        try:
            from . import _ffi
        except ImportError as exc:
            raise ImportError(
                "mpitensor.jax needs its compiled handler (mpitensor.jax._ffi), which this install "
                "lacks: it is built by pip install when a C compiler is found; reinstall mpitensor "
                "with one (python -m mpitensor info says which compiled parts are present)"
            ) from exc
        _ffi.set_runner(run, integration.context_stack())
        _module = _ffi
        jax.ffi.register_ffi_target(TARGET, _ffi.capsule(), platform="cpu")
        _registered = True
