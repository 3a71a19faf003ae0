"""gloo's ``monitored_barrier`` on the ``mpitensor`` backend: rank 0 names who is late.

Every rank first starts a checked call of its own kind (`start_check`), so that a peer that
makes another call there (``dist.barrier``) is a ``CollectiveMismatchError`` on every rank
at once instead of a wait. Every other rank then sends rank 0 a token and waits for its
release; rank 0 waits for the tokens until the timeout, then either names the ranks whose
token never came (gloo's message) or, once the check has agreed, releases everyone. A
receipt of a token that a failed call leaves posted is kept for the next call (`keep`), so
that tokens never pair with another call's.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Protocol

__all__ = ["monitored_barrier"]

# torch's default timeout of a process group, used when neither the call nor the group sets one.
_DEFAULT_SECONDS = 1800.0
# Between tests of the pending tokens and check.
_PAUSE = 0.0002


class _Group(Protocol):
    def rank(self) -> int: ...
    def size(self) -> int: ...
    def start_check(self) -> Any: ...
    def arrive(self, root: int) -> Any: ...
    def expect(self, source: int, release: bool = False) -> Any: ...
    def keep(self, source: int, receipt: Any, release: bool = False) -> None: ...
    def release(self, rank: int) -> Any: ...


def monitored_barrier(group: _Group, timeout: Any, wait_all_ranks: bool, group_timeout: float | None) -> None:
    """Block until every rank of `group` arrives, or raise on rank 0 naming those that did not.

    Args:
        group: the process group.
        timeout: a ``timedelta`` or seconds; None for `group_timeout`, else 30 minutes.
        wait_all_ranks: name every late rank, not only the first.
        group_timeout: the group's own timeout in seconds, or None.

    Raises:
        RuntimeError: on rank 0, the late ranks ("Rank 1 failed to pass monitoredBarrier in
            1000 ms", as gloo says).
        CollectiveTimeoutError: on another rank, when rank 0 does not release it in time.
        CollectiveMismatchError: on every rank, a peer made another call (``dist.barrier``).
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout) if timeout is not None else group_timeout or _DEFAULT_SECONDS
    if group.size() == 1:
        return
    check = group.start_check()
    deadline = time.monotonic() + seconds
    if group.rank() != 0:
        group.arrive(0)
        release = group.expect(0, release=True)
        try:
            _wait(release, check, deadline)
        except BaseException:
            if not release.test():
                group.keep(0, release, release=True)
            raise
        release.resolve(timeout=max(deadline - time.monotonic(), 1e-3))  # the timeout's error, if it passed
        check.resolve()  # released: rank 0 saw the check agree
        return
    arrivals = {rank: group.expect(rank) for rank in range(1, group.size())}
    try:
        late = _late_ranks(arrivals, check, deadline, wait_all_ranks)
        if not late:
            _wait(check, check, deadline)
            late = [] if check.test() else [rank for rank, token in arrivals.items() if not token.test()]
    except BaseException:
        _keep_pending(group, arrivals)
        raise
    if late or not check.test():
        _keep_pending(group, arrivals)
        raise RuntimeError(f"[Rank 0]: {_who(late)} failed to pass monitoredBarrier in {int(seconds * 1000)} ms")
    check.resolve()
    for handle in [group.release(rank) for rank in range(1, group.size())]:
        handle.resolve()


def _wait(handle: Any, check: Any, deadline: float) -> None:
    """Wait until `handle` completes or the time passes, raising the check's mismatch as soon as it fails."""
    while not handle.test():
        if check.test():
            check.resolve()  # raises the mismatch, if the peers made another call
        if time.monotonic() >= deadline:
            return
        time.sleep(_PAUSE)


def _late_ranks(arrivals: dict[int, Any], check: Any, deadline: float, wait_all_ranks: bool) -> list[int]:
    for rank, handle in arrivals.items():
        _wait(handle, check, deadline)
        if not handle.test():
            if not wait_all_ranks:
                return [rank]
            return [late for late, pending in arrivals.items() if not pending.test()]
    return []


def _who(late: list[int]) -> str:
    if not late:  # every token came, yet the check did not agree: a token an earlier failed call left
        return "A rank"
    return f"Rank {late[0]}" if len(late) == 1 else "Ranks " + ", ".join(map(str, late))


def _keep_pending(group: _Group, arrivals: dict[int, Any]) -> None:
    """Keep the receipts of tokens that have not come, for the next call (they take its tokens)."""
    for rank, handle in arrivals.items():
        if not handle.test():
            group.keep(rank, handle)
