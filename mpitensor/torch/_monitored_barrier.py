"""gloo's ``monitored_barrier`` on the ``mpitensor`` backend: rank 0 names who is late.

Every rank first starts a checked call of its own kind (`start_check`), so that a peer that
makes another call there (``dist.barrier``) is a ``CollectiveMismatchError`` on every rank
at once instead of a wait. Every other rank then sends rank 0 a token and waits for its
release; rank 0 waits for the tokens until the timeout, then either names the ranks whose
token never came (gloo's words) or, once the check has agreed, releases everyone.

A failed call leaves things posted: a receipt of a token that never came, a check a peer
never joined. The group's `Monitor` keeps them: a kept receipt takes the next token (so
tokens never pair with another call's), and at the group's end (`Monitor.settle`, from
``destroy_process_group``) every rank learns what its peers still wait for and completes it
(the tokens not sent, the checks not joined), so that no rank waits in the context's close
for a message no peer will send.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from datetime import timedelta
from typing import Any, Protocol

import numpy as np

__all__ = ["Monitor", "monitored_barrier"]

_log = logging.getLogger(__name__)

# torch's default timeout of a process group, used when neither the call nor the group sets one.
_DEFAULT_SECONDS = 1800.0
# Between tests of the pending tokens and check.
_PAUSE = 0.0002


class _Group(Protocol):
    def rank(self) -> int: ...
    def size(self) -> int: ...
    def start_check(self) -> Any: ...
    def token(self, peer: int, release: bool) -> Any: ...
    def receipt(self, peer: int, release: bool) -> Any: ...


class _Side(Protocol):
    def all_reduce_sum(self, array: np.ndarray, timeout: float | None) -> None: ...


class Monitor:
    """What a group's monitored_barrier calls leave behind: kept receipts, checks, and what was posted.

    Args:
        group: the process group (its tokens, receipts and checks).
    """

    def __init__(self, group: _Group) -> None:
        self._group = group
        self._kept: dict[tuple[int, bool], Any] = {}  # (peer, release): a receipt whose token has not come
        self._checks: list[Any] = []  # checks started, until seen complete
        self._sent: Counter[tuple[int, bool]] = Counter()  # tokens sent to each (peer, release)
        self._awaited: Counter[tuple[int, bool]] = Counter()  # receipts posted for each (peer, release)
        self._started = 0  # checks started
        self._failed = 0  # checks seen failed (a peer paired another call with one)

    def start_check(self) -> Any:
        """Start this call's check (every rank of the call does)."""
        self._prune()
        check = self._group.start_check()
        self._started += 1
        self._checks.append(check)
        return check

    def _prune(self) -> None:
        """Forget the checks that completed, counting those that failed (a peer paired another call)."""
        done = [check for check in self._checks if check.test()]
        if done:
            self._failed += sum(1 for check in done if _failed(check))
            self._checks = [check for check in self._checks if check not in done]

    def send(self, peer: int, release: bool = False) -> Any:
        """A token to `peer` (an arrival at rank 0, or rank 0's release); the send's handle."""
        self._sent[(peer, release)] += 1
        return self._group.token(peer, release)

    def expect(self, peer: int, release: bool = False) -> Any:
        """The receipt of `peer`'s next token: one an earlier failed call kept, else a new one."""
        kept = self._kept.pop((peer, release), None)
        if kept is not None:
            return kept
        self._awaited[(peer, release)] += 1
        return self._group.receipt(peer, release)

    def keep(self, peer: int, receipt: Any, release: bool = False) -> None:
        """Keep `receipt` of `peer`'s token (its call failed before the token came) for the next call."""
        if not receipt.test():
            self._kept[(peer, release)] = receipt

    def settle(self, side: _Side, timeout: float | None) -> None:
        """Complete what failed calls left posted, on every rank of the group (collective, at its end).

        Each rank tells the others, over `side` (the group's own communicator), how many
        checks it started and how many tokens it sent and awaits;
        then it starts the checks it owes, sends the tokens its peers still await, and waits
        for its own. Their outcomes belong to calls that already raised, so they are not
        raised again.

        Args:
            side: a communicator of the group's ranks apart from its collectives.
            timeout: seconds to wait at most (None: no limit).
        """
        size, rank = self._group.size(), self._group.rank()
        self._prune()
        # Each rank fills its own places (monitored_barrier is a star: arrivals go to rank 0,
        # releases come from it): its checks started (less those a peer's other call
        # consumed), the arrivals it sent and the releases it awaits; rank 0 also the
        # arrivals it awaits from each rank and the releases it sent each.
        counts = np.zeros((5, size), np.int64)
        counts[0, rank] = self._started - self._failed
        counts[1, rank] = self._sent[(0, False)]
        counts[2, rank] = self._awaited[(0, True)]
        if rank == 0:
            for peer in range(1, size):
                counts[3, peer] = self._awaited[(peer, False)]
                counts[4, peer] = self._sent[(peer, True)]
        side.all_reduce_sum(counts.reshape(-1), timeout)
        for _ in range(int(counts[0].max() - counts[0, rank])):
            self.start_check()
        pending = list(self._checks)
        if rank != 0:
            pending += [self.send(0) for _ in range(int(counts[3, rank] - counts[1, rank]))]
        else:
            for peer in range(1, size):
                pending += [self.send(peer, release=True) for _ in range(int(counts[2, peer] - counts[4, peer]))]
        pending += list(self._kept.values())
        self._kept.clear()
        self._checks = []
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in pending:
            try:
                handle.resolve(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
            except Exception as exc:
                _log.debug("monitored_barrier: a settled leftover ended with %r", exc)


def _failed(check: Any) -> bool:
    try:
        check.resolve()
    except Exception:
        return True
    return False


def monitored_barrier(group: _Group, monitor: Monitor, timeout: Any, wait_all_ranks: bool,
                      group_timeout: float | None) -> None:
    """Block until every rank of `group` arrives, or raise on rank 0 naming those that did not.

    Args:
        group: the process group.
        monitor: the group's `Monitor`.
        timeout: a ``timedelta`` or seconds; None for `group_timeout`, else 30 minutes.
        wait_all_ranks: name every late rank, not only the first.
        group_timeout: the group's own timeout in seconds, or None.

    Raises:
        RuntimeError: on rank 0, the late ranks ("[Rank 0]: Rank 1 failed to pass
            monitoredBarrier in 1000 ms"), or "Rank 0 timed out in monitoredBarrier" when
            the time was up before it could wait for a rank; on another rank, rank 0 did not
            release it in time ("Rank 2 successfully reached monitoredBarrier, but received
            errors while waiting for send/recv from rank 0"): gloo's words.
        CollectiveMismatchError: on every rank, a peer made another call (``dist.barrier``).
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout) if timeout is not None else group_timeout or _DEFAULT_SECONDS
    if group.size() == 1:
        return
    check = monitor.start_check()
    deadline = time.monotonic() + seconds
    if group.rank() != 0:
        _released(group, monitor, check, deadline)
        return
    arrivals = {rank: monitor.expect(rank) for rank in range(1, group.size())}
    try:
        late = _late_ranks(arrivals, check, deadline, wait_all_ranks, seconds)
        if not late:
            _wait(check, check, deadline)
            late = [] if check.test() else [rank for rank, token in arrivals.items() if not token.test()]
    except BaseException:
        _keep_pending(monitor, arrivals)
        raise
    if late or not check.test():
        _keep_pending(monitor, arrivals)
        raise RuntimeError(f"[Rank 0]: {_who(late)} failed to pass monitoredBarrier in {_ms(seconds)} ms")
    check.resolve()
    for handle in [monitor.send(rank, release=True) for rank in range(1, group.size())]:
        handle.resolve()


def _released(group: _Group, monitor: Monitor, check: Any, deadline: float) -> None:
    """A rank other than 0: arrive, then wait for rank 0's release until the deadline."""
    monitor.send(0)
    release = monitor.expect(0, release=True)
    try:
        _wait(release, check, deadline)
    except BaseException:
        monitor.keep(0, release, release=True)
        raise
    if not release.test():
        monitor.keep(0, release, release=True)
        raise RuntimeError(
            f"Rank {group.rank()} successfully reached monitoredBarrier, but received errors while waiting for "
            "send/recv from rank 0. Please check rank 0 logs for faulty rank."
        )
    release.resolve()
    check.resolve()  # released: rank 0 saw the check agree


def _wait(handle: Any, check: Any, deadline: float) -> None:
    """Wait until `handle` completes or the time passes, raising the check's mismatch as soon as it fails."""
    while not handle.test():
        if check.test():
            check.resolve()  # raises the mismatch, if the peers made another call
        if time.monotonic() >= deadline:
            return
        time.sleep(_PAUSE)


def _late_ranks(arrivals: dict[int, Any], check: Any, deadline: float, wait_all_ranks: bool,
                seconds: float) -> list[int]:
    processed: list[int] = []
    for rank, handle in arrivals.items():
        if not wait_all_ranks and time.monotonic() >= deadline and not handle.test():
            raise RuntimeError(_timed_out(seconds, processed))
        _wait(handle, check, deadline)
        if not handle.test():
            if not wait_all_ranks:
                return [rank]
            return [late for late, pending in arrivals.items() if not pending.test()]
        processed.append(rank)
    return []


def _timed_out(seconds: float, processed: list[int]) -> str:
    """Gloo's words when the time is up before rank 0 could wait for a rank."""
    done = (f"Successfully processed ranks: {', '.join(map(str, processed))}" if processed
            else "No ranks successfully processed in monitoredBarrier.")
    return f"Rank 0 timed out in monitoredBarrier after {_ms(seconds)} ms.\n{done}"


def _ms(seconds: float) -> int:
    return int(seconds * 1000)


def _who(late: list[int]) -> str:
    if not late:  # every token came, yet the check did not agree: a token an earlier failed call left
        return "A rank"
    return f"Rank {late[0]}" if len(late) == 1 else "Ranks " + ", ".join(map(str, late))


def _keep_pending(monitor: Monitor, arrivals: dict[int, Any]) -> None:
    """Keep the receipts of tokens that have not come, for the next call (they take its tokens)."""
    for rank, handle in arrivals.items():
        monitor.keep(rank, handle)
