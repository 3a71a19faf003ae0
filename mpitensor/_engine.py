"""The engine that runs a context's collectives: checks, ordering, progress and waiting.

Every collective becomes an `Op`. With the consistency check on, the op first posts a small
non-blocking exchange on its group's *check* communicator; when that completes and agrees,
it posts its data operation on the group's *data* communicator. Data operations must be
posted in the same order on every rank, so each group keeps a FIFO of ops whose data is not
posted yet, and only the head may post. Checks and data use different communicators, so an
op whose check is late never reorders the data of the ops behind it.

The engine holds every op until MPI is done with its buffers, whether or not anyone still
holds its `CollectiveTensor`; that is what makes dropping a handle safe.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._check import ABANDON, ABANDONED_KIND, RECORD_LEN, Record, agreement_hash, decode_waiting, mismatch_error
from ._errors import CollectiveTimeoutError, ContextBrokenError
from ._mpi import MPI

if TYPE_CHECKING:
    from ._context import DistributedContext
    from ._progress import ProgressThread
    from ._protect import Protection

__all__ = ["Engine", "Group", "Op", "Stepper"]

# Op states, in the order an op moves through them.
CHECKING = 0  # the consistency check (or metadata exchange) is in flight
QUEUED = 1  # agreed, waiting for the ops before it on the group to post
POSTED = 2  # the data operation is in flight
COMPLETE = 3  # MPI is done; the result is final
FAILED = 4  # the check found a mismatch; nothing was sent

_STATE_NAMES = ("checking", "queued", "posted", "complete", "failed")


class Stepper(Protocol):
    """An algorithm the engine drives in steps instead of waiting on MPI requests."""

    def advance(self) -> bool:
        """Do whatever can be done now without blocking; True once finished."""


class Group:
    """One group of ranks of a context, with its communicators and its queue of ops.

    Args:
        members: the members' context ranks, sorted.
        comm: the communicator data travels on.
        check_comm: the communicator checks travel on (a duplicate of `comm`).
        detail_comm: the communicator that gathers the full records of a failed check
            (another duplicate, so that those gathers, posted only on a mismatch, never
            interleave with the checks of later calls).
    """

    __slots__ = ("check_comm", "check_seq", "comm", "detail_comm", "extra", "members", "queue", "rank", "size")

    def __init__(self, members: tuple[int, ...], comm: Any, check_comm: Any, detail_comm: Any = None) -> None:
        self.members = members
        self.comm = comm
        self.check_comm = check_comm
        self.detail_comm = detail_comm if detail_comm is not None else MPI.COMM_NULL
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.queue: deque[Op] = deque()
        self.check_seq = 0  # checks posted on check_comm so far
        self.extra: dict[str, Any] = {}  # per-group caches of the fast paths

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
        for name in ("detail_comm", "check_comm", "comm"):
            comm = getattr(self, name)
            if comm is not None and comm != MPI.COMM_NULL:
                comm.Free()


class Op:
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
        exchange: all-gather the records before posting (``all_gather`` needs every
            rank's length); `post` then receives the gathered rows.
        compare: compare the records (the consistency check); with `exchange` alone the
            records are only gathered.
    """

    __slots__ = (
        "check_recv",
        "check_req",
        "check_send",
        "check_stage",
        "compare",
        "error",
        "exchange",
        "finish",
        "gathered",
        "group",
        "keep",
        "name",
        "nbytes",
        "post",
        "protections",
        "record",
        "requests",
        "result",
        "seq",
        "state",
        "stepper",
    )

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
        exchange: bool = False,
        compare: bool = True,
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
        self.requests: list[Any] = []
        self.stepper: Stepper | None = None
        self.state = QUEUED
        self.result: Any = None
        self.error: BaseException | None = None
        # check_req, check_send, check_recv, check_stage, seq and gathered are set when
        # the check is posted: most ops (no check, or a small unchecked all-reduce) never
        # need them, and every assignment costs on the path of the smallest messages.

    def describe(self) -> str:
        """The op for messages: name, size and group."""
        return f"{self.name} of {_size_text(self.nbytes)} on group {self.group.describe()}"

    @property
    def state_name(self) -> str:
        """The state as a word."""
        return _STATE_NAMES[self.state]


