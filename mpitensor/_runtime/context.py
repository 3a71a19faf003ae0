"""`DistributedContext`: the ranks and devices, their communicators, and what is in flight.

A context spans a group of ranks (all of ``MPI_COMM_WORLD`` by default). It talks on its
own duplicates of the world communicator, so its messages never mix with the program's
own MPI traffic. Collectives on a subset of the ranks get a sub-communicator created once,
over that subset only (``MPI_Comm_create_group``: ranks outside take no part), and cached.
"""

from __future__ import annotations

import builtins
import operator
import os
import socket
import sys
import threading
import warnings
from collections.abc import Sequence
from types import TracebackType
from typing import Any, NamedTuple

from .._core import errors as _errors
from .._core import idle
from .._core import mpi as _mpi
from .._core import state as _state
from .._core.config import DistributedConfig
from .._core.device import Device, choose_device, local_rank_from_env
from .._core.errors import (
    CollectiveMismatchError,
    ContextBrokenError,
    ContextClosedError,
    DeviceError,
    ForkedProcessError,
)
from .._core.mpi import MPI
from .._core.pool import HostPool
from .._core.records import ContextRecord
from . import failfast as _failfast
from . import faults as _faults
from .check import CLOSE_KIND, Members, Record
from .diagnosis import Diagnosis
from .engine import COMPLETE, OVERSUBSCRIBED_SPIN_PAUSES, SPIN_PAUSES, Engine, Group, WatchedEngine
from .progress import ProgressThread
from .resolve import GroupResolver
from .tracing.exchange import gatherer
from .tracing.session import TraceSession
from .tracing.stragglers import TraceSummary

__all__ = ["DevicesArg", "DistributedContext", "current_context"]

DevicesArg = Sequence[Device | int] | None

_host_pool = HostPool()
# Ops left in flight by contexts that an exception tore down: MPI may still write into
# their buffers, so they are kept until the process ends.
_abandoned: list[Any] = []


def _setup_failure(failures: list[tuple[int, tuple[str, str, str]]], own: int | None) -> Exception:
    """The error every rank raises when the context's setup failed on some ranks.

    Every rank raises the same class: that of the lowest failing rank's error where every
    rank has it (a built-in exception or mpitensor's own), else `RuntimeError`. The message
    names each failing rank and its error; a failing rank's own error comes first.

    Args:
        failures: (world rank, (class name, class module, message)) of each failing rank, ascending.
        own: this rank's world rank when it failed too, else None.
    """
    cls = _shared_class(*failures[0][1][:2])
    alike: dict[tuple[str, str], list[int]] = {}  # ranks that failed with the same error, said once
    for rank, (name, _, message) in failures:
        alike.setdefault((name, message), []).append(rank)

    def said(error: tuple[str, str]) -> str:
        return error[1] if error[0] == cls.__name__ else f"{error[0]}: {error[1]}"

    def ranks(numbers: list[int]) -> str:
        return f"rank {numbers[0]}" if len(numbers) == 1 else "ranks " + ", ".join(map(str, numbers))

    if own is not None:
        mine = next(error for error, numbers in alike.items() if own in numbers)
        same = [rank for rank in alike[mine] if rank != own]
        others = "; ".join(f"{ranks(numbers)}: {said(error)}" for error, numbers in alike.items() if error != mine)
        text = said(mine) + (f" (likewise on {ranks(same)})" if same else "") + (f" (and {others})" if others else "")
    else:
        why = "which cannot have their device" if cls is DeviceError else "so it fails on this rank too"
        others = "; ".join(f"{ranks(numbers)}: {said(error)}" for error, numbers in alike.items())
        text = f"DistributedContext.init failed on other ranks, {why}: {others}"
    try:
        return cls(text)
    except Exception:  # a class whose constructor wants more than a message
        return RuntimeError(text)


def _shared_class(name: str, module: str) -> type[Exception]:
    """The exception class `name` of `module` where every rank has it (built-in or mpitensor's), else RuntimeError."""
    found = getattr(builtins, name, None) if module == "builtins" else None
    if module == _errors.__name__:
        found = getattr(_errors, name, None)
    if isinstance(found, type) and issubclass(found, Exception):
        return found
    return RuntimeError


