"""The engine that runs a context's collectives: checks, ordering, progress and waiting.

Every collective becomes an `Op`. With the consistency check on, the op first posts a small
non-blocking exchange on its group's *check* communicator; when that completes and agrees,
it posts its data operation on the group's *data* communicator. In groups of up to
`INLINE_RANKS` ranks the check is an all-gather of one row per rank, and an op may carry its
whole input in its row (a small all-reduce): it then posts no data operation at all. Data
operations must be posted in the same order on every rank, so each group keeps a FIFO of ops
whose data is not posted yet, and only the head may post. Checks and data use different communicators, so an
op whose check is late never reorders the data of the ops behind it.

The engine holds every op until MPI is done with its buffers, whether or not anyone still
holds its `CollectiveTensor`; that is what makes dropping a handle safe.
"""

from __future__ import annotations

import functools
import pickle
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .._core.errors import CollectiveTimeoutError, ContextBrokenError, ThreadMisuseError
from .._core.idle import pause
from .._core.mpi import MPI
from .._core.protect import claim
from .._core.records import EngineRecord, GroupRecord, OpRecord
from .._transport.base import Stepper
from .._transport.inline import CARRIED, HEADER_BYTES, INLINE_RANKS, PAYLOAD_BYTES, ROW_BYTES
from .._transport.mpi.pair import doze_for_check, forget_pair, ring_for_check
from .._transport.reduced_check import CHECK_WORDS, check_record, check_reduction, payload_of
from .check import (
    ABANDON,
    ABANDONED_KIND,
    CLOSE_KIND,
    CLOSING,
    FAILED_CALL,
    Record,
    Wait,
    decode_waiting,
    departure_error,
    mismatch_error,
)
from .tracing.ring import AGREED, MOMENT_COMPLETE
from .tracing.tracer import Tracer, mark_posted

if TYPE_CHECKING:
    from .._core.protect import Protection

__all__ = [
    "AGREE_STAGE", "REAP_AFTER", "STATES", "Engine", "Group", "Op", "Owner", "Stepper", "Waker", "WatchedEngine",
    "size_text",
]

# Op states, in the order an op moves through them.
CHECKING = 0  # the consistency check (or metadata exchange) is in flight
QUEUED = 1  # agreed, waiting for the ops before it on the group to post
POSTED = 2  # the data operation is in flight
COMPLETE = 3  # MPI is done; the result is final
FAILED = 4  # the check found a mismatch; nothing was sent

_STATE_NAMES = ("checking", "queued", "posted", "complete", "failed")
STATES = (CHECKING, QUEUED, POSTED, COMPLETE, FAILED)  # for the compiled lane, which builds and reads ops

# Stages of a check: the agreement exchange on the check communicator; then, on the
# detail communicator and only when needed, the per-rank values (all_gatherv's lengths,
# or all_to_all's swapped counts),
# or the sizes and then the bytes of every rank's full record (a mismatch).
_AGREE, _PER_RANK, _DETAIL_SIZES, _DETAIL = 1, 2, 3, 4
AGREE_STAGE = _AGREE  # the stage of a check just posted (the compiled lane posts some)

_REAP_AFTER = 64  # posted ops beyond which each new one reaps the oldest completed ones
REAP_AFTER = _REAP_AFTER  # the compiled lane leaves calls to the Python path from there
_MAX_POSTED = 256  # posted ops beyond which a new one waits for the oldest
# A gathered check row: the agreement hash and the per-rank value, then the payload.
_HEADER = struct.Struct("=qq")
assert _HEADER.size == HEADER_BYTES
_NO_PAYLOAD = bytes(PAYLOAD_BYTES)
_ROW_WORDS = ROW_BYTES // 8


def _row_extremes(rows: bytearray) -> tuple[int, int, int, int]:
    """The least and greatest agreement hash and per-rank value of gathered check rows."""
    first = rows[:HEADER_BYTES]
    for offset in range(ROW_BYTES, len(rows), ROW_BYTES):
        if not rows.startswith(first, offset):
            break
    else:  # the usual case: every row says the same
        value, per_rank = _HEADER.unpack(first)
        return value, value, per_rank, per_rank
    words = memoryview(rows).cast("q")
    hashes, values = words[::_ROW_WORDS].tolist(), words[1::_ROW_WORDS].tolist()
    return min(hashes), max(hashes), min(values), max(values)


def _unpack_details(data: np.ndarray, sizes: list[int]) -> list[dict[str, Any]]:
    details, offset = [], 0
    for size in sizes:
        details.append(pickle.loads(data[offset : offset + size].tobytes()))
        offset += size
    return details


