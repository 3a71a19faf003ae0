"""Surviving the loss of a rank: a dead peer told from other MPI errors, the context revoked, the survivors.

With ``DistributedConfig(on_rank_failure="raise")`` on an MPI that has fault tolerance (Open
MPI launched with ``mpiexec --with-ft ulfm``: ULFM), a context has a `Faults`. MPI's errors
reach one place, the engine's `mpi_failed` (the compiled code through the engine's record,
the collectives' entry through the engine), which asks `Faults.is_failure` whether the error
says that a rank died: MPI_ERR_PROC_FAILED, MPI_ERR_PROC_FAILED_PENDING, MPI_ERR_REVOKED (a
peer revoked the communicator), or any error once the context's communicator knows a failed
rank (``MPI_Testall`` reports MPI_ERR_IN_STATUS). At the first such error `Faults.failed`:

1. revokes every communicator of the context (``MPI_Comm_revoke``): each survivor's pending
   and next operation on them fails at once, whether or not it involves the dead rank, so
   every survivor learns of the failure (a survivor waiting on a sub-group of live ranks
   for a peer that saw the error included);
2. has the engine fail every op that is not complete with `RankFailedError` (their handles
   resolve with it; their buffers are kept, since MPI may still hold them);
3. names the failed ranks (``MPI_Comm_get_failed``, in the context's numbering).

Nothing of this runs with fault tolerance off: the context has no `Faults` then, and MPI's
errors are `ContextBrokenError` as before.

Recovery is `DistributedContext.shrink`: `shrink_communicator` gives the survivors'
communicator (``MPI_Comm_shrink``, which completes even if more ranks die meanwhile), and
`agree` (``MPI_Comm_agree``: the same outcome on every survivor, even if more die) tells the
survivors whether each of them built its new context, or must shrink again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .._core.errors import RankFailedError
from .._core.mpi import MPI

__all__ = ["NAMING_WAIT", "Faults", "agree", "is_rank_failure", "revoke", "revoked", "shrink_communicator"]

# How long a rank that learnt of a failure only through a revoked communicator waits for MPI
# to name the dead ranks (Open MPI's runtime tells every process within milliseconds).
NAMING_WAIT = 2.0

# Ops failed by a rank's death, with the buffers and requests MPI may still hold: kept for the
# life of the process (MPI completes them in error as the communicators are revoked, but
# nothing says when).
_kept: list[Any] = []


def _failure_classes() -> frozenset[int]:
    """MPI's error classes that say a rank died (or a peer revoked the communicator)."""
    return frozenset((MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING, MPI.ERR_REVOKED))


def _error_class(exc: BaseException) -> int | None:
    try:
        return exc.Get_error_class()  # type: ignore[attr-defined]
    except Exception:  # not MPI's exception, or MPI cannot say
        return None


class Faults:
    """The fault tolerance of one context: whether a rank died, and what every survivor then gets.

    Besides MPI's errors, `poll` (which the context's engine calls before each collective)
    asks MPI whether a rank of the context died or a peer revoked it: a survivor whose calls
    never touch the dead rank (its collectives on a sub-group of live ranks) learns of it
    there, and that call raises.

    Args:
        comm: the context's communicator (every rank of the context), whose failed ranks
            are the context's.
        communicators: gives every communicator of the context, to revoke.
        fail_ops: fails every op of the context's engine that is not complete with the
            error it is given.
        on_failure: called once, at the first failure (the context becomes unusable).
        lock: the engine's lock, held while the failure is dealt with.
    """

    def __init__(
        self,
        comm: Any,
        communicators: Callable[[], list[Any]],
        fail_ops: Callable[[Callable[[], RankFailedError]], list[Any]],
        on_failure: Callable[[], None],
        lock: Any,
    ) -> None:
        self.comm = comm
        self.communicators = communicators
        self.fail_ops = fail_ops
        self.on_failure = on_failure
        self.message: str | None = None  # set at the first failure
        self.ranks: tuple[int, ...] = ()
        self.seconds = 0.0  # how long revoking and naming the ranks took
        self._lock = lock
        self._what: str | None = None  # the call that met the failure
        self._reason: str | None = None  # why the context was given up, where no failure was met

    @property
    def lost(self) -> bool:
        """Whether a rank of the context died (or the context was given up for `shrink`)."""
        return self.message is not None

    def is_failure(self, exc: BaseException) -> bool:
        """Whether MPI's error `exc` says that a rank of the context died (or a peer revoked it)."""
        return self.message is not None or is_rank_failure(exc, self.comm)

    def failed(self, what: str) -> RankFailedError:
        """The error of a call (`what`) that met a rank's death; at the first, revoke and fail everything.

        Args:
            what: the operation that met it, for the message (``"all_reduce of 8 B on group [0, 1, 2]"``).

        Returns:
            The `RankFailedError` to raise.
        """
        with self._lock:
            if self.message is None:
                self._fail_everything(what, None)
        return self.again()

    def poll(self, op: Any) -> None:
        """Before `op` is started: deal with a failure MPI knows of that no call met yet.

        A dead rank of the context, or a peer's revocation: the context is then unusable,
        and the caller's collective raises `RankFailedError`.
        """
        if self.message is None and (revoked(self.comm) or _failed_count(self.comm) > 0):
            self.failed(op.describe())

    def give_up(self, reason: str) -> None:
        """Revoke the context as a failure would, for `reason` (a rank called ``shrink()`` first)."""
        with self._lock:
            if self.message is None:
                self._fail_everything(None, reason)

    def again(self) -> RankFailedError:
        """A fresh `RankFailedError` for a later use of the failed context (naming every dead rank MPI knows now)."""
        assert self.message is not None
        if self._reason is None:
            try:
                known = _failed_ranks(self.comm, 0.0)
            except Exception:  # MPI cannot say any more (finalized): what was known
                known = self.ranks
            if set(known) - set(self.ranks):
                self.ranks = tuple(sorted(set(known) | set(self.ranks)))
                self.message = self._say()
        return RankFailedError(self.message, self.ranks)

    def _fail_everything(self, what: str | None, reason: str | None) -> None:
        start = time.monotonic()
        for comm in self.communicators():
            revoke(comm)
        self._what, self._reason = what, reason
        self.ranks = _failed_ranks(self.comm, NAMING_WAIT if reason is None else 0.0)
        self.message = self._say()
        self.seconds = time.monotonic() - start
        self.on_failure()
        _kept.extend(self.fail_ops(self.again))

    def _say(self) -> str:
        """The message of the failure: who died, where this rank met it, what to do."""
        ranks = self.ranks
        if self._reason is not None:
            lost = f"this context was given up: {self._reason}"
        elif len(ranks) == 1:
            lost = f"rank {ranks[0]} of this context failed (its process ended)"
        elif ranks:
            lost = f"ranks {', '.join(map(str, ranks))} of this context failed (their processes ended)"
        else:
            lost = "a rank of this context failed (MPI has not named it yet)"
        where = f" while rank {self.comm.Get_rank()} ran {self._what}" if self._what is not None else ""
        return (
            f"{lost}{where}. MPI's communicators of the context are revoked, so every surviving rank raises "
            "RankFailedError. Collectives that had not completed give no result (a buffer one was writing into, "
            "such as out= or a held call's, may hold part of one). Call ctx.shrink() on every surviving rank to go "
            "on in a context of the survivors, then close this one"
        )