class DistributedContext(ContextRecord):
    """The ranks and devices taking part in collectives, and everything they share.

    Create it with `DistributedContext.init` (every participating rank calls it with the
    same arguments); close it with `close()` or by leaving a ``with`` block.

    Attributes:
        config: the settings (`DistributedConfig`). Read-only, as are `timeout` and
            `closed`: they are plain attributes because collectives read them on every
            call.
        timeout: the default timeout of `CollectiveTensor.resolve` in seconds (the
            config's, or ``MPITENSOR_TIMEOUT``), or None to wait forever.
        closed: True after `close()` (or after leaving a ``with`` block).

    Internal interface: the names below are how mpitensor's own modules use a context.
    They are not part of the public API and may change in any release.

    - ``engine``: the `Engine` that runs the context's collectives.
    - ``pool``: the `HostPool` that host buffers come from.
    - ``cpu_device``: this rank's CPU `Device` (the device of host results).
    - ``full_group``: the `Group` of every rank, for collectives; ``p2p_group``: the one
      for point-to-point messages, apart so that they never queue behind collectives.
    - ``groups``: every collective `Group` created so far, by its members' ranks.
    - ``diagnosis``: the group-mismatch `Diagnosis`, or None (check off, or one rank);
      ``diag_comm``: the communicator its notes travel on.
    - ``usable``: False once the context is closed or broken (``ensure_usable()`` then
      raises the error that says which); collectives read it on every call.
    - ``owner_thread``, ``owner_thread_name``: the thread that opened the context, the only
      one that may call its collectives.
    - ``group(devices, doing)``, ``rank_of_device(device)``, ``ensure_usable()``,
      ``mark_broken(reason)``: see their docstrings.
    """

    def __init__(self, *, _private: object = None) -> None:
        if type(_private) is not _InitArgs:
            raise TypeError("use DistributedContext.init(devices=None, config=None) to create a context")
        self._setup(*_private)

    # -- creation ------------------------------------------------------------------------

    @classmethod
    def init(cls, devices: DevicesArg = None, config: DistributedConfig | None = None) -> DistributedContext:
        """Open a context over `devices` (every rank when None), initializing MPI if needed.

        Every rank that takes part calls it with the same `devices`; ranks outside take no
        part. The first context of a process initializes MPI (with
        ``MPI_THREAD_MULTIPLE``) unless the program already did.

        Args:
            devices: the participating devices (one per rank) or world ranks; None for
                every rank. A `Device` entry also chooses that rank's device.
            config: the settings; `DistributedConfig()` when None.

        Returns:
            The open context; it is also the current context until closed.

        Raises:
            TypeError: `devices` or `config` has the wrong type.
            ValueError: a rank is out of range, repeated, or this rank is not listed; a
                setting that cannot be used (a trace path that is a directory...).
            DeviceError: a GPU is asked for that this rank does not have.
            MpiFinalizedError: MPI was finalized already in this process.
            ForkedProcessError: this process was forked from a rank (only the rank opens contexts).
            Exception: whatever failed while the context was set up on any rank (a trace ring
                that cannot be allocated: `MemoryError`...), raised on every rank of the
                context alike: the class of the lowest failing rank's error, its message
                naming each failing rank and its error.
        """
        rank = _mpi.forked_from()
        if rank is not None:
            raise ForkedProcessError(_state.forked_message(rank))
        if config is None:
            config = DistributedConfig()
        if not isinstance(config, DistributedConfig):
            raise TypeError(f"config must be a DistributedConfig, got {type(config).__name__}")
        thread_level = _mpi.ensure_initialized()
        return cls(_private=_InitArgs(devices, config, thread_level))

    def _setup(
        self, devices: DevicesArg, config: DistributedConfig, thread_level: int, survivors: _Survivors | None = None
    ) -> None:
        world = MPI.COMM_WORLD
        world_rank, world_size = world.Get_rank(), world.Get_size()
        if survivors is None:
            members, chosen = _parse_init_devices(devices, world_rank, world_size)
        else:  # `shrink`: the survivors' communicator is made, each rank keeps its device
            members, chosen = survivors.members, survivors.device
        self.config = config
        self._thread_level = thread_level
        self.closed = False
        self._broken: str | None = None  # why the context is broken
        self._forked_from: int | None = None  # in a process forked from the rank: that rank
        self.usable = True  # neither closed nor broken: what collectives check on every call
        self.owner_thread = threading.get_ident()  # the one thread that may call collectives
        self.owner_thread_name = threading.current_thread().name
        self.groups: dict[tuple[int, ...], Group] = {}
        if survivors is not None:
            comm = survivors.comm
        elif len(members) == world_size:
            comm = world.Dup()
        else:
            mpi_group = world.Get_group().Incl(list(members))
            comm = world.Create_group(mpi_group, _tag_for(members))
            mpi_group.Free()
        self._comm = comm
        self._rank = comm.Get_rank()
        self._size = comm.Get_size()
        self._world_ranks = members
        local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self._rank)
        self._local_comm = local
        self._local_rank = local.Get_rank()
        self._local_size = local.Get_size()
        self._host = MPI.Get_processor_name() or socket.gethostname()
        everyone, device, trace = self._agree_on_setup(chosen, config, thread_level, world_rank)
        self._devices = tuple(
            Device(kind, index, members[r]) for r, (kind, index, _, _, _) in enumerate(everyone)
        )
        self._hosts = tuple(row[2] for row in everyone)
        self._local_ranks = tuple(row[3] for row in everyone)
        self._device = self._devices[self._rank]
        self.cpu_device = self._device if device.kind == "cpu" else Device("cpu", 0, world_rank)
        # From here on every step is collective, or cannot fail on one rank alone.
        self.trace = trace
        if trace is not None:
            trace.start(comm, thread_level >= MPI.THREAD_MULTIPLE)
            _failfast.on_abort(trace.alarm)
        self._open_groups(comm)
        self.engine = (WatchedEngine if config.on_rank_failure == "raise" else Engine)(self)
        self.engine.tracer = None if self.trace is None else self.trace.tracer
        self.faults = self._fault_tolerance(config)
        self.engine.faults = self.faults
        self.pool = _host_pool
        self.diagnosis = Diagnosis(self) if config.check and self._size > 1 else None
        spare = self._spare_cores() if self._size > 1 else 0
        # More ranks than cores here: a waiting rank must soon yield the core its peer needs.
        self.engine.spin_pauses = OVERSUBSCRIBED_SPIN_PAUSES if spare < 0 else SPIN_PAUSES
        idle.set_oversubscribed(spare < 0)
        if self._size > 1 and _progress_wanted(config, thread_level, spare, self._device.kind):
            self.engine.progress_thread = ProgressThread(self.engine)
        _state.push(self)
        if config.fail_fast:
            _failfast.arm()

    def _agree_on_setup(
        self, chosen: Device | None, config: DistributedConfig, thread_level: int, world_rank: int
    ) -> tuple[list[tuple[Any, ...]], Device, TraceSession | None]:
        """Run the setup's steps that can fail on one rank alone, then tell every rank how they went.

        Each of these steps (the timeout from the environment, the device, the progress
        setting, the trace's path and ring) runs before the one exchange of the setup, so a
        failure anywhere reaches every rank there, before any of them waits in a collective
        for a peer that raised. Collective over the context's communicator.

        Returns:
            Every rank's row (device kind and index, host, local rank, failure) in rank
            order, this rank's device, and its trace (None when not traced).

        Raises:
            Exception: some rank failed: on every rank, as `_setup_failure` makes it (the
                communicators are freed first).
        """
        device, trace, failure = Device("cpu", 0, world_rank), None, None
        try:
            self.timeout = config.resolved_timeout()
            device = _choose_device(chosen, config, self._local_rank, world_rank)
            _check_progress_setting(config, thread_level)
            path = config.resolved_trace()
            if path is not None:
                trace = TraceSession(path, config.trace_events, self._world_ranks, self._rank, self._host, config.check)
        except Exception as exc:  # any failure here must reach the peers, not leave them waiting
            failure = exc
        said = None if failure is None else (type(failure).__name__, type(failure).__module__, str(failure))
        everyone = self._comm.allgather((device.kind, device.index, self._host, self._local_rank, said))
        failures = [(self._world_ranks[r], row[4]) for r, row in enumerate(everyone) if row[4] is not None]
        if failures:
            self._local_comm.Free()
            self._comm.Free()
            raise _setup_failure(failures, world_rank if failure is not None else None) from failure
        return everyone, device, trace

    def _open_groups(self, comm: Any) -> None:
        """The whole context's group, the point-to-point group and the diagnosis communicator."""
        self.diag_comm = comm.Dup()
        full = Members(range(self._size))
        self.resolver = GroupResolver(self._devices, self._rank)
        self.full_group = Group(full, comm.Dup(), comm.Dup(), comm.Dup())
        self.groups[full] = self.full_group
        # Point-to-point messages travel apart from collectives and never queue behind them.
        self.p2p_group = Group(full, comm.Dup(), MPI.COMM_NULL)

    # -- what the context is ---------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This rank's number in the context (0 .. size-1)."""
        return self._rank

    @property
    def size(self) -> int:
        """How many ranks take part."""
        return self._size

    @property
    def device(self) -> Device:
        """This rank's device."""
        return self._device

    @property
    def devices(self) -> tuple[Device, ...]:
        """Every participating device, one per rank, in rank order."""
        return self._devices

    @property
    def local_rank(self) -> int:
        """This rank's number among the ranks of its node."""
        return self._local_rank

    @property
    def local_size(self) -> int:
        """How many ranks of the context share this node."""
        return self._local_size

    @property
    def host(self) -> str:
        """This rank's host name."""
        return self._host

    @property
    def hosts(self) -> tuple[str, ...]:
        """Every rank's host name, in rank order."""
        return self._hosts

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """Every rank's node-local rank, in rank order."""
        return self._local_ranks

    @property
    def comm(self) -> Any:
        """The context's own MPI communicator (an ``mpi4py.MPI.Intracomm``)."""
        self._ensure_open()
        return self._comm

    @property
    def thread_level(self) -> str:
        """The MPI thread level provided: single, funneled, serialized or multiple."""
        return _mpi.thread_level_name(self._thread_level)

    @property
    def broken(self) -> bool:
        """True after a collective timed out (see `CollectiveTimeoutError`), or a rank died (`RankFailedError`)."""
        return self._broken is not None or (self.faults is not None and self.faults.lost)

    @property
    def fault_tolerant(self) -> bool:
        """True if the context survives the loss of a rank (`RankFailedError`, then `shrink`).

        Asked for with ``DistributedConfig(on_rank_failure="raise")``, on an MPI that has it
        (``python -m mpitensor info`` says whether it does).
        """
        return self.faults is not None

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("broken" if self._broken else "open")
        return f"DistributedContext(rank={self._rank}, size={self._size}, device={self._device}, {state})"

    # -- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> DistributedContext:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None or issubclass(exc_type, SystemExit):
            # sys.exit() inside the block is a way of leaving, not a failure: close, so
            # that peers still calling collectives are told this rank left.
            self.close()
        else:
            self._leave_on_exception()

    def close(self) -> None:
        """Complete what is in flight, wait for every rank to close, free the communicators, finalize MPI if due.

        Closing is a check of its own on the whole context (see `_say_goodbye`): a peer still
        calling a collective is told that this rank left instead of waiting for it forever.
        MPI is finalized when this was the last open context and mpitensor initialized
        MPI (unless finalization is deferred, see `defer_finalize`). Idempotent; in a process
        forked from the rank it does nothing (the context is the parent's to close).

        A context that lost a rank (`RankFailedError`) closes at once, waiting for no rank: its
        communicators stay revoked and are kept with what MPI may still hold of its ops.

        Raises:
            CollectiveTimeoutError: the collectives in flight did not complete within the
                context's timeout (the context is then broken and stays unclosed).
            RankFailedError: a rank died while this one closed (fault tolerance on); the
                context stays open, so that this rank can join its peers' ``shrink()``;
                closing it again closes it at once.
        """
        if self.closed:
            return
        lost = self.faults is not None and self.faults.lost
        together = False  # whether every rank closes with this one (and so can merge the trace)
        if self._broken is None and not lost:
            self.engine.drain(self.timeout)
            together = self._say_goodbye() if self._size > 1 else True
            if together and self.diagnosis is not None:
                self.diagnosis.finish()  # every rank closes: the diagnosis's rounds end paired
        # A broken context keeps its communicators (a collective stuck on them is still in
        # flight), but its progress thread has nothing left to do.
        self._stop_progress()
        self._close_trace(merge=together and self._broken is None)
        if self._broken is None and not lost:
            self._free()
        self.closed = True
        self.usable = False
        remaining = _state.pop(self)
        if self._broken is None and _mpi.release(remaining):
            _failfast.disarm_left_contexts()

    def _say_goodbye(self) -> bool:
        """Close on every rank together, and tell peers still calling collectives that this rank left.

        The close is a check of its own on the whole context: where a peer is in a
        collective instead, the peer raises `CollectiveMismatchError` naming this rank
        instead of waiting for it forever (and its context can run no more collectives).

        Returns:
            Whether every rank closed together (False: some peer was in a collective).
        """
        op = self._post_goodbye()
        try:
            self.engine.wait(op, self.timeout)
        except CollectiveMismatchError:
            return False  # peers were in a collective: they have been told
        return True

    def _post_goodbye(self) -> Any:
        """Post this rank's close check on the whole context (a stand-in: it moves no data); its op."""
        record = Record(CLOSE_KIND, None, None, None, -1, self.full_group.members, per_rank=-(self._rank + 1))
        return self.engine.post_stand_in(CLOSE_KIND, self.full_group, record)

    def _leave_on_exception(self) -> None:
        """Close without waiting on peers to close too (an exception is propagating), telling them this rank left."""
        if self.closed:
            return
        lost = self.faults is not None and self.faults.lost  # no peer to tell: MPI revoked the context
        if self._size > 1 and self._broken is None and not lost and not self.engine.lock_held_here():
            self._tell_peers_it_left()
        self.closed = True
        self.usable = False
        self._stop_progress()
        if self.trace is not None:
            # Its part now; the flight recorder stays armed, so that the abort an uncaught
            # exception leads to asks the peers for theirs.
            self.trace.write_part()
        if not lost:
            try:
                self.engine.progress()
            except _errors.RankFailedError:  # met a rank's death on the way out: the exception leaving stays
                lost = True
        if lost or self.engine.busy():
            _abandoned.append(self.engine)
        else:
            self._free()
        _state.pop(self)
        _failfast.note_left_by_exception()

    def _tell_peers_it_left(self) -> None:
        """Post this rank's close check, waiting for it only up to the check's grace.

        A program may catch the exception outside the ``with`` block and go on (a test
        runner does): its peers, in a collective of this context or closing it, would
        otherwise wait for this rank forever. They pair the close check with their call and
        raise `CollectiveMismatchError` naming this rank, or close with it. Peers later than
        the grace complete the exchange at this rank's next MPI call (the engine is kept).
        """
        try:
            goodbye = self._post_goodbye()
            self.engine.see_stand_in_through(goodbye, self.config.check_grace)
            if goodbye.state == COMPLETE and self.diagnosis is not None:
                self.diagnosis.finish()  # every rank closed with it: the diagnosis's rounds end paired
        except Exception:  # already leaving on an exception: that one is what the program sees
            return

    def shrink(self, config: DistributedConfig | None = None) -> DistributedContext:
        """A new context of the ranks that survive this one's failure (fault tolerance).

        Every surviving rank calls it, typically after a collective raised `RankFailedError`
        (a rank that calls it first gives this context up: MPI revokes it, and its peers'
        pending and next collectives raise `RankFailedError`). Ranks that die meanwhile are
        left out too. The new context holds the survivors, renumbered in their old order,
        each with its device; it is open and the current context, usable as a context
        manager, and makes its sub-groups on demand as any context. This context stays open
        and unusable (every handle it gave that had not completed resolves with
        `RankFailedError`); close it, which waits for no rank.

        Args:
            config: the new context's settings; this context's when None.

        Returns:
            The new context.

        Raises:
            RuntimeError: this context is not fault tolerant (`fault_tolerant` is False).
            TypeError: `config` is not a `DistributedConfig`.
            ContextClosedError: this context is closed.
            ForkedProcessError: this process was forked from the rank.
            ContextBrokenError: MPI failed otherwise while the new context was made.
        """
        self._ensure_open()
        if config is None:
            config = self.config
        if not isinstance(config, DistributedConfig):
            raise TypeError(f"config must be a DistributedConfig or None, got {type(config).__name__}")
        if self.faults is None:
            asked = self.config.on_rank_failure == "raise"
            why = _mpi.fault_tolerance()[1] if asked else "DistributedConfig(on_rank_failure='raise') was not asked for"
            raise RuntimeError(
                f"shrink() needs a fault-tolerant context, and this one is not: {why}. Open the context with "
                "DistributedConfig(on_rank_failure='raise') on an MPI that survives the loss of a rank (Open MPI "
                "launched with mpiexec --with-ft ulfm; python -m mpitensor info says whether yours does)"
            )
        self._stop_progress()
        self.faults.give_up(f"rank {self._rank} called shrink() before it met a failure")
        comm = _faults.shrink_communicator(self._comm)
        for _ in range(self._size):
            ctx = DistributedContext.__new__(DistributedContext)
            try:
                ctx._setup(None, config, self._thread_level, _Survivors.of(comm, self._device))
                built = 1
            except Exception as exc:
                # A death during the setup's exchanges may also reach it as data MPI completed
                # without a dead rank's part (mpi4py's pickled all-gather failing to unpickle).
                if comm == MPI.COMM_NULL or not _faults.is_rank_failure(exc, comm):
                    if isinstance(exc, MPI.Exception):
                        why = f"MPI failed while shrink() made the survivors' context: {exc}"
                        raise ContextBrokenError(why) from exc
                    raise  # the setup's own error, the same on every survivor
                built = 0  # another rank died meanwhile: every survivor learns it in the agreement
                # Survivors still in a step of the setup (waiting there for this rank) come out of it.
                ctx._revoke_made()
                _faults.revoke(comm)
            # The same outcome on every survivor, even if more die now: go on, or shrink again.
            if _faults.agree(comm, built) == 1:
                return ctx
            if built:
                _state.pop(ctx)
                ctx._revoke_made()
            comm = _faults.shrink_communicator(comm)
        raise ContextBrokenError("shrink() could not make a context of the survivors: ranks kept dying as it did")

    def _fault_tolerance(self, config: DistributedConfig) -> _faults.Faults | None:
        """This context's fault tolerance where asked for and MPI has it; else None (a warning where asked for)."""
        if config.on_rank_failure != "raise":
            return None
        supported, why = _mpi.fault_tolerance()
        if not supported:
            warnings.warn(
                f"DistributedConfig(on_rank_failure='raise') asks for fault tolerance, but {why}; this context "
                "stays fail-fast: a rank that dies ends the job",
                RuntimeWarning,
                stacklevel=5,  # the program's call of DistributedContext.init
            )
            return None
        return _faults.Faults(self._comm, self._mpi_handles, self.engine.fail_pending, self._lose, self.engine.lock)

    def _lose(self) -> None:
        """A rank of the context died (fault tolerance): no collective runs on it any more."""
        self.usable = False
        _mpi.note_rank_failure()
        if self.trace is not None:
            self.trace.write_part()  # the flight recorder: this context can no longer merge

    def _revoke_made(self) -> None:
        """Revoke every communicator a context being made has so far (a survivor stopped making it)."""
        made = [getattr(self, name, None) for name in ("_comm", "_local_comm", "diag_comm")]
        for group in getattr(self, "groups", {}).values():
            made += [group.comm, group.check_comm, group.detail_comm]
        p2p = getattr(self, "p2p_group", None)
        if p2p is not None:
            made.append(p2p.comm)
        for comm in made:
            _faults.revoke(comm)

    def abort(self, errorcode: int = 1) -> None:
        """End the whole job now (``MPI_Abort``): the way out of a broken context.

        Args:
            errorcode: the exit code the launcher reports.

        Raises:
            ForkedProcessError: this process was forked from the rank (only the rank may end the job).
        """
        if self._forked_from is not None:
            raise ForkedProcessError(_state.forked_message(self._forked_from))
        sys.stdout.flush()
        sys.stderr.write(f"[rank {MPI.COMM_WORLD.Get_rank()}] mpitensor: ctx.abort({errorcode}) called\n")
        sys.stderr.flush()
        _failfast.run_before_abort()
        _failfast.release_job_files()
        # MPI_Abort may return before the launcher ends this process (seen with MPICH on a
        # loaded machine), or never (Open MPI under --with-ft ulfm after a rank's death): the
        # program must not go on either way.
        _failfast.abort_job(errorcode)

    def _spare_cores(self) -> int:
        """Cores of this node that its ranks of the context may use, beyond one each."""
        if hasattr(os, "sched_getaffinity"):
            mine = sorted(os.sched_getaffinity(0))
        else:
            mine = list(range(os.cpu_count() or 1))
        usable = set().union(*self._local_comm.allgather(mine))
        return len(usable) - self._local_size

    def _close_trace(self, merge: bool) -> None:
        """Write the trace (merged, or this rank's part) and stop recording."""
        session, self.trace = self.trace, None
        if session is not None:
            _failfast.forget_abort(session.alarm)
            session.close(self._comm, merge)
            self.engine.tracer = None

    def trace_summary(self) -> TraceSummary:
        """Which ranks made the others wait so far: the straggler summary of every rank's trace.

        Collective: every rank of the context calls it (it gathers the ranks' records),
        for example every N steps, to log `TraceSummary.text()`.

        Returns:
            The summary (the same on every rank).

        Raises:
            RuntimeError: the context does not trace (set ``DistributedConfig(trace=PATH)``
                or ``MPITENSOR_TRACE``).
            CollectiveMismatchError: the ranks did not all call it at this point.
        """
        if self.trace is None:
            raise RuntimeError(
                "trace_summary() needs a traced context: open it with DistributedConfig(trace=PATH) "
                "or set MPITENSOR_TRACE=PATH"
            )
        return self.trace.summary(gatherer())

    def _stop_progress(self) -> None:
        thread = self.engine.progress_thread
        if thread is not None:
            thread.stop()

    @property
    def progress(self) -> bool:
        """True if a progress thread drives communication while the program computes."""
        return self.engine.progress_thread is not None

    def _mpi_handles(self) -> list[Any]:
        """Every communicator the context created (for checks that close() frees them)."""
        comms = [self.diag_comm, self._local_comm, self._comm, self.p2p_group.comm]
        for group in self.groups.values():
            comms += [group.comm, group.check_comm, group.detail_comm]
        return comms

    def _free(self) -> None:
        self.resolver.forget()
        if self.diagnosis is not None:
            self.diagnosis.free()
        self.p2p_group.free()
        for group in self.groups.values():
            group.free()
        self.groups.clear()
        for comm in (self.diag_comm, self._local_comm, self._comm):
            if comm != MPI.COMM_NULL:
                comm.Free()

    def _ensure_open(self) -> None:
        if self._forked_from is not None:
            raise ForkedProcessError(_state.forked_message(self._forked_from))
        if self.closed:
            raise ContextClosedError("this DistributedContext is closed; open a new one with DistributedContext.init()")

    def _forsake(self, rank: int) -> None:
        """In a process forked from rank `rank`: this context is the parent's; here it is closed, without MPI.

        Nothing is freed, finalized or told to the peers (the communicators, the engine's
        ops and the trace are the parent's); every later use raises `ForkedProcessError`,
        and `close()` and leaving a ``with`` block do nothing.
        """
        self._forked_from = rank
        self.closed = True
        self.usable = False

    def ensure_usable(self) -> None:
        """Raise unless collectives may run (internal: collectives call it when ``usable`` is False).

        Raises:
            ContextClosedError: the context is closed.
            ContextBrokenError: the context is broken (a collective timed out or MPI failed).
            ForkedProcessError: this process was forked from the rank that opened the context.
        """
        self._ensure_open()
        if self.faults is not None and self.faults.lost:
            raise self.faults.again()
        if self._broken is not None:
            raise ContextBrokenError(f"this DistributedContext is broken: {self._broken}")

    def mark_broken(self, reason: str) -> None:
        """Break the context for good, for `reason` (internal: the first reason is kept).

        Args:
            reason: what broke it, as the sentence `ContextBrokenError` will quote.
        """
        if self._broken is None:
            self._broken = reason
            self.usable = False
            _mpi.note_broken(reason.partition(":")[0])
            if self.trace is not None:
                self.trace.write_part()  # the flight recorder: this context can no longer merge

    # -- groups -------------------------------------------------------------------------------

    def group(self, devices: DevicesArg, doing: str = "a collective") -> Group:
        """The group `devices` name (the whole context when None), created on first use (internal).

        The same argument on every call (a list kept by the program, a tuple) resolves in
        constant time after its first use (see `GroupResolver`).

        Args:
            devices: devices (from ``ctx.devices``) or their ranks; None for every rank.
            doing: the calling operation, for the group-mismatch diagnosis.

        Returns:
            The `Group`, with its communicators.

        Raises:
            TypeError: `devices` is not a sequence of Devices or ints.
            ValueError: empty, repeated or out-of-range ranks, or this rank not a member.
            DeviceError: a device that is not in this context.
        """
        if devices is None:
            return self.full_group
        members = self.resolver.members(devices)
        group = self.groups.get(members)
        if group is None:
            group = self._create_group(members, doing)
        return group

    def rank_of_device(self, device: Device) -> int:
        """`device`'s rank in the context (internal).

        Raises:
            DeviceError: `device` is not one of the context's devices.
        """
        return self.resolver.rank_of(device)

    def _create_group(self, members: Members, doing: str) -> Group:
        if self.diagnosis is not None:
            self.diagnosis.before_create(members, doing)
        mpi_group = self._comm.Get_group().Incl(list(members))
        try:
            comm = self._comm.Create_group(mpi_group, _tag_for(members))
        finally:
            mpi_group.Free()
        group = Group(members, comm, comm.Dup(), comm.Dup())
        self.groups[members] = group
        return group

    def group_count(self) -> int:
        """How many groups (each with its communicators) the context has created."""
        return len(self.groups)