class Group(GroupRecord):
    """One group of ranks of a context, with its communicators and its queue of ops.

    Args:
        members: the members' context ranks, sorted.
        comm: the communicator data travels on.
        check_comm: the communicator checks travel on (a duplicate of `comm`).
        detail_comm: the communicator that gathers the full records of a failed check
            (another duplicate, so that those gathers, posted only on a mismatch, never
            interleave with the checks of later calls).
    """

    # queue, holder and check_seq: the record's (see _core/records.py).
    __slots__ = ("check_comm", "comm", "detail_comm", "extra", "gathers", "members", "rank", "size")

    def __init__(self, members: tuple[int, ...], comm: Any, check_comm: Any, detail_comm: Any = None) -> None:
        self.members = members
        self.comm = comm
        self.check_comm = check_comm
        self.detail_comm = detail_comm if detail_comm is not None else MPI.COMM_NULL
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        # Every member agrees on the size, so all of them post the same kind of check.
        self.gathers = self.size <= INLINE_RANKS
        self.queue: deque[Op] = deque()
        self.check_seq = 0  # checks posted on check_comm so far
        self.extra: dict[str, Any] = {}  # per-group caches of the fast paths
        # A posted op's stepper that has not yet posted its MPI operations (``holding``):
        # no later op's data goes on `comm` before it does.
        self.holder: Any = None

    def describe(self) -> str:
        """The members as text, e.g. ``[0, 1, 2]``."""
        return str(list(self.members))

    def free(self) -> None:
        """Free the group's communicators (idempotent)."""
        for resource in self.extra.values():
            free = getattr(resource, "free", None)
            if free is not None:
                free()
        self.extra.clear()
        forget_pair(self.comm)  # before the handle can be a later communicator's
        for name in ("detail_comm", "check_comm", "comm"):
            comm = getattr(self, name)
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()


class Op(OpRecord):
    """One collective: its buffers, requests and result.

    Args:
        name: the operation, for messages (``"all_reduce"``).
        group: the group it runs on.
        nbytes: bytes of its input, for messages.
        post: starts the data operation(s); returns their MPI requests, or a `Stepper`
            for an algorithm the engine drives step by step (the shared-memory path).
        finish: turns the completed buffers into the result (MEAN division, ...).
        record: what this rank says about the call, or None to skip the check.
        keep: objects (buffers) to keep alive until MPI is done.
        protections: inputs and outputs to protect from writes until MPI is done.
        exchange: learn every rank's `Record.per_rank` before posting (``all_gather``
            needs every rank's length); `post` then receives them, in group order. An
            int64 array of one count per member instead swaps counts: count k goes to
            member k, and `post` receives what each member sent this rank (the receive
            counts of ``all_to_all`` with splits), in group order.
        compare: compare the records (the consistency check); with `exchange` alone the
            per-rank values are only exchanged.
        payload: exactly ``PAYLOAD_BYTES`` bytes to carry in the check's row, in a group
            whose checks gather rows; once the check passes, `post` receives every member's
            row (a bytearray of ``ROW_BYTES`` per member, in group order) instead of a data
            operation being needed, or None when some member's row carried no input (its
            `post` then starts MPI's all-reduce, as that member does).
    """

    __slots__ = ()  # the fields are the record's (see _core/records.py)

    def __init__(
        self,
        name: str,
        group: Group,
        nbytes: int,
        post: Callable[..., list[Any]],
        finish: Callable[[], Any] | None = None,
        record: Record | None = None,
        keep: tuple[Any, ...] = (),
        protections: tuple[Protection, ...] = (),
        exchange: bool | np.ndarray = False,
        compare: bool = True,
        payload: bytes | None = None,
    ) -> None:
        self.name = name
        self.group = group
        self.nbytes = nbytes
        self.post = post
        self.finish = finish
        self.record = record
        self.keep = keep
        self.protections = protections
        self.exchange = exchange
        self.compare = compare and record is not None
        self.payload = payload
        self.requests: list[Any] = []
        self.stepper: Stepper | None = None
        self.state = QUEUED
        self.result: Any = None
        self.error: BaseException | None = None
        self.trace: Any = None  # its span in the trace's ring, when the context traces
        # check_req, check_send, check_recv, check_stage, seq and gathered are set when
        # the check is posted: most ops (no check, or a small unchecked all-reduce) never
        # need them, and every assignment costs on the path of the smallest messages.

    def describe(self) -> str:
        """The op for messages: name, size and group."""
        return f"{self.name} of {size_text(self.nbytes)} on group {self.group.describe()}"

    @property
    def state_name(self) -> str:
        """The state as a word."""
        return _STATE_NAMES[self.state]