def is_rank_failure(exc: BaseException, comm: Any) -> bool:
    """Whether MPI's error `exc` says that a rank of `comm` died, or that a peer revoked it.

    Its class says so (MPI_ERR_PROC_FAILED, MPI_ERR_PROC_FAILED_PENDING, MPI_ERR_REVOKED), or
    `comm` is revoked or knows a failed rank (``MPI_Testall``'s MPI_ERR_IN_STATUS, an error a
    dead peer caused in another call).
    """
    if _error_class(exc) in _failure_classes():
        return True
    try:
        return revoked(comm) or _failed_count(comm) > 0
    except Exception:  # MPI cannot tell: an ordinary error
        return False


def revoked(comm: Any) -> bool:
    """Whether `comm` was revoked (here or by a peer)."""
    return bool(comm.Is_revoked())


def revoke(comm: Any) -> None:
    """Revoke `comm` (idempotent; a null or freed communicator is skipped)."""
    if comm is None or comm == MPI.COMM_NULL:
        return
    try:
        if not comm.Is_revoked():
            comm.Revoke()
    except Exception:  # already freed, or MPI refuses: its operations fail anyway
        pass


def _failed_count(comm: Any) -> int:
    group = comm.Get_failed()
    try:
        return group.Get_size()
    finally:
        group.Free()


def _failed_ranks(comm: Any, wait: float) -> tuple[int, ...]:
    """The ranks of `comm` that MPI knows failed, waiting up to `wait` seconds for MPI to name one."""
    deadline = time.monotonic() + wait
    members = comm.Get_group()
    try:
        while True:
            group = comm.Get_failed()
            try:
                count = group.Get_size()
                ranks = MPI.Group.Translate_ranks(group, list(range(count)), members) if count else []
            finally:
                group.Free()
            if ranks or time.monotonic() >= deadline:
                return tuple(sorted(r for r in ranks if r != MPI.UNDEFINED))
            # MPI learns of a death it has not met itself (its runtime's notice) as it progresses.
            MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
            time.sleep(1e-3)
    finally:
        members.Free()


def shrink_communicator(comm: Any) -> Any:
    """The survivors of `comm` as a new communicator, in the old order (``MPI_Comm_shrink``, collective).

    Revokes `comm` first (so that a survivor still in an operation on it comes out and
    shrinks too); completes even if more ranks die meanwhile.
    """
    revoke(comm)
    return comm.Shrink()


def agree(comm: Any, flag: int) -> int:
    """The bitwise AND of every surviving rank's `flag` (``MPI_Comm_agree``, collective), the same on every survivor.

    A rank that died before it took part is left out; then MPI reports the failure on every
    survivor alike, and this returns 0 (the outcome is "something failed") after
    acknowledging it.

    Raises:
        mpi4py.MPI.Exception: an MPI error other than a rank's death.
    """
    try:
        return int(comm.Agree(flag))
    except MPI.Exception as exc:
        if _error_class(exc) not in _failure_classes():
            raise
        comm.Ack_failed()
        return 0