class _InitArgs(NamedTuple):
    """What `DistributedContext.init` hands the constructor (only it can make one)."""

    devices: DevicesArg
    config: DistributedConfig
    thread_level: int
    survivors: _Survivors | None = None


class _Survivors(NamedTuple):
    """What `DistributedContext.shrink` hands the setup of the survivors' context."""

    comm: Any  # the survivors' communicator
    members: tuple[int, ...]  # their world ranks, in order
    device: Device  # this rank's device, kept

    @classmethod
    def of(cls, comm: Any, device: Device) -> _Survivors:
        """The survivors `comm` holds, this rank keeping `device`."""
        group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            members = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world)
        finally:
            group.Free()
            world.Free()
        return cls(comm, tuple(members), device)


def _progress_wanted(config: DistributedConfig, thread_level: int, spare_cores: int, kind: str) -> bool:
    """Whether to run a progress thread.

    The config decides; unset, ``MPITENSOR_PROGRESS`` does; unset too, the thread runs
    where MPI provides ``MPI_THREAD_MULTIPLE`` and it can help: the node has a core to
    spare beyond one per rank, or the rank computes on a GPU (its CPU then waits anyway).
    Without a spare core the thread takes CPU time from the program's own compute, and
    communication that is CPU copying cannot overlap it: it only costs.

    Without ``MPI_THREAD_MULTIPLE`` there is none (`_check_progress_setting` refuses a
    config that asks for one then).
    """
    multiple = thread_level == MPI.THREAD_MULTIPLE
    wanted = config.progress
    if wanted is None:
        raw = os.environ.get("MPITENSOR_PROGRESS", "").strip()
        wanted = raw not in ("0", "false", "no") if raw else multiple and (spare_cores > 0 or kind == "cuda")
    return bool(wanted) and multiple


