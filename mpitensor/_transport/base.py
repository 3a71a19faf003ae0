"""What a transport is: the description of one call, and the interface every transport has.

A collective prepares its call once (input, reduce plan, group) into a `ReduceCall`, asks
`select` for the first transport of its operation's ordered list whose `applies(call)` is
True, lets that transport `prepare(call)` (take the buffers it sends from and reduces into),
and hands `start` to the engine, which calls it in the group's data order once the
consistency check has passed. `start` returns MPI requests, or a `Stepper` the engine drives.

Transports see the runtime only through the small protocols below, which the runtime's
objects satisfy: this layer never imports the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

__all__ = ["Channel", "HeldBuffers", "Host", "PrivateCopy", "ReduceCall", "Stepper", "Transport", "select"]


class Stepper(Protocol):
    """An algorithm the engine drives in steps instead of waiting on MPI requests.

    A stepper may also have a ``holding`` attribute: while it is True, the stepper has not
    yet posted its MPI operations (it waits for its input, as `gpu.after_event.AfterEvent`
    does), and the engine posts no later operation's data on the same group until it is
    False, so that every rank posts on the group's communicator in the same order.
    """

    def advance(self) -> bool:
        """Do whatever can be done now without blocking; True once finished."""


class Channel(Protocol):
    """What a transport uses of a group: its data communicator and a cache of its own.

    Attributes:
        comm: the communicator data travels on.
        rank: this rank's rank in it.
        size: its number of ranks.
        members: the members' context ranks, in group order.
        extra: per-group state of the transports, keyed by transport (freed with the group:
            a value with a ``free()`` method has it called).
    """

    comm: Any
    rank: int
    size: int
    members: tuple[int, ...]
    extra: dict[str, Any]


class Host(Protocol):
    """What a transport uses of the context: its buffer pool, settings and host names.

    Attributes:
        pool: the host buffer pool (``empty(shape, dtype)``).
        config: the `DistributedConfig` (``shared_memory``).
        hosts: every context rank's host name.
        engine: the engine (``progress_thread``: whether one runs beside the program).
    """

    pool: Any
    config: Any
    hosts: Sequence[str]
    engine: Any


class ReduceCall:
    """One reduction as transports see it.

    The collective fills the first fields; the transport chosen fills the buffers in
    `Transport.prepare`.

    Attributes:
        ctx: the context (as a `Host`).
        group: the group (as a `Channel`).
        source: the input: ``.array`` (as given), ``.buffer`` (contiguous, native order),
            ``.copied`` and ``.guard(ctx)`` (protects it, or swaps in a private copy).
        plan: the `ReducePlan` (MPI op and datatype, work and result dtypes, codec).
        nbytes: the input's size in bytes.
        send: the buffer the transport reduces from (set by `prepare`).
        out: the buffer the reduction lands in (set by `prepare`).
        final: the result array: `out`, or the array half precision is rounded back into.
        protections: what keeps the input unchanged until the transport is done.
        decoded: True when `out` holds final values (no MAX/MIN keys to decode).
        extra: the transport's own state of this call (the shared-memory block).
        transport: the transport `select` chose.
    """

    __slots__ = (
        "ctx", "decoded", "extra", "final", "group", "nbytes", "out", "plan", "protections", "send", "source",
        "transport",
    )

    def __init__(self, ctx: Host, group: Channel, source: Any, plan: Any, nbytes: int) -> None:
        self.ctx = ctx
        self.group = group
        self.source = source
        self.plan = plan
        self.nbytes = nbytes
        self.protections: tuple[Any, ...] = ()
        self.decoded = False
        self.extra: Any = None

    def start(self) -> list[Any] | Stepper:
        """Start the chosen transport's data movement (the engine calls it as the op's ``post``)."""
        return self.transport.start(self)

    def start_from(self, rows: Any) -> list[Any] | Stepper:
        """`start` for a call whose post takes what its consistency check gathered.

        Args:
            rows: what the engine hands to the op's ``post``: for a call whose data
                travelled in its check (`inline.InCheck`), every member's gathered check
                row, or None when some member's row carried no input (see `inline`); for a
                held all-reduce of 2 ranks (`mpi.all_reduce.Held`), every member's per-rank
                value (whether its core is contested).
        """
        return self.transport.start(self, rows)


class PrivateCopy:
    """An input that is already a private host copy (a staged GPU tensor): nothing to protect.

    Args:
        array: the contiguous host array.
    """

    __slots__ = ("array", "buffer", "copied")

    def __init__(self, array: Any) -> None:
        self.array = self.buffer = array
        self.copied = True

    def guard(self, ctx: Any) -> tuple[Any, ...]:
        """Nothing to protect: the copy is private."""
        return ()


class HeldBuffers:
    """An input and a result buffer that their caller holds unchanged until the call completes.

    Nobody writes `array` or reads `out` meanwhile (the torch backend's tensors, XLA's
    buffers inside a compiled program), so nothing is protected or copied: MPI reads the
    one and writes the other, which may be the same array (reduced in place).

    Args:
        array: the contiguous host input.
        out: the contiguous host array the result lands in (`array` for in place).
    """

    __slots__ = ("array", "buffer", "copied", "out")

    def __init__(self, array: Any, out: Any) -> None:
        self.array = self.buffer = array
        self.out = out
        self.copied = True

    def guard(self, ctx: Any) -> tuple[Any, ...]:
        """Nothing to protect: the caller holds both buffers."""
        return ()


class Transport(Protocol):
    """A way to move one operation's data.

    Attributes:
        name: a short name for messages and benchmarks.
    """

    name: str

    def applies(self, call: ReduceCall) -> bool:
        """Whether this transport takes `call`; decided from what every rank agrees on."""

    def prepare(self, call: ReduceCall) -> None:
        """Take the buffers (``send``, ``out``, ``final``, ``protections``); in the caller's thread."""

    def start(self, call: ReduceCall) -> list[Any] | Stepper:
        """Start the data movement; called by the engine in the group's data order."""


def select(transports: Sequence[Transport], call: ReduceCall) -> Transport:
    """The first of `transports` that applies to `call`, which it is bound to (``call.start``).

    Raises:
        LookupError: none applies (a list without a catch-all at its end).
    """
    for transport in transports:
        if transport.applies(call):
            call.transport = transport
            return transport
    raise LookupError(f"no transport applies to a call of {call.nbytes} bytes")
