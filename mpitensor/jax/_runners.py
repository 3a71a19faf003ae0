"""What a compiled call site runs: the eager collective, its result written into XLA's buffer.

A runner gets NumPy views of XLA's buffers: the input read-only, the result writable. Types
NumPy lacks (bfloat16) come as bytes and are viewed in the call's dtype first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

import mpitensor as mt

from .. import integration

# A runner returns None, or for its site a fast path (ctx, run) (`_handler.run`).
Runner = Callable[[tuple[np.ndarray, ...], tuple[np.ndarray, ...]], "tuple[Any, Any] | None"]


def make(kind: str, aval_in: Any, aval_out: Any, params: dict[str, Any]) -> Runner:
    """The runner of a call site: collective `kind` with `params`, on arrays of these avals."""
    typed_in = np.dtype(aval_in.dtype), tuple(aval_in.shape)
    typed_out = np.dtype(aval_out.dtype), tuple(aval_out.shape)
    if kind in _HELD:
        return _held(kind, typed_in, typed_out, params)
    start = _STARTS[kind]

    def runner(inputs: tuple[np.ndarray, ...], results: tuple[np.ndarray, ...]) -> None:
        start(_typed(inputs[0], *typed_in), _typed(results[0], *typed_out), params)

    return runner


def _held(kind: str, typed_in: tuple[np.dtype, tuple[int, ...]], typed_out: tuple[np.dtype, tuple[int, ...]],
          params: dict[str, Any]) -> Runner:
    """The runner of a collective that moves data between XLA's input and result buffers: its held call.

    XLA's buffers are the call's own until it returns: the promise a held call asks for
    (``held=True``). The collective chooses how the data moves (MPI's blocking call from the
    input straight into the result buffer once the check agreed, or an ordinary call whose
    result is copied in); every rank's buffer gets a result (off the root, a gather's and a
    reduce's is the input, as a compiled program's results have one shape on every rank).
    The program waits for the result anyway, so a late peer's check is waited for at the call,
    yielding the core, rather than in the engine's queue, whose steps are slower. From the
    second call the handler calls the kind's compiled plan itself (`integration.compiled_runner`),
    while this context is the innermost open one: inside jax.jit every Python step costs
    several times what it costs in a loop of eager calls.
    """
    call, op, root = _HELD[kind], params.get("op"), params.get("root", -1)

    def runner(inputs: tuple[np.ndarray, ...], results: tuple[np.ndarray, ...]) -> tuple[Any, Any] | None:
        source, out = _typed(inputs[0], *typed_in), _typed(results[0], *typed_out)
        previous = integration.wait_at_call(True)
        try:
            call(source, out, params).resolve()
        finally:
            integration.wait_at_call(previous)
        if source is not inputs[0] or out is not results[0] or params["devices"] is not None:
            return None  # bytes viewed as another dtype (bfloat16) have no plan of their own
        run = integration.compiled_runner(kind, source, out, op=op, root=root)
        return None if run is None else (mt.current_context(), run)

    return runner


def _typed(array: np.ndarray, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    if array.dtype == dtype:
        return array
    return array.view(dtype).reshape(shape)


def _reduce_scatter(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    mt.reduce_scatter(source, params["op"], devices=params["devices"], out=out).resolve()


def _scatter(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    root, devices = params["root"], params["devices"]
    if mt.current_context().rank == root:
        block = mt.scatter(source, root, devices=devices).resolve()
    else:
        size = len(devices) if devices is not None else mt.current_context().size
        block = mt.scatter(None, root, shape=(size, *out.shape), dtype=out.dtype, devices=devices).resolve()
    np.copyto(out, block.array.reshape(out.shape))


def _scan(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    start = mt.exscan if params["exclusive"] else mt.scan
    np.copyto(out, start(source, params["op"], devices=params["devices"]).resolve().array)


def _barrier(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    mt.barrier(params["devices"])
    np.copyto(out, source)


def _sendrecv(source: np.ndarray, out: np.ndarray, params: dict[str, Any]) -> None:
    if params["source"] == params["dest"] == mt.current_context().rank:
        # A rank's exchange with itself (a ring of one) is a copy, as MPI_Sendrecv's is.
        if source.shape != out.shape or source.dtype != out.dtype:
            raise ValueError(f"sendrecv with itself: sent {source.dtype}{list(source.shape)}, but the receive "
                             f"buffer is {out.dtype}{list(out.shape)}; give recvbuf the sent array's shape and dtype")
        np.copyto(out, source)
        return
    sent = mt.send(source, params["dest"], tag=params["tag"])
    mt.recv(source=params["source"], shape=out.shape, dtype=out.dtype, tag=params["tag"], out=out).resolve()
    sent.resolve()


# The held calls, each the collective's own with held=True.
_HELD: dict[str, Callable[[np.ndarray, np.ndarray, dict[str, Any]], mt.CollectiveTensor]] = {
    "all_reduce": lambda source, out, p: mt.all_reduce(source, p["op"], p["devices"], out=out, held=True),
    "broadcast": lambda source, out, p: mt.broadcast(source, root=p["root"], devices=p["devices"], out=out, held=True),
    "all_gather": lambda source, out, p: mt.all_gather(source, devices=p["devices"], out=out, held=True),
    "all_to_all": lambda source, out, p: mt.all_to_all(source, devices=p["devices"], out=out, held=True),
    "gather": lambda source, out, p: mt.gather(source, p["root"], devices=p["devices"], out=out, held=True),
    "reduce": lambda source, out, p: mt.reduce(source, p["op"], root=p["root"], devices=p["devices"], out=out,
                                               held=True),
}
_STARTS = {
    "reduce_scatter": _reduce_scatter,
    "scatter": _scatter,
    "scan": _scan,
    "barrier": _barrier,
    "sendrecv": _sendrecv,
}
