"""gloo's ``monitored_barrier`` on the ``mpitensor`` backend: rank 0 names who is late.

Every other rank sends rank 0 a token and waits for its release; rank 0 waits for the
tokens until the timeout, then either names the ranks whose token never came (gloo's
message) or releases everyone.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Protocol

__all__ = ["monitored_barrier"]

# torch's default timeout of a process group, used when neither the call nor the group sets one.
_DEFAULT_SECONDS = 1800.0


class _Group(Protocol):
    def rank(self) -> int: ...
    def size(self) -> int: ...
    def arrive(self, root: int) -> Any: ...
    def expect(self, source: int, release: bool = False) -> Any: ...
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
    """
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    else:
        seconds = float(timeout) if timeout is not None else group_timeout or _DEFAULT_SECONDS
    if group.size() == 1:
        return
    if group.rank() != 0:
        group.arrive(0).resolve()
        group.expect(0, release=True).resolve(timeout=seconds)
        return
    late = _late_ranks(group, seconds, wait_all_ranks)
    if late:
        ms = int(seconds * 1000)
        who = f"Rank {late[0]}" if len(late) == 1 else "Ranks " + ", ".join(map(str, late))
        raise RuntimeError(f"[Rank 0]: {who} failed to pass monitoredBarrier in {ms} ms")
    for handle in [group.release(rank) for rank in range(1, group.size())]:
        handle.resolve()


def _late_ranks(group: _Group, seconds: float, wait_all_ranks: bool) -> list[int]:
    arrivals = {rank: group.expect(rank) for rank in range(1, group.size())}
    deadline = time.monotonic() + seconds
    for rank, handle in arrivals.items():
        while not handle.test():
            if time.monotonic() >= deadline:
                if not wait_all_ranks:
                    return [rank]
                return [late for late, pending in arrivals.items() if not pending.test()]
            time.sleep(0.0002)
    return []
