"""`Work`: what the ``mpitensor`` process group returns for each torch collective.

A `Work` holds the mpitensor handles of one torch call and a `finish` step that writes
their results into the caller's output tensors. ``wait()`` resolves and finishes it.
``get_future()`` gives a future that completes with no one calling ``wait()`` (DDP and its
communication hooks chain on it): the `Completer` thread finishes such works in call order,
so the thread that posted them goes on computing meanwhile, and runs their callbacks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ._completer import Completer, HookFuture
from ._unseen import unseen_by_dynamo

__all__ = ["Work", "done_work", "finished_work", "waited"]


@unseen_by_dynamo
class Work(dist.Work):
    """The pending result of one torch collective on the ``mpitensor`` backend.

    Args:
        handles: the mpitensor `CollectiveTensor` handles the call started.
        finish: called once with their results (in order) when all are resolved; writes
            them into the caller's tensors.
        outputs: what the future's value is (torch's convention: the output tensors).
        timeout: seconds a wait may take (None: the context's timeout).
        completer: the thread that completes futures asked for before ``wait()``.
    """

    # Defaults as class attributes: a work is made for every call, and most never fail.
    _finished = False
    _error: BaseException | None = None
    _future: torch.futures.Future | None = None
    _deadline: float | None = None
    _received: Sequence[Any] = ()  # a receive from any rank's handles, kept for `_source_rank`

    def __init__(
        self,
        handles: Sequence[Any],
        finish: Callable[[list[Any]], None] | None,
        outputs: Any,
        timeout: float | None,
        completer: Completer,
    ) -> None:
        super().__init__()
        self._handles = handles
        self._finish = finish
        self._outputs = outputs
        self._timeout = timeout
        self._completer = completer
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the collective is complete and its outputs are written.

        Args:
            timeout: at most this long (torch's zero default: the process group's timeout).

        Returns:
            True.

        Raises:
            CollectiveTimeoutError: the time passed (the mpitensor context is then broken).
            CollectiveMismatchError: the ranks disagreed on this call.
        """
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        self.complete(seconds if seconds else self._timeout)
        return True

    def keep_source(self) -> Work:
        """Keep this receive's handles once it completes, for `_source_rank` (itself, for chaining).

        Only a receive's: other works let their handles go at completion, as those hold the
        inputs' copy-on-write clones.
        """
        self._received = self._handles
        return self

    def complete(self, timeout: float | None) -> None:
        """Resolve the handles and finish, once; later calls raise the same error, if any.

        Raises:
            The mpitensor error of the failed collective.
        """
        with self._lock:
            if not self._finished:
                try:
                    results = [handle.resolve(timeout) for handle in self._handles]
                    # The handles hold the copy-on-write clones of CPU inputs: were they alive
                    # when finish writes an input in place, torch would copy it first.
                    self._handles = ()
                    if self._finish is not None:
                        with torch.no_grad():  # a parameter's values are written as gloo writes them
                            self._finish(results)
                except BaseException as exc:
                    self._error = exc
                self._finished = True
                self._handles = ()
                self._settle_future()
        if self._error is not None:
            raise self._error

    def poll(self) -> bool:
        """One step of `complete` for the completer thread: True once finished.

        Tests the handles (each test advances MPI) and completes the work once they are done
        or its timeout has passed; errors go to the future and to ``wait()`` only.
        """
        if self._deadline is None:
            self._deadline = float("inf") if self._timeout is None else time.monotonic() + self._timeout
        if not self._finished and time.monotonic() < self._deadline:
            try:
                if not all(handle.test() for handle in self._handles):
                    return False
            except BaseException:  # complete() raises it again, for the future to carry
                pass
        try:
            self.complete(self._timeout)
        except BaseException:  # the future and wait() carry it
            pass
        return True

    def is_completed(self) -> bool:
        """True once the outputs are written (never blocks)."""
        if self._finished:
            return True
        if all(handle.test() for handle in self._handles):
            try:
                self.complete(self._timeout)
            except BaseException:  # wait() and the future report it
                pass
            return True
        return False

    def _source_rank(self) -> int:  # torch's name
        """The group rank a receive from any rank took its message from (``dist.recv`` with no source).

        Raises:
            RuntimeError: not a receive from any rank, or its message has not arrived yet.
        """
        for handle in self._received:
            source = getattr(handle, "source", None)
            if source is not None:
                return source
        raise RuntimeError("_source_rank(): this work is no receive from any rank whose message has arrived")

    def is_success(self) -> bool:
        """True when complete without an error."""
        return self.is_completed() and self._error is None

    def exception(self) -> BaseException | None:
        """The error the collective ended with, or None."""
        return self._error

    def result(self) -> list[torch.Tensor]:
        """The output tensors (after `wait`)."""
        self.wait()
        return list(self._outputs) if isinstance(self._outputs, (list, tuple)) else [self._outputs]

    def synchronize(self) -> None:
        """Block until complete (torch's alias of ``wait`` for CPU work)."""
        self.wait()

    def get_future(self) -> torch.futures.Future:
        """A future that completes with the outputs when the collective does, unwaited.

        Its callbacks run on the completer thread (see `HookFuture`).
        """
        with self._lock:
            if self._future is None:
                self._future = HookFuture(self._completer, self._completer.open_chain())
                if self._finished:
                    self._settle_future()
                else:
                    self._completer.submit(self)
            return self._future

    def _settle_future(self) -> None:
        future = self._future
        if future is None or future.done():
            return
        if self._error is not None:
            future.set_exception(self._error)
        else:
            future.set_result(self._outputs)


def done_work(outputs: Any, completer: Completer) -> Work:
    """A `Work` that is complete already (an operation with nothing to send)."""
    work = Work((), None, outputs, None, completer)
    work.complete(None)
    return work


def finished_work(completer: Completer, outputs: Any = ()) -> Any:
    """A work that is complete already, for calls that finish before they return.

    torch waits on the work a synchronous call returns: this one is torch's own, made from a
    finished future, so that wait stays in C++ instead of crossing into Python (a microsecond
    of an 8-byte all-reduce). Where torch lacks that maker, a finished `Work`.

    Args:
        completer: the group's completer (for the fallback `Work`).
        outputs: the tensors the future's value lists.
    """
    try:
        from torch._C._distributed_c10d import _create_work_from_future
    except ImportError:
        return done_work(list(outputs), completer)
    future: Any = torch.futures.Future()
    future.set_result(list(outputs))
    return _create_work_from_future(future)


@unseen_by_dynamo
class _Waited:
    """A torch work seen as a handle of `Work`: resolving it waits for the work, testing it polls."""

    def __init__(self, work: dist.Work) -> None:
        self._work = work

    def resolve(self, timeout: float | None = None) -> None:
        if timeout:
            self._work.wait(timedelta(seconds=timeout))
        else:
            self._work.wait()

    def test(self) -> bool:
        return self._work.is_completed()


def waited(work: dist.Work) -> Any:
    """`work` as a handle a `Work` holds (its ``resolve`` waits for it, its ``test`` polls it)."""
    return _Waited(work)