def _check_progress_setting(config: DistributedConfig, thread_level: int) -> None:
    """Refuse a config that asks for a progress thread where MPI's thread level cannot have one.

    Raises:
        ValueError: the config asks for it but MPI does not provide ``MPI_THREAD_MULTIPLE``.
    """
    if config.progress and thread_level != MPI.THREAD_MULTIPLE:
        raise ValueError(
            "DistributedConfig(progress=True) needs MPI_THREAD_MULTIPLE, but MPI provides "
            f"{_mpi.thread_level_name(thread_level)}; unset MPITENSOR_THREAD_LEVEL or use progress=False"
        )


def _tag_for(members: Sequence[int]) -> int:
    return hash(tuple(members)) % 32749


def _parse_init_devices(devices: DevicesArg, world_rank: int, world_size: int) -> tuple[tuple[int, ...], Device | None]:
    if devices is None:
        return tuple(range(world_size)), None
    if isinstance(devices, (Device, int, str)) or not isinstance(devices, Sequence):
        raise TypeError(f"devices must be a list of Devices or world ranks, or None; got {type(devices).__name__}")
    ranks: list[int] = []
    chosen = None
    for item in devices:
        if isinstance(item, Device):
            if item.rank is None:
                raise ValueError(f"device {item} has no rank: every Device passed to init must name its rank")
            rank = item.rank
            if rank == world_rank:
                chosen = item
        else:
            try:
                rank = operator.index(item)
            except TypeError:
                raise TypeError(f"devices must hold Devices or int ranks, got {type(item).__name__}") from None
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is out of range: MPI_COMM_WORLD has {world_size} ranks")
        ranks.append(rank)
    if not ranks:
        raise ValueError("devices is empty: a context needs at least one rank")
    members = tuple(sorted(set(ranks)))
    if len(members) != len(ranks):
        raise ValueError(f"devices names a rank twice: {sorted(ranks)}")
    if world_rank not in members:
        raise ValueError(
            f"rank {world_rank} called DistributedContext.init with devices of ranks {list(members)}, "
            "which do not include it; ranks outside a context do not call its init"
        )
    return members, chosen


