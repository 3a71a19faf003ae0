"""The thread that completes futures of the ``mpitensor`` backend, and runs their callbacks.

torch completes a future's callbacks in the thread that completes the future, or in the
thread that attaches them when it is complete already. A DDP communication hook such as
PowerSGD chains callbacks that start collectives of their own, so which thread runs them,
and in which order, decides whether every rank posts in one order. Here every callback of a
backend future runs on the one `Completer` thread, never on the thread that attached it, and
in an order every rank shares: the futures of one ``get_future()`` call form a *chain*
(numbered in call order, the same on every rank, as every rank makes the same calls), and a
chain's callbacks run before any of a later chain's. A chain is done once a later chain was
opened (its hook has returned, so all its callbacks are attached) and each callback attached
to it has run.

The thread also runs a *server* of the group's (`serve`) at least every `_SERVE_EVERY`
seconds, idle or not: a peer whose callback waits for a collective this rank's callbacks
never start learns of it there (see `HookCollectives.serve`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

__all__ = ["Completer", "HookFuture"]

_log = logging.getLogger(__name__)

# The completer's waits between tests of a pending work: short at first (small buckets
# finish fast), at most a fraction of a large bucket's transfer time.
_FIRST_PAUSE = 20e-6
_LONGEST_PAUSE = 500e-6
# How often the server runs: a peer asks only after it waited a second.
_SERVE_EVERY = 0.1


class Pollable(Protocol):
    """A work the completer finishes: `poll` tests it once and is True once it is finished."""

    def poll(self) -> bool:
        """One step of completion; True once finished (its future then set)."""


class Completer:
    """A daemon thread that finishes works in call order and runs their futures' callbacks.

    Works are tested one after another (the thread never posts a collective and never waits
    inside MPI, which would hold the engine while the posting thread needs it); between
    tests it runs the callbacks its chains allow.
    """

    def __init__(self) -> None:
        self._works: deque[Pollable] = deque()
        self._calls: dict[int, deque[Callable[[], None]]] = {}
        self._attached: dict[int, int] = {}  # per chain: callbacks attached that have not run
        self._newest = -1
        self._sealed = -1  # chains up to it: the thread that opened them made a later call
        self._first_open = 0  # chains below it are done
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._stopping = False
        self.chain: int | None = None  # the chain whose callback runs now (on the thread)
        self.serve: Callable[[], None] | None = None  # run on the thread now and then

    def on_thread(self) -> bool:
        """Whether the caller is the completer thread (a callback is running)."""
        return threading.get_ident() == self._ident

    def submit(self, work: Pollable) -> None:
        """Finish `work` in the background (its future is then set)."""
        with self._ready:
            self._works.append(work)
            self._start()
            self._ready.notify()

    def open_chain(self) -> int:
        """A new chain's number (for a future asked of a work); earlier chains can now finish."""
        with self._ready:
            self._newest += 1
            self._ready.notify()
            return self._newest

    def seal(self) -> None:
        """Note a collective call by the program's thread: the chains opened so far take no more callbacks.

        (Their hooks have returned: a hook's callbacks are attached before its thread's next call.)
        """
        self._sealed = self._newest

    def finished(self, chain: int) -> bool:
        """Whether `chain` was opened, takes no more callbacks, and each callback attached to it has run."""
        with self._ready:
            if chain < self._first_open:
                return True
            sealed = chain < self._newest or chain <= self._sealed
            return chain <= self._newest and sealed and not self._attached.get(chain) and not self._calls.get(chain)

    def attach(self, chain: int) -> None:
        """Count a callback attached to a future of `chain` (the chain waits until it has run)."""
        with self._ready:
            self._attached[chain] = self._attached.get(chain, 0) + 1

    def run_later(self, chain: int, call: Callable[[], None]) -> None:
        """Run `call` on the completer thread in `chain`'s turn (its future is complete)."""
        with self._ready:
            self._calls.setdefault(chain, deque()).append(call)
            self._start()
            self._ready.notify()

    def stop(self) -> None:
        """Let the thread end once it has finished what it holds (the group is destroyed).

        A later `submit` or `run_later` starts a thread again.
        """
        with self._ready:
            self._stopping = True
            self._ready.notify()

    def _start(self) -> None:
        self._stopping = False
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mpitensor-torch-completer", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        self._ident = threading.get_ident()
        pause = _FIRST_PAUSE
        served = time.monotonic()
        while True:
            if self.serve is not None and time.monotonic() - served >= _SERVE_EVERY:
                self._serve()
                served = time.monotonic()
            with self._ready:
                chain, call, work = self._next()
                while call is None and work is None:
                    if self._stopping:  # nothing left, and nothing more will come
                        self._thread = self._ident = None
                        return
                    self._ready.wait(None if self.serve is None else _SERVE_EVERY)
                    if self.serve is not None and time.monotonic() - served >= _SERVE_EVERY:
                        break  # to serve (nothing taken from the queues)
                    chain, call, work = self._next()
            if call is not None:
                self._call(chain, call)
            elif work is None:
                continue
            elif work.poll():
                with self._ready:
                    self._works.popleft()
                pause = _FIRST_PAUSE
            else:
                with self._ready:  # a callback made ready meanwhile wakes it
                    if self._next()[1] is None:
                        self._ready.wait(pause)
                pause = min(2 * pause, _LONGEST_PAUSE)

    def _next(self) -> tuple[int, Callable[[], None] | None, Pollable | None]:
        """Under the lock: the callback whose turn it is, else the oldest unfinished work."""
        while self._done(self._first_open):
            self._calls.pop(self._first_open, None)
            self._attached.pop(self._first_open, None)
            self._first_open += 1
        for chain in sorted(self._calls):
            if chain > self._first_open:
                break
            if self._calls[chain]:
                return chain, self._calls[chain].popleft(), None
        return -1, None, self._works[0] if self._works else None

    def _done(self, chain: int) -> bool:
        return chain < self._newest and not self._attached.get(chain) and not self._calls.get(chain)

    def _serve(self) -> None:
        try:
            self.serve()
        except BaseException:  # the server keeps what it found for the program's thread
            _log.exception("the server of an mpitensor group's completer raised")

    def _call(self, chain: int, call: Callable[[], None]) -> None:
        self.chain = chain
        try:
            call()
        except BaseException:  # a callback's error belongs to its future (then() sets it there)
            _log.exception("a callback of an mpitensor future raised")
        finally:
            self.chain = None
            with self._ready:
                self._attached[chain] = self._attached.get(chain, 1) - 1


class HookFuture(torch.futures.Future):
    """A future whose callbacks run on the completer thread, in their chain's turn.

    Args:
        completer: the thread that runs the callbacks.
        chain: the chain the future belongs to (``then`` passes it on).
    """

    def __init__(self, completer: Completer, chain: int) -> None:
        super().__init__()
        self._completer = completer
        self._chain = chain

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> HookFuture:
        """A future of `callback`'s result (or its exception), which runs once this completes.

        Args:
            callback: called with this future on the completer thread.

        Returns:
            A future of the same chain.
        """
        child = HookFuture(self._completer, self._chain)

        def run(parent: torch.futures.Future) -> None:
            try:
                result = callback(parent)
            except BaseException as exc:
                child.set_exception(exc)
            else:
                child.set_result(result)

        self.add_done_callback(run)
        return child

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        """Run `callback(self)` on the completer thread once this future completes.

        Args:
            callback: its errors are logged, not raised (torch's rule for done callbacks).
        """
        completer, chain = self._completer, self._chain
        completer.attach(chain)
        super().add_done_callback(lambda future: completer.run_later(chain, lambda: callback(future)))