def _size_text(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


class Engine:
    """Runs the ops of one context.

    Args:
        ctx: the context (for its groups, config and broken state).
    """

    def __init__(self, ctx: DistributedContext) -> None:
        self.ctx = ctx
        self.lock = threading.RLock()
        self.posted: list[Op] = []  # ops whose data is in flight
        self.waiting_groups: set[Group] = set()  # groups with a non-empty queue
        self.stepping = 0  # posted ops driven by steps rather than by MPI alone
        self.progress_thread: ProgressThread | None = None

    # -- starting ----------------------------------------------------------------------

    def submit(self, op: Op, grace: float | None = None) -> None:
        """Start `op`: post its check (or its data, when nothing must come first).

        Waits up to `grace` seconds (the context's ``check_grace`` when None) for the
        check, so that a mismatch is usually raised here, by the call that caused it.

        Raises:
            CollectiveMismatchError: the check completed within the grace and disagreed.
        """
        ctx = self.ctx
        if ctx._broken is not None or ctx._closed:
            ctx._ensure_usable()
        group = op.group
        with self.lock:
            if op.record is None and not group.queue:
                self._post_data(op)
                return
            if op.record is not None:
                self._post_check(op)
                group.queue.append(op)
                self.waiting_groups.add(group)
            else:
                op.state = QUEUED
                group.queue.append(op)
                self.waiting_groups.add(group)
            self._pump(group)
        if op.state == CHECKING:
            self._wait_check(op, self.ctx.config.check_grace if grace is None else grace)
        if op.state == FAILED:
            assert op.error is not None
            raise op.error

    def post_direct(self, op: Op, start: Callable[..., Any], *args: Any) -> None:
        """Start an unchecked op with one request, the shortest way: ``start(*args)``.

        Falls back to `submit` when the op's group has ops queued (data must be posted in
        call order); the op's own `post` is not used.

        Raises:
            ContextBrokenError: MPI refused to start it (the context is then broken).
        """
        ctx = self.ctx
        if ctx._broken is not None or ctx._closed:
            ctx._ensure_usable()
        with self.lock:
            if not op.group.queue:
                try:
                    op.requests = [start(*args)]
                except MPI.Exception as exc:
                    message = f"MPI failed to start {op.describe()}: {exc}"
                    ctx._mark_broken(message)
                    raise ContextBrokenError(message) from exc
                op.state = POSTED
                self.posted.append(op)
                return
        op.post = lambda: [start(*args)]
        self.submit(op)

    def _post_check(self, op: Op) -> None:
        group = op.group
        op.state = CHECKING
        op.seq = group.check_seq
        group.check_seq += 1
        record = op.record
        assert record is not None
        if op.exchange:
            # Ranks need each other's per-rank values (sizes of all_gatherv): gather the
            # whole records; comparing them is the check.
            op.check_send = record.encode()
            op.check_recv = np.empty((group.size, RECORD_LEN), np.int64)
            op.check_req = group.check_comm.Iallgather(op.check_send, op.check_recv)
            op.check_stage = 2
        else:
            value = ABANDON if record.kind == ABANDONED_KIND else record.agreement()
            op.check_send = np.array([value, -value], np.int64)
            op.check_recv = np.empty(2, np.int64)
            op.check_req = group.check_comm.Iallreduce(op.check_send, op.check_recv, MPI.MIN)
            op.check_stage = 1

    def _advance_check(self, op: Op) -> bool:
        """Move `op`'s check along; True once it has passed (or failed)."""
        if op.state != CHECKING:
            return True
        if not op.check_req.Test():
            return False
        group = op.group
        if op.check_stage == 1:
            low, neg_high = (int(v) for v in op.check_recv)
            if low == -neg_high and low != ABANDON:
                self._check_passed(op)
                return True
            # Disagreement: gather the full records to say exactly what differs.
            assert op.record is not None
            op.check_send = op.record.encode()
            op.check_recv = np.empty((group.size, RECORD_LEN), np.int64)
            op.check_req = group.detail_comm.Iallgather(op.check_send, op.check_recv)
            op.check_stage = 3
            return False
        rows = op.check_recv
        if op.check_stage == 2 and (
            not op.compare or len({agreement_hash(row) for row in rows}) == 1
        ):
            op.gathered = rows
            self._check_passed(op)
            return True
        op.error = mismatch_error(rows, group.members)
        self._fail(op)
        self._answer_abandoners(op, rows)
        return True

    def _answer_abandoners(self, op: Op, rows: np.ndarray) -> None:
        """Members that abandoned this check are stuck elsewhere waiting for this rank."""
        diagnosis = self.ctx._diagnosis
        if diagnosis is None or op.record is None or op.record.kind == ABANDONED_KIND:
            return
        from ._diagnosis import Wait

        mine = Wait(op.group.members, op.seq, False, op.name)
        for member, row in zip(op.group.members, rows):
            waiting = decode_waiting(row)
            if waiting is not None:
                diagnosis.answer(member, waiting, mine)

    def _check_passed(self, op: Op) -> None:
        op.state = QUEUED
        op.check_req = None

    def _fail(self, op: Op) -> None:
        op.state = FAILED
        op.check_req = None
        self._release(op)

    def _post_data(self, op: Op) -> None:
        try:
            started = op.post(op.gathered) if op.exchange else op.post()
        except MPI.Exception as exc:
            message = f"MPI failed to start {op.describe()}: {exc}"
            self.ctx._mark_broken(message)
            op.error = ContextBrokenError(message)
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
        if op.requests or op.stepper is not None:
            op.state = POSTED
            self.posted.append(op)
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
            queue.popleft()
            if head.state == QUEUED:
                self._post_data(head)
        if not queue:
            self.waiting_groups.discard(group)

    # -- progress and completion ---------------------------------------------------------

    def progress(self) -> None:
        """Advance everything in flight without blocking."""
        with self.lock:
            for group in list(self.waiting_groups):
                self._pump(group)
            if self.posted:
                still = []
                for op in self.posted:
                    if op.stepper.advance() if op.stepper is not None else MPI.Request.Testall(op.requests):
                        self._complete(op)
                    else:
                        still.append(op)
                self.posted = still

    def _complete(self, op: Op) -> None:
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
        op = Op("abandoned", group, 0, lambda: [], record=record)
        with self.lock:
            self._post_check(op)
            group.queue.append(op)
            self.waiting_groups.add(group)

    def protect_outputs(self, op: Op, value: Any) -> None:
        """Make `value`'s tensors refuse writes until `op` completes (for assume_resolved)."""
        from ._protect import Protection
        from ._tensor import Tensor

        with self.lock:
            if op.state >= COMPLETE:
                return
            leaves = value.values() if isinstance(value, dict) else value
            if isinstance(value, Tensor) or value is None:
                leaves = [value]
            added = tuple(Protection(t, t._array) for t in leaves if isinstance(t, Tensor) and not t.in_flight)
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
            The op's error, if it failed.
        """
        if op.state < COMPLETE:
            if op.state == POSTED and timeout is None and not self.waiting_groups and not self.stepping:
                # Nothing is queued anywhere and no step-driven op is in flight, so no peer
                # waits for this rank to post or to step: a blocking wait inside MPI (which
                # progresses every MPI request) is safe, and the fastest.
                with self.lock:
                    if op.state == POSTED and not self.waiting_groups:
                        requests = op.requests
                        if len(requests) == 1:
                            requests[0].Wait()
                        else:
                            MPI.Request.Waitall(requests)
                        self.posted.remove(op)
                        if op.finish is None and not op.protections:
                            # What _complete does for the plain case, inlined: this is
                            # the end of every small all-reduce.
                            op.requests = []
                            op.keep = ()
                            op.state = COMPLETE
                        else:
                            self._complete(op)
            if op.state < COMPLETE:
                self._poll_until(lambda: op.state >= COMPLETE, timeout, op)
        if op.state == FAILED:
            assert op.error is not None
            raise op.error

    def wait_posted(self, op: Op, timeout: float | None) -> None:
        """Block until `op`'s data is posted (or it completed or failed)."""
        if op.state < POSTED:
            self._poll_until(lambda: op.state >= POSTED, timeout, op)

    def _wait_check(self, op: Op, grace: float) -> None:
        deadline = time.monotonic() + grace
        backoff = _Backoff()
        group = op.group
        while op.state == CHECKING:
            with self.lock:
                if group.queue and group.queue[0] is op:
                    self._pump(group)  # the usual case: only this group has work to do
                else:
                    self.progress()
            if op.state != CHECKING or time.monotonic() >= deadline:
                return
            backoff.pause()

    def drain(self, timeout: float | None) -> None:
        """Block until nothing is in flight (used by close()).

        Raises:
            CollectiveTimeoutError: `timeout` passed first.
        """
        self._poll_until(lambda: not self.busy(), timeout, None)

    def _poll_until(self, done: Callable[[], bool], timeout: float | None, op: Op | None) -> None:
        thread = self.progress_thread
        if thread is not None and thread.error is not None:
            message = f"the progress thread failed: {thread.error!r}"
            self.ctx._mark_broken(message)
            raise ContextBrokenError(message) from thread.error
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        backoff = _Backoff()
        while True:
            self.progress()
            if done():
                return
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                self._timed_out(op, timeout, now - start)
            self.ctx._diagnose_wait(op, now - start)
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
        self.ctx._mark_broken(message)
        raise CollectiveTimeoutError(message)


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class _Backoff:
    """Spin briefly, then yield, then sleep in short pauses.

    Waiting ranks leave the CPU to others this way: with more ranks than cores, the peer a
    rank waits for may need its core. Pauses stay short (at most 100 us), since what a rank
    waits for usually arrives within microseconds once its peers run.
    """

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def pause(self) -> None:
        self.count += 1
        if self.count < 50:
            return
        if self.count < 5000:
            # Not time.sleep(0), which sleeps a timer slack (50 us or more): a yield costs
            # a microsecond when nobody else wants the core.
            _yield()
            return
        time.sleep(min(1e-4, 1e-6 * (self.count - 4990)))