def _choose_device(chosen: Device | None, config: DistributedConfig, local_rank: int, world_rank: int) -> Device:
    if chosen is not None:
        device = choose_device(local_rank, world_rank, kind=chosen.kind, index=chosen.index)
    else:
        device = choose_device(local_rank, world_rank, kind=config.device)
    if device.kind == "cuda":
        from .._core.backend import require_cupy

        require_cupy().cuda.Device(device.index).use()
    return device


def _in_forked_child(rank: int) -> None:
    """Right after a fork, in the child of rank `rank`: the open contexts are the parent's.

    They are forgotten (no collective finds them) and closed here without a call to MPI,
    and fail-fast is disarmed: an exception in the child ends the child only.
    """
    for ctx in _state.forget_in_child(rank):
        ctx._forsake(rank)
    _failfast.disarm_left_contexts()


_mpi.on_fork_child(_in_forked_child)


def current_context() -> DistributedContext:
    """The open context (the most recently opened one still open).

    Raises:
        NoContextError: no context is open.
    """
    return _state.current()


def local_rank_env_check(ctx: DistributedContext) -> str | None:
    """Compare the node-local rank MPI gives with the launcher's variable.

    Returns:
        None if they agree (or no variable is set), else a sentence saying how they differ.
    """
    found = local_rank_from_env()
    if found is None or found[0] == ctx.local_rank:
        return None
    value, name = found
    return f"{name}={value} but MPI's shared-memory split gives local rank {ctx.local_rank}"
