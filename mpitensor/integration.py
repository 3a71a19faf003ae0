"""What framework integrations build on: mpitensor's public API for running collectives inside another runtime.

`mpitensor.torch` (a ``torch.distributed`` backend) and `mpitensor.jax` (collectives inside
``jax.jit``) use only public names: the collectives of `mpitensor` (with ``held=True`` for
buffers the framework holds, and `mpitensor.collective_call` around a call's own argument
checks) and the few functions here, for what a compiled program's handler or a backend's
helper thread needs. Another integration (a compiler's custom call, a framework's process
group) can use the same ones.

- `compiled_runner`: the compiled plan of a repeated held call, which a handler calls on its
  buffers with no Python around it.
- `wait_at_call`: calls of this thread wait for a late peer's check at the call, for a caller
  that needs the result at once.
- `order_after_compiled`, `run_delegated`: the order of collectives that a compiler's own
  threads run for the program's thread.
- `context_stack`: the stack of open contexts, for compiled code that checks which is innermost.
- `side_communicator`, `thread_multiple`: a communicator for a second thread's calls.
- `reduce_operation`: the `ReduceOperation` a name or member stands for; `check_dtype`: the
  error the collectives raise for a dtype (or a reduction of it) they cannot take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._collectives.all_reduce import held_plan_runner
from ._collectives.held import data_plan
from ._collectives.lane import order_after_compiled
from ._collectives.native import wait_at_call as _wait_at_call
from ._core.config import ReduceOperation, parse_op
from ._core.dtypes import reduce_plan, transfer_dtype
from ._core.state import open_contexts
from ._runtime.context import current_context
from ._runtime.ordering import run_delegated
from ._transport.mpi.side import SideComm, has_thread_multiple

__all__ = [
    "SideComm", "check_dtype", "compiled_runner", "context_stack", "order_after_compiled", "reduce_operation",
    "run_delegated", "side_communicator", "thread_multiple", "wait_at_call",
]


def compiled_runner(kind: str, array: np.ndarray, out: np.ndarray, *, op: Any = None,
                    root: Any = -1) -> Callable[[np.ndarray, np.ndarray], Any] | None:
    """The compiled plan of the held calls ``kind(array, op, root=root, out=out, held=True)`` on the current context.

    Once a first such call (on every rank of the context, through the collective itself) has
    kept its plan, ``run(array, out)`` runs a later call of the same kind at once: the check,
    the data and the result in `out`, in one C call, waiting for a late peer's check at the
    call. It returns True once `out` holds the result, and None where it declines the call
    (another thread, the context unusable, buffers not of its kind; nothing is posted then:
    call the collective instead). It raises what the collective raises. For a handler that
    runs a compiled program's calls with no Python around them, while the context it was
    made on is the innermost open one (`context_stack`).

    Args:
        kind: ``"all_reduce"``, ``"broadcast"``, ``"all_gather"``, ``"all_to_all"``,
            ``"gather"`` or ``"reduce"``.
        array: an input of the calls' dtype and shape.
        out: a result buffer of the calls (for the all-reduce, another array than `array`).
        op: the op argument the calls pass, the same object (all-reduce and reduce).
        root: the root argument the calls pass (rooted collectives).

    Returns:
        ``run``, or None where the calls have no compiled plan (not kept yet, another kind
        of call, the compiled code not built, a sub-group...).
    """
    if not open_contexts:
        return None
    ctx = open_contexts[-1]
    if kind == "all_reduce":
        return held_plan_runner(ctx, array, out, op)
    plan = data_plan(ctx, kind, array, root, op)
    return None if plan is None else plan.run_held


def wait_at_call(flag: bool) -> bool:
    """Have this thread's calls wait for a late peer's check at the call (`flag`), yielding the core meanwhile.

    For a caller that waits for the result at once (a collective inside a compiled program):
    otherwise a call whose check has not agreed after a few tests is queued in the engine and
    returns, so that its caller can compute meanwhile.

    Returns:
        The previous setting (False where the compiled code is not built: calls then queue).
    """
    return _wait_at_call(flag)


def context_stack() -> list[Any]:
    """The stack of open contexts, innermost last: the live list, to be read only (mpitensor changes it)."""
    return open_contexts


def side_communicator(ranks: Sequence[int] | None = None) -> SideComm:
    """A communicator of the current context's ranks (or of `ranks` among them) for a second thread's calls.

    Making one is collective over the whole context: every rank calls it, with the same
    `ranks`. Its calls poll against a deadline, so a peer that never joins is a
    `CollectiveTimeoutError`, not a hang. Two threads in MPI at once need
    ``MPI_THREAD_MULTIPLE`` (`thread_multiple`).

    Raises:
        NoContextError: no context is open.
    """
    return SideComm(current_context().comm, ranks)


def thread_multiple() -> bool:
    """Whether MPI runs at ``MPI_THREAD_MULTIPLE`` (a second thread may call it while the program does)."""
    return has_thread_multiple()


def reduce_operation(op: ReduceOperation | str) -> ReduceOperation:
    """The `ReduceOperation` that `op` (a member, or a name such as ``"sum"`` or ``"avg"``) stands for.

    Raises:
        ValueError: `op` names no reduction.
    """
    return parse_op(op)


def check_dtype(dtype: Any, op: ReduceOperation | str | None = None) -> None:
    """Raise the `TypeError` mpitensor's collectives raise for arrays of `dtype` (reduced with `op`), if any.

    For a caller that checks a call before it is made (a traced program). The reduction's
    check needs MPI's tables, so it runs only while a context is open.

    Args:
        dtype: the arrays' dtype.
        op: the reduction, or None for a collective that does not reduce.

    Raises:
        TypeError: MPI and the consistency check cannot carry `dtype`, or `op` cannot reduce it.
        ValueError: `op` names no reduction.
    """
    dtype = np.dtype(dtype)
    transfer_dtype(dtype)
    if op is not None and open_contexts:
        reduce_plan(parse_op(op), dtype)