def size_text(nbytes: int) -> str:
    """`nbytes` in words, for messages: ``32 B``, ``4.0 MiB``, ``256.0 TiB``."""
    for unit, scale in (("EiB", 1 << 60), ("PiB", 1 << 50), ("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20),
                        ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


class Owner(Protocol):
    """What the engine uses of its context (`DistributedContext` is one), so it need not import it.

    Attributes:
        usable: neither closed nor broken.
        config: the `DistributedConfig`.
        timeout: the default timeout of waits (None: none).
        rank: this rank in the context.
        diagnosis: the group-mismatch diagnosis, or None.
    """

    usable: bool
    config: Any
    timeout: float | None
    rank: int
    diagnosis: Any

    def ensure_usable(self) -> None:
        """Raise the error that says why the context cannot be used."""

    def mark_broken(self, why: str) -> None:
        """Break the context: every later call raises `ContextBrokenError` saying `why`."""

    def abort(self, errorcode: int = 1) -> None:
        """End the job on every rank."""


class Waker(Protocol):
    """A progress thread, as the engine sees it: told when a large operation was posted."""

    def wake(self, nbytes: int) -> None:
        """Start polling (for an operation of `nbytes` bytes)."""


class Engine(EngineRecord):
    """Runs the ops of one context.

    Args:
        ctx: the context (for its groups, config and broken state).
    """

    def __init__(self, ctx: Owner) -> None:
        self.ctx = ctx
        self.lock = threading.RLock()
        # Whether this thread holds the lock: only a signal handler (or a finalizer) that
        # interrupted the engine's own bookkeeping can call back in while it does.
        self._owned = self.lock._is_owned
        # What compiled code calls of the engine (see _core/records.py): its lock's methods, and
        # its own functions for a check that did not agree at once, an MPI error, a lost check.
        self.lock_acquire, self.lock_release, self.lock_owned = self.lock.acquire, self.lock.release, self._owned
        self.await_check = self.await_queued_check
        self.mpi_failed_hook = self.mpi_failed
        self.mark_broken_hook = ctx.mark_broken
        self.posted: list[Op] = []  # ops whose data is in flight
        self.waiting_groups: set[Group] = set()  # groups with a non-empty queue
        self.stepping = 0  # posted ops driven by steps rather than by MPI alone
        self.checks_posted = 0  # on every group, for the failed turns of `_entry`
        self.progress_thread: Waker | None = None
        self.spin_pauses = SPIN_PAUSES  # see `Backoff`; the context sets it for its node
        self.tracer: Tracer | None = None  # records every op submitted, when the context traces
        # The context's fault tolerance (faults.Faults), or None: MPI's errors are then all
        # ContextBrokenError, and nothing of it is on any path.
        self.faults: Any = None

    # -- starting ----------------------------------------------------------------------

    def submit(self, op: Op, grace: float | None = None) -> None:
        """Start `op`: post its check (or its data, when nothing must come first).

        Waits up to `grace` seconds (the context's ``check_grace`` when None) for the
        check, so that a mismatch is usually raised here, by the call that caused it.

        Raises:
            CollectiveMismatchError: the check completed within the grace and disagreed.
            ThreadMisuseError: called from a signal handler that interrupted the engine
                (`reentered`); nothing is posted.
        """
        ctx = self.ctx
        if not ctx.usable:
            ctx.ensure_usable()
        if self._owned():
            raise self.reentered(op.name)
        if self.tracer is not None:
            op.trace = self.tracer.begin(op)
        if op.protections:
            claim(op.protections)  # the op's now: its completion lifts them, not its call's failure
        group = op.group
        lock = self.lock
        # acquire/release rather than `with`: half the cost, on the path of every call.
        lock.acquire()
        try:
            idle = not group.queue and (group.holder is None or not self._held(group))
            direct = op.record is None and idle
            if direct:
                self._post_data(op)  # a failure to post is raised by resolve()
            else:
                spun = self._enqueue(op, idle)
        finally:
            lock.release()
        if direct:
            if len(self.posted) > _MAX_POSTED:
                self._hold_back()
            return
        self._await_check(op, grace, spun)

    def await_queued_check(self, op: Op, spun: bool) -> None:
        """Go on as `submit` does with an op whose check and queueing were done outside it.

        The compiled lane posts the check of a checked all-reduce of up to 64 KiB itself,
        as `_post_check` does (the op in state CHECKING, with its ``seq``, ``check_send``,
        ``check_recv``, ``check_req``, ``check_stage`` and ``post``), on an idle group, and
        spins on it; when the rows did not all agree within that spin, it queues the op as
        `_queue` does (at the head of the group's queue, the group waiting), under the same
        hold of the lock, so that no signal handler can run between the check and its op.
        The call then comes here and waits for its check within the grace, as any other
        (its data is posted by ``op.post`` once the check agrees).

        Args:
            op: the op, its check posted and the op queued.
            spun: whether the call has spun on the check already.

        Raises:
            CollectiveMismatchError: the check completed within the grace and disagreed.
            ContextBrokenError: MPI failed while the queue was pumped.
        """
        self._await_check(op, None, spun)

    def lock_held_here(self) -> bool:
        """Whether this thread holds the engine's lock (then only `reentered` calls come in)."""
        return self._owned()

    def reentered(self, what: str) -> ThreadMisuseError:
        """The error of `what` (a collective, ``resolve()``...) called while this thread is inside the engine.

        The engine's lock is reentrant, for the engine's own nested calls; a call from
        outside that finds it held by its own thread comes from a signal handler (or a
        finalizer) that interrupted the engine halfway through posting or completing an
        op. Let in, it would change the engine's state under the interrupted code (an op
        posted but not yet registered, a list of posted ops being rebuilt), which ends in
        a hang or a wait that times out inside some op's data; so it is refused, and
        nothing is changed.
        """
        return ThreadMisuseError(
            f"{what} was called while this thread was inside mpitensor's engine (posting or "
            "completing a collective), from a signal handler or finalizer that interrupted it: "
            "collectives, resolve() and test() may not be re-entered from there. Set a flag in the "
            "handler and act on it after the interrupted call returns"
        )

    def _await_check(self, op: Op, grace: float | None, spun: bool) -> None:
        """Wait up to the grace for a queued op's check; raise its error if it failed."""
        if op.state == CHECKING:
            self._wait_check(op, self.ctx.config.check_grace if grace is None else grace, spun)
        if op.state == FAILED:
            assert op.error is not None
            raise op.error

    def _enqueue(self, op: Op, idle: bool) -> bool:
        """Post `op`'s check, if it has one, and queue `op` on its group (call with the lock held).

        An op that carries its input in its check, on an `idle` group, first tries
        `_carried_at_once`; it is not queued if that completes it.

        Returns:
            Whether the call has spun on the check already (`_wait_check` then yields at once).

        Raises:
            ContextBrokenError: MPI failed to post the check (the context is then broken).
        """
        spun = False
        try:
            if op.record is None:
                op.state = QUEUED
            else:
                self._post_check(op)
                if idle and op.payload is not None and not self.stepping:
                    spun = True
                    if self._carried_at_once(op):
                        return spun
            self._queue(op)
        except MPI.Exception as exc:
            raise self.mpi_failed(exc, op) from exc
        return spun

    def _queue(self, op: Op) -> None:
        """Queue `op` on its group, its check (if any) posted (call with the lock held)."""
        group = op.group
        group.queue.append(op)
        self.waiting_groups.add(group)
        if op.state != CHECKING or group.queue[0] is not op:
            self._pump(group)  # else _wait_check pumps, once the check had time to meet

    def _post_check(self, op: Op) -> None:
        group = op.group
        op.state = CHECKING
        op.seq = group.check_seq
        group.check_seq += 1
        self.checks_posted += 1
        record = op.record
        assert record is not None
        # Every check of a group has one shape, whatever the collective (and whether it
        # carries a payload), so that two different collectives meet as a mismatch rather
        # than as mismatched MPI calls.
        value = record.check_value() if op.compare else 0
        if group.gathers:
            payload = op.payload
            per_rank = record.per_rank if payload is None else CARRIED
            op.check_send = _HEADER.pack(value, per_rank) + (_NO_PAYLOAD if payload is None else payload)
            op.check_recv = bytearray(ROW_BYTES * group.size)
            op.check_req = group.check_comm.Iallgather(op.check_send, op.check_recv)
            if group.size == 2:
                ring_for_check(group.comm, group.check_seq)
        else:
            # One record of header, code and payload, reduced by mpitensor's own op (see reduced_check).
            op.check_send = check_record(value, record.per_rank, op.payload)
            op.check_recv = np.empty(CHECK_WORDS, np.int64)
            datatype, reduction = check_reduction()
            op.check_req = group.check_comm.Iallreduce([op.check_send, 1, datatype], [op.check_recv, 1, datatype],
                                                       reduction)
        op.check_stage = _AGREE

    def _carried_at_once(self, op: Op) -> bool:
        """Complete `op`, which carries its input in its check, if the check agrees within a spin.

        For an op at the head of an idle group (call with the lock held), its check just
        posted. The usual case of a small checked all-reduce: every member's row says what
        this rank's says (the same call, each carrying its input), and `op` is reduced and
        complete without entering the queue. Otherwise (late, or rows that differ) the
        caller queues it and the check goes on as any other.
        """
        if not _spin(op.check_req, self.check_spins()):
            return False
        if op.group.gathers:
            rows = op.check_recv
            header = op.check_send[:HEADER_BYTES]
            for offset in range(0, len(rows), ROW_BYTES):
                if not rows.startswith(header, offset):
                    return False  # completed: `_advance_check` tests it again, and it tests True
            op.gathered = rows
        else:
            received = op.check_recv
            if received[0] != -received[1] or received[0] != op.check_send[0]:
                return False  # `_advance_check` finds out what differs
            op.gathered = payload_of(received, op.check_send)
        self._check_passed(op)
        self._post_data(op)
        return True

    def _advance_check(self, op: Op) -> bool:
        """Move `op`'s check along; True once it has passed (or failed)."""
        if op.state != CHECKING:
            return True
        if not op.check_req.Test():
            return False
        group = op.group
        stage = op.check_stage
        received = op.check_recv
        if stage == _AGREE:
            return self._agreed(op, received)
        if stage == _PER_RANK:
            op.gathered = [int(v) for v in received]
        elif stage == _DETAIL_SIZES:
            sizes = [int(v) for v in received]
            op.check_recv = np.empty(sum(sizes), np.uint8)
            displacements = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
            op.check_req = group.detail_comm.Iallgatherv(
                [op.check_send, MPI.BYTE], [op.check_recv, sizes, displacements, MPI.BYTE]
            )
            op.check_sizes = sizes
            op.check_stage = _DETAIL
            return False
        else:
            details = _unpack_details(received, op.check_sizes)
            op.error = mismatch_error(details, group.members)
            self._fail(op)
            self._answer_abandoners(op, details)
            return True
        self._check_passed(op)
        return True

    def _agreed(self, op: Op, received: Any) -> bool:
        """The agreement stage of `op`'s check has completed: act on it (see `_advance_check`)."""
        group = op.group
        if group.gathers:
            low, high, shortest, longest = _row_extremes(received)
        else:
            words = np.frombuffer(received, np.int64)  # the compiled lane's bytes, or the engine's array
            low, high = int(words[0]), -int(words[1])
            shortest, longest = int(words[2]), -int(words[3])
        if low == CLOSING and high != CLOSING:
            self._met_departure(op, -shortest - 1)
            return True
        if low != high or low == ABANDON:
            self._gather_detail_sizes(op)
            return False
        if low == FAILED_CALL:  # every rank's call failed on that rank, and each raised there
            self._fail(op)
            return True
        if op.payload is not None:
            # Every member's row, payload included (a large group's check: every payload
            # reduced); None if some member carried no input (it reduces through MPI, and so
            # must this rank).
            if group.gathers:
                op.gathered = received if shortest == longest == CARRIED else None
            else:
                op.gathered = payload_of(received, op.check_send)
        elif op.exchange is not False and op.exchange is not True:
            # Counts to swap: posted on the detail communicator, in call order, like
            # every later stage, so the data that depends on them keeps its order.
            op.check_send = op.exchange
            op.check_recv = np.empty(group.size, np.int64)
            op.check_req = group.detail_comm.Ialltoall(op.check_send, op.check_recv)
            op.check_stage = _PER_RANK
            return False
        elif op.exchange and shortest != longest:
            if not group.gathers:
                # The per-rank values differ (all_gatherv's lengths): gather them. Posted on
                # the detail communicator, in call order, like every later stage.
                op.check_send = np.array([op.record.per_rank], np.int64)
                op.check_recv = np.empty(group.size, np.int64)
                op.check_req = group.detail_comm.Iallgather(op.check_send, op.check_recv)
                op.check_stage = _PER_RANK
                return False
            op.gathered = memoryview(received).cast("q")[1::_ROW_WORDS].tolist()  # they came in the rows
        else:
            op.gathered = [shortest] * group.size
        self._check_passed(op)
        return True

    def _met_departure(self, op: Op, departed: int) -> None:
        """Some rank closed the context while others called `op`: every member learns it here.

        No further exchange: the departed rank would not answer it. The context can run
        no more collectives (a later close skips its own check).
        """
        error = departure_error(departed, op.group.members, op.name)
        if op.name != CLOSE_KIND:  # the closing rank itself goes on closing
            self.ctx.mark_broken(str(error))
        op.error = error
        self._fail(op)

    def _gather_detail_sizes(self, op: Op) -> None:
        """The ranks disagree: exchange the full records to say exactly what differs."""
        assert op.record is not None
        payload = pickle.dumps(op.record.detail(), protocol=pickle.HIGHEST_PROTOCOL)
        op.check_send = np.frombuffer(payload, np.uint8)
        size = np.array([len(payload)], np.int64)
        op.check_recv = np.empty(op.group.size, np.int64)
        op.check_req = op.group.detail_comm.Iallgather(size, op.check_recv)
        op.check_sizes = size  # kept alive until the gather completes
        op.check_stage = _DETAIL_SIZES

    def _answer_abandoners(self, op: Op, details: list[dict[str, Any]]) -> None:
        """Members that abandoned this check are stuck elsewhere waiting for this rank."""
        diagnosis = self.ctx.diagnosis
        if diagnosis is None or op.record is None or op.record.kind == ABANDONED_KIND:
            return
        mine = Wait(op.group.members, op.seq, False, op.name)
        for member, detail in zip(op.group.members, details):
            waiting = decode_waiting(detail)
            if waiting is not None:
                diagnosis.answer(member, waiting, mine)

    def _check_passed(self, op: Op) -> None:
        op.state = QUEUED
        op.check_req = None
        if op.trace is not None:
            op.trace.mark(AGREED)

    def _fail(self, op: Op) -> None:
        op.state = FAILED
        op.check_req = None
        self._release(op)
        if op.trace is not None:
            op.trace.mark(MOMENT_COMPLETE)

    def _post_data(self, op: Op) -> None:
        try:
            started = op.post(op.gathered) if op.exchange is not False or op.payload is not None else op.post()
        except MPI.Exception as exc:
            op.error = self.mpi_failed(exc, None, f"the start of {op.describe()}")
            self._fail(op)
            return
        except BaseException as exc:
            op.error = exc
            self._fail(op)
            return
        if isinstance(started, list):
            op.requests = started
        else:
            op.stepper = started
            self.stepping += 1
            if getattr(started, "holding", False):
                op.group.holder = started
        if op.trace is not None:
            mark_posted(op)
        if op.requests or op.stepper is not None:
            op.state = POSTED
            self.posted.append(op)
            if len(self.posted) > _REAP_AFTER:
                self._reap_oldest()
            if self.progress_thread is not None:
                self.progress_thread.wake(op.nbytes)
        else:
            self._complete(op)

    def _pump(self, group: Group) -> None:
        """Post the data of the ops at the head of `group`'s queue that may go.

        Checks are examined strictly in call order: a failed check posts a gather of the
        full records, and every member must post those gathers in the same order.
        """
        queue = group.queue
        while queue:
            head = queue[0]
            if head.state == CHECKING and not self._advance_check(head):
                break
            if head.state == QUEUED and self._held(group):
                self._advance_checks_behind(queue)
                break
            queue.popleft()
            if head.state == QUEUED:
                self._post_data(head)
        if not queue:
            self.waiting_groups.discard(group)

    @staticmethod
    def _held(group: Group) -> bool:
        """Whether an op of `group` waits to post its MPI operations (a GPU input in the making)."""
        holder = group.holder
        if holder is not None and holder.holding:
            return True
        group.holder = None
        return False

    def _advance_checks_behind(self, queue: deque[Op]) -> None:
        """Advance the checks of the ops queued behind a held one, in call order (their data waits)."""
        for op in list(queue)[1:]:
            if op.state == CHECKING and not self._advance_check(op):
                return

    # -- progress and completion ---------------------------------------------------------

    def progress(self) -> None:
        """Advance everything in flight without blocking.

        Raises:
            ContextBrokenError: MPI reported an error (the context is then broken).
        """
        with self.lock:
            try:
                for group in list(self.waiting_groups):
                    self._pump(group)
                if self.posted:
                    self._reap()
            except MPI.Exception as exc:
                raise self.mpi_failed(exc, None) from exc

    def _reap(self) -> None:
        """Complete the posted ops that MPI is done with (call with the lock held)."""
        still = []
        for op in self.posted:
            if op.stepper.advance() if op.stepper is not None else MPI.Request.Testall(op.requests):
                self._complete(op)
            else:
                still.append(op)
        self.posted = still

    def _reap_oldest(self) -> None:
        """Complete the oldest posted ops that MPI is done with (call with the lock held).

        Called as ops are posted while many are in flight (handles dropped unresolved, as
        in fire-and-forget logging): each call drives MPI's progress once, and the
        completed ops give their buffers back to the pool. A rank that runs more than
        `_MAX_POSTED` ops ahead waits for its oldest (`_hold_back`), which bounds the
        memory they hold.
        """
        posted = self.posted
        while posted:
            op = posted[0]
            if op.stepper is not None or not MPI.Request.Testall(op.requests):
                return
            del posted[0]
            self._complete(op)

    def _hold_back(self) -> None:
        """Wait for the oldest posted op while more than `_MAX_POSTED` are in flight."""
        while len(self.posted) > _MAX_POSTED:
            self.wait(self.posted[0], self.ctx.timeout)

    def mpi_failed(self, exc: BaseException, op: Op | None, what: str = "a collective in flight") -> ContextBrokenError:
        """The error for an MPI failure inside `op` (or in `what`), breaking the context.

        Args:
            exc: MPI's exception.
            op: the op it happened in, if known.
            what: what was running otherwise.

        Returns:
            The `ContextBrokenError` to raise: a `RankFailedError` where the context is fault
            tolerant and the error says that a rank died (every pending op of the context
            then fails with it, and its communicators are revoked; see `faults.Faults`).
        """
        if op is not None:
            what = op.describe()
        faults = self.faults
        if faults is not None and faults.is_failure(exc):
            return faults.failed(what)
        message = f"MPI failed in {what} on rank {self.ctx.rank}: {exc}"
        self.ctx.mark_broken(message)
        return ContextBrokenError(message)

    def fail_pending(self, error: Callable[[], BaseException]) -> list[Any]:
        """Fail every op that is not complete with a fresh `error()`, for good (a rank of the context died).

        Queued and posted ops alike: their handles resolve with the error, their inputs are
        writable again; nothing is queued or posted afterwards.

        Returns:
            What MPI may still hold of them (requests, buffers, steppers), for the caller to keep.
        """
        held: list[Any] = []
        with self.lock:
            pending = list(self.posted)
            for group in list(self.waiting_groups):
                pending.extend(group.queue)
                group.queue.clear()
                group.holder = None
            self.waiting_groups.clear()
            del self.posted[:]
            self.stepping = 0
            for op in pending:
                if op.state >= COMPLETE:
                    continue
                held.append((op.requests, op.keep, op.stepper, getattr(op, "check_req", None),
                             getattr(op, "check_recv", None), getattr(op, "check_send", None)))
                op.requests = []
                op.stepper = None
                op.error = error()
                self._fail(op)
        return held

    def _complete(self, op: Op) -> None:
        if op.trace is not None:
            op.trace.mark(MOMENT_COMPLETE)
        op.requests = []
        if op.stepper is not None:
            op.stepper = None
            self.stepping -= 1
        if op.protections:
            self._release(op)
        else:
            op.keep = ()
        try:
            op.result = op.finish() if op.finish is not None else None
        except BaseException as exc:
            op.error = exc
            op.state = FAILED
            return
        op.state = COMPLETE

    def _release(self, op: Op) -> None:
        protections, op.protections = op.protections, ()
        for protection in protections:
            protection.release()
        op.keep = ()

    def post_abandon(self, group: Group, record: Record) -> None:
        """Post a check that stands in for a collective this rank will never call.

        The diagnosis uses it when a peer waits on `group` for this rank, which waits for
        that peer elsewhere: the check completes as a mismatch on every member, and the
        group's sequence of checks stays aligned.
        """
        # Not pumped here: the diagnosis posts it while the engine examines checks.
        self.post_stand_in("abandoned", group, record, pump=False)

    def post_stand_in(self, name: str, group: Group, record: Record, pump: bool = True) -> Op:
        """Post a check for a call that moves no data: it only tells the peers `record`.

        Used for a call that failed on this rank (`Record.failure`), an abandoned check,
        and the context's close; the returned op completes (or fails) like any other.
        """
        op = Op(name, group, 0, lambda: [], record=record)
        if self.tracer is not None:
            # Recorded as the call it stands in for is on the peers: each member's sequence
            # of the group's collectives stays the same, which the trace matches them by.
            op.trace = self.tracer.begin(op)
        with self.lock:
            try:
                self._post_check(op)
                group.queue.append(op)
                self.waiting_groups.add(group)
                if pump:
                    self._pump(group)
            except MPI.Exception as exc:
                raise self.mpi_failed(exc, op) from exc
        return op

    def see_stand_in_through(self, op: Op, grace: float) -> None:
        """Make sure the peers learn what a stand-in check (a failed call) tells them.

        A peer that finds the ranks disagree builds its error from every member's full
        record, an exchange this rank must take part in: if its program went on to block
        (in raw MPI, a long compute, a read), the peers would wait in vain. So this waits up
        to `grace` for the check, as every call does, and if a peer is later than that, a
        daemon thread goes on pumping the engine until the check is over (or the context
        cannot go on). Without ``MPI_THREAD_MULTIPLE`` no thread may call MPI beside the
        program, and the exchange completes at this rank's next call into mpitensor.

        Args:
            op: the op `post_stand_in` returned.
            grace: seconds to wait here first.
        """
        self._wait_check(op, grace)
        if op.state != CHECKING or MPI.Query_thread() != MPI.THREAD_MULTIPLE:
            return
        threading.Thread(target=self._see_through, args=(op,), name="mpitensor-failed-turn", daemon=True).start()

    def _see_through(self, op: Op) -> None:
        while op.state == CHECKING and self.ctx.usable:
            if self.lock.acquire(blocking=False):
                try:
                    self.progress()
                except Exception:  # the program's own next call reports MPI's failure
                    return
                finally:
                    self.lock.release()
            # The peers are late (past the grace): polling every half millisecond costs
            # little beside whatever this rank's program does meanwhile.
            time.sleep(5e-4)

    def protect_outputs(self, op: Op, value: Any) -> None:
        """Make `value`'s tensors refuse writes until `op` completes (for assume_resolved)."""
        from .._core.protect import Protection
        from .._core.tensor import Tensor

        with self.lock:
            if op.state >= COMPLETE:
                return
            leaves = value.values() if isinstance(value, dict) else value
            if isinstance(value, Tensor) or value is None:
                leaves = [value]
            added = tuple(Protection(t, t.array) for t in leaves if isinstance(t, Tensor) and not t.in_flight)
            op.protections = (*op.protections, *added)

    def busy(self) -> bool:
        """True if anything is in flight or queued."""
        return bool(self.posted or self.waiting_groups)

    # -- waiting ---------------------------------------------------------------------------

    def wait(self, op: Op, timeout: float | None) -> None:
        """Block until `op` is complete or failed.

        Raises:
            CollectiveTimeoutError: `timeout` seconds passed first (the context is then
                broken).
            ThreadMisuseError: called from a signal handler that interrupted the engine
                (`reentered`); nothing is changed.
            KeyboardInterrupt: (or whatever a signal handler raises) the wait was
                interrupted; `op` is still tracked, and a later wait goes on with it.
            The op's error, if it failed.
        """
        if op.state < COMPLETE:
            if self._owned():
                raise self.reentered("resolve()")
            if op.state == POSTED and timeout is None and not self.waiting_groups and not self.stepping:
                # Nothing is queued anywhere and no step-driven op is in flight, so no peer
                # waits for this rank to post or to step: waiting on the op's requests alone
                # (testing them progresses every MPI request) is safe, and the fastest.
                lock = self.lock
                lock.acquire()  # as in submit
                try:
                    if op.state == POSTED and not self.waiting_groups:
                        self._wait_posted_op(op)
                finally:
                    lock.release()
            if op.state < COMPLETE:
                self._poll_until(lambda: op.state >= COMPLETE, timeout, op)
        if op.state == FAILED:
            assert op.error is not None
            raise op.error

    def _wait_posted_op(self, op: Op) -> None:
        """Wait inside MPI until posted `op` is done, and complete it (call with the lock held).

        The requests are tested in a loop, not given to a blocking ``MPI_Wait``: one would
        hold Ctrl-C (and every other signal's Python handler) until the peers arrive.
        Between two tests Python runs the handlers; an exception one raises
        (``KeyboardInterrupt``) ends the wait with the op still posted and tracked, and a
        later `resolve()` waits for it again. (A request that has completed tests True
        again, so an interrupt after the last test leaves the op as resolvable.)
        """
        requests = op.requests
        try:
            test = requests[0].Test if len(requests) == 1 else functools.partial(MPI.Request.Testall, requests)
            if not test():
                backoff = Backoff(self.spin_pauses)
                while not test():
                    backoff.pause()
        except MPI.Exception as exc:
            raise self.mpi_failed(exc, op) from exc
        try:
            self.posted.remove(op)
        except ValueError:  # an interrupt landed after this line, in an earlier wait for it
            pass
        if op.finish is None and not op.protections:
            # What _complete does for the plain case, inlined: this is the end of every
            # small all-reduce.
            op.requests = []
            op.keep = ()
            op.state = COMPLETE
            if op.trace is not None:
                op.trace.mark(MOMENT_COMPLETE)
        else:
            self._complete(op)

    def wait_posted(self, op: Op, timeout: float | None) -> None:
        """Block until `op`'s data is posted (or it completed or failed)."""
        if op.state < POSTED:
            if self._owned():
                raise self.reentered("assume_resolved()")
            self._poll_until(lambda: op.state >= POSTED, timeout, op)

    def _wait_check(self, op: Op, grace: float, spun: bool = False) -> None:
        deadline = time.monotonic() + grace
        # Spinning on the check is for the first round only, and only if the call has not
        # spun already: where ranks outnumber cores, the peer it waits for needs this core.
        backoff = Backoff(self.spin_pauses) if spun else None
        group = op.group
        while op.state == CHECKING:
            with self.lock:
                if group.queue and group.queue[0] is op:
                    try:
                        if backoff is None and not self.stepping:
                            # The usual case: only this check is awaited, and nothing in
                            # flight needs this rank's steps, so testing the check alone for
                            # a while is enough (a completed request tests True again). Only
                            # at first: a check that takes longer waits for a peer, which on
                            # an oversubscribed node needs this rank to yield its core soon.
                            _spin(op.check_req, self.check_spins())
                        self._pump(group)
                    except MPI.Exception as exc:
                        raise self.mpi_failed(exc, op) from exc
                else:
                    self.progress()
            if op.state != CHECKING or time.monotonic() >= deadline:
                return
            if backoff is None:
                backoff = Backoff(self.spin_pauses)
            # Where the check itself is what this rank waits for: see doze_for_check.
            at_head = group.size == 2 and group.queue and group.queue[0] is op
            if not (at_head and doze_for_check(group.comm, op.seq + 1)):
                backoff.pause()

    def check_spins(self) -> int:
        """How many times a call tests its check before it yields: few where ranks outnumber cores."""
        return _SPINS if self.spin_pauses >= SPIN_PAUSES else OVERSUBSCRIBED_SPINS

    def drain(self, timeout: float | None) -> None:
        """Block until nothing is in flight (used by close()).

        Raises:
            CollectiveTimeoutError: `timeout` passed first.
            ThreadMisuseError: called from a signal handler that interrupted the engine.
        """
        if self._owned():
            raise self.reentered("close()")
        self._poll_until(lambda: not self.busy(), timeout, None)

    def _poll_until(self, done: Callable[[], bool], timeout: float | None, op: Op | None) -> None:
        thread = self.progress_thread
        if thread is not None and thread.error is not None:
            if self.faults is not None and self.faults.lost:
                raise self.faults.again() from thread.error  # the thread met a rank's death
            message = f"the progress thread failed: {thread.error!r}"
            self.ctx.mark_broken(message)
            raise ContextBrokenError(message) from thread.error
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        backoff = Backoff(self.spin_pauses)
        diagnosis = self.ctx.diagnosis
        while True:
            self.progress()
            if done():
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._timed_out(op, timeout, now - start)
            if diagnosis is not None:
                try:
                    diagnosis.on_wait(op, now - start)
                except MPI.Exception as exc:
                    raise self.mpi_failed(exc, op, "the group-mismatch diagnosis") from exc
            backoff.pause()

    def _timed_out(self, op: Op | None, timeout: float | None, waited: float) -> None:
        if op is not None:
            what = op.describe()
            stage = "its consistency check" if op.state == CHECKING else f"the data ({op.state_name})"
        else:
            pending = list(self.posted) + [o for g in self.waiting_groups for o in g.queue]
            what = ", ".join(o.describe() for o in pending[:4]) or "nothing"
            stage = "close()"
        message = (
            f"{what} did not complete within {timeout:g} s (waited {waited:.1f} s in {stage}): "
            "some rank of the group has not called it, or is stuck. MPI cannot cancel a "
            "started collective, so this context is now broken: further use raises "
            "ContextBrokenError; call ctx.abort() to end the job."
        )
        self.ctx.mark_broken(message)
        raise CollectiveTimeoutError(message)


class WatchedEngine(Engine):
    """The engine of a context that asks for fault tolerance (``on_rank_failure="raise"``).

    Before each call it asks MPI whether a rank of the context died or a peer revoked the
    context (`faults.Faults.poll`): a survivor whose collectives run on a sub-group that the
    dead rank is not in learns of it at its next call. Contexts without fault tolerance use
    `Engine`, whose calls pay nothing for it.
    """

    def submit(self, op: Op, grace: float | None = None) -> None:
        """`Engine.submit`, once MPI has said that no rank of the context died (else `RankFailedError`)."""
        faults = self.faults
        if faults is not None:
            faults.poll(op)
        super().submit(op, grace)


_SPINS = 64  # tests of a check's request between rounds of the engine's progress
OVERSUBSCRIBED_SPINS = 16  # the same where the node has more ranks than cores
# Pauses of a wait that only spin before it yields the core: few where the node has more
# ranks than cores (the peer waited for may need this core), more where each rank has one.
SPIN_PAUSES = 50
OVERSUBSCRIBED_SPIN_PAUSES = 4


def _spin(request: Any, spins: int) -> bool:
    """Test `request` until it completes, at most `spins` times; whether it did."""
    test = request.Test
    # A loop, not any() over a generator: resuming a generator costs on every test.
    for _ in range(spins):  # noqa: SIM110
        if test():
            return True
    return False


class Backoff:
    """Spin briefly, then give the core back, then sleep in short pauses.

    Waiting ranks leave the CPU to others this way: with more ranks than cores, or other
    programs running, the peer a rank waits for may need its core (`_core.idle.pause`: a
    yield, or a short sleep where another program contends for the core). Pauses stay short
    (at most 100 us), since what a rank waits for usually arrives within microseconds once its
    peers run.

    Args:
        spins: pauses that only spin before the first yield (`SPIN_PAUSES`, or
            `OVERSUBSCRIBED_SPIN_PAUSES` where the node has more ranks than cores).
    """

    __slots__ = ("count", "spins")

    def __init__(self, spins: int = SPIN_PAUSES) -> None:
        self.count = 0
        self.spins = spins

    def pause(self) -> None:
        self.count += 1
        if self.count < self.spins:
            return
        if self.count < 5000:
            pause()
            return
        time.sleep(min(1e-4, 1e-6 * (self.count - 4990)))

