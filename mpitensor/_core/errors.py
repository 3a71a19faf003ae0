"""The exception hierarchy: every error mpitensor raises derives from `MpitensorError`.

Errors about values also derive from `ValueError`, errors about types from `TypeError`,
errors about state (lifecycle, a broken context) from `RuntimeError`, so code that catches
the built-in kinds keeps working.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ContextBrokenError",
    "ContextClosedError",
    "DeviceError",
    "ForkedProcessError",
    "MpiFinalizedError",
    "MpitensorError",
    "NoContextError",
    "NotAMemberError",
    "ObjectUnpicklingError",
    "RankFailedError",
    "TensorInFlightError",
    "ThreadMisuseError",
    "TracedArrayError",
]


class MpitensorError(Exception):
    """Base class of every exception mpitensor raises."""


class CollectiveMismatchError(MpitensorError, ValueError):
    """Ranks called a collective with arguments that do not agree.

    Raised on every participating rank, before any data moves. The message names what
    differs, the ranks and their values. The context stays usable.
    """


class CollectiveTimeoutError(MpitensorError, TimeoutError):
    """A collective did not complete within its timeout.

    MPI cannot cancel a started collective, so the context that ran it is broken
    afterwards: further use raises `ContextBrokenError`; `DistributedContext.abort()`
    ends the job.
    """


class MpiFinalizedError(MpitensorError, RuntimeError):
    """MPI was finalized in this process; it cannot be initialized again."""


class ContextClosedError(MpitensorError, RuntimeError):
    """The context (or the context a collective belongs to) is closed."""


class ContextBrokenError(MpitensorError, RuntimeError):
    """The context has a collective that can never complete (after a timeout)."""


class RankFailedError(ContextBrokenError):
    """Ranks of the context died (their processes ended), and the context can run no more collectives.

    Raised only with fault tolerance on (``DistributedConfig(on_rank_failure="raise")`` on an
    MPI that has it): by every surviving rank's pending and next collective, `resolve()` and
    ``close()``. MPI's communicators of the context are revoked, so every survivor learns of
    it, not only those whose call touched the dead rank. Call ``ctx.shrink()`` on every
    surviving rank to go on in a context of the survivors. A `ContextBrokenError`, so code
    that catches that one keeps working.

    Args:
        message: what happened and what to do.
        ranks: the context's ranks that failed, as this rank knows them.

    Attributes:
        ranks: the context's ranks that failed, ascending (empty if MPI had not named them
            yet when the error was made).
    """

    def __init__(self, message: str, ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)

    def __reduce__(self) -> tuple[type[RankFailedError], tuple[str, tuple[int, ...]]]:
        return type(self), (str(self), self.ranks)


class NoContextError(MpitensorError, RuntimeError):
    """No `DistributedContext` is open in this process."""


class DeviceError(MpitensorError, RuntimeError):
    """A device is not available here, not in the context, or from another context."""


class ForkedProcessError(MpitensorError, RuntimeError):
    """This process was forked (``os.fork``) from a rank after MPI was initialized there.

    The child shares its parent's MPI state and connections: a collective, a close or an
    MPI finalize from it would be taken for the rank's own and corrupt or end the job. So
    in the child every collective, every use of the parent's contexts and opening a context
    raise this error; the child finalizes nothing at exit. The parent goes on unaffected.
    """


class ObjectUnpicklingError(MpitensorError, TypeError):
    """An object collective's object cannot be unpickled on a receiving rank.

    Raised by `resolve()` on the rank that cannot rebuild the object (a class it cannot
    import, an unpickling that raises); the data has moved, the context stays usable.
    """


class TensorInFlightError(MpitensorError, RuntimeError, ValueError):
    """A tensor was written while a collective reads or writes it.

    Also a `ValueError`, as NumPy raises for writes to a read-only array.
    """


class ThreadMisuseError(MpitensorError, RuntimeError):
    """A collective was called from another thread than the one that opened its context.

    Ranks run collectives in call order; calls from several threads would interleave
    differently on each rank and pair one thread's data with another's.
    """


class TracedArrayError(MpitensorError, TypeError):
    """A collective got a JAX tracer: a value inside ``jax.jit``, ``grad``, ``vmap``, ``jvp``...

    The eager collectives communicate concrete data when called; under a JAX
    transformation there is none yet. Raised on the calling rank before anything is sent
    (its peers learn of it as of any bad argument); `mpitensor.jax` has the collectives
    that run inside transformations.
    """


class NotAMemberError(ValueError):
    """A collective named a group that leaves this rank out (only its members call it).

    A plain `ValueError` for the caller; mpitensor tells it apart because such a call takes
    no turn in any group's sequence of checks.
    """
