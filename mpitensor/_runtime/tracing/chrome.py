"""The ranks' dumps as one Chrome Trace Event file (opens in ui.perfetto.dev and chrome://tracing).

One process per rank, thread 0 its collectives and thread 1 its regions, on the common clock in microseconds from
the earliest recorded moment of any rank. Flow arrows run from the last-arriving rank's call to each peer's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .stragglers import MOMENTS, MatchedCollective, TraceSummary, check_dumps, group_table, summarize

__all__ = ["chrome_trace", "earliest_ns", "group_label", "rank_events"]

_COLLECTIVES, _REGIONS = 0, 1
_LISTED_MEMBERS = 16  # a larger group is named in an event by its size and first and last ranks
# Within one thread at one time: metadata first, then enclosing slices before what they enclose, then flows.
_PHASE_ORDER = {"M": 0, "X": 1, "s": 2, "f": 3}


def _local_moments(dump: Mapping[str, Any]) -> Iterator[int]:
    for name in MOMENTS:
        yield from dump["events"][name]
    regions = dump.get("regions", {})
    yield from regions.get("start", ())
    yield from regions.get("end", ())


def _last_local_ns(dump: Mapping[str, Any]) -> int:
    return max((time for time in _local_moments(dump) if time), default=0)


def earliest_ns(dumps: Sequence[Mapping[str, Any]]) -> int:
    """The earliest recorded moment of any rank, on the common clock (0 when nothing was recorded).

    Args:
        dumps: the ranks' dumps.

    Returns:
        Nanoseconds on the common clock.
    """
    starts = [min(moments) + dump["offset_ns"] for dump in dumps if (moments := [t for t in _local_moments(dump) if t])]
    return min(starts, default=0)


def _us(local_ns: int, dump: Mapping[str, Any], t0_ns: int) -> float:
    return (local_ns + dump["offset_ns"] - t0_ns) / 1000.0


def _metadata(rank: int, host: str) -> list[dict[str, Any]]:
    base = {"ph": "M", "pid": rank, "ts": 0}
    return [
        {**base, "tid": _COLLECTIVES, "name": "process_name", "args": {"name": f"rank {rank} ({host})"}},
        {**base, "tid": _COLLECTIVES, "name": "process_sort_index", "args": {"sort_index": rank}},
        {**base, "tid": _COLLECTIVES, "name": "thread_name", "args": {"name": "collectives"}},
        {**base, "tid": _REGIONS, "name": "thread_name", "args": {"name": "regions"}},
    ]


def _slice(dump: Mapping[str, Any], tid: int, name: str, cat: str, span: tuple[int, int, int], t0_ns: int,
           args: dict[str, Any]) -> dict[str, Any]:
    """An "X" event of `dump`'s rank from ``span[0]`` to ``span[1]`` (local ns), or to ``span[2]`` where that is 0."""
    start, end, end_ns = span
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "pid": dump["rank"],
        "tid": tid,
        "ts": _us(start, dump, t0_ns),
        "dur": max((end or end_ns) - start, 0) / 1000.0,
        "args": args,
    }


def group_label(members: Sequence[int]) -> list[int] | str:
    """How an event shows its group: the ranks, or for a large group its size and ends (bounded per event)."""
    if len(members) <= _LISTED_MEMBERS:
        return list(members)
    return f"{len(members)} ranks, {members[0]}..{members[-1]}"


def _collective(dump: Mapping[str, Any], row: int, group: list[int] | str, t0_ns: int,
                end_ns: int) -> dict[str, Any]:
    events = dump["events"]
    called, complete = events["called"][row], events["complete"][row]
    args: dict[str, Any] = {
        "id": events["id"][row],
        "group": group,
        "seq": events["seq"][row],
        "bytes": events["nbytes"][row],
        "dtype": events["dtype"][row],
        "transport": events["transport"][row],
    }
    args.update({f"{name}_us": (events[name][row] - called) / 1000.0 for name in MOMENTS if events[name][row]})
    if not complete:
        # Still in flight when the rank dumped: the bar runs to the last moment the rank recorded anything.
        args["incomplete"] = True
    return _slice(dump, _COLLECTIVES, events["kind"][row], "collective", (called, complete, end_ns), t0_ns, args)


def _region(dump: Mapping[str, Any], row: int, t0_ns: int, end_ns: int) -> dict[str, Any]:
    regions = dump["regions"]
    start, end = regions["start"][row], regions["end"][row]
    args: dict[str, Any] = {"depth": regions["depth"][row]}
    if not end:
        args["open"] = True
    return _slice(dump, _REGIONS, regions["name"][row], "region", (start, end, end_ns), t0_ns, args)


def rank_events(dump: Mapping[str, Any], t0_ns: int,
                groups: Mapping[int, Sequence[int]] | None = None) -> list[dict[str, Any]]:
    """One rank's trace events: its metadata, collectives and regions (no flows: those need the other ranks).

    Args:
        dump: the rank's dump.
        t0_ns: the common-clock moment that becomes ts 0.
        groups: every group's members (`group_table` of all the dumps); None: those `dump` lists.

    Returns:
        The events, sorted by (tid, ts).
    """
    end_ns = _last_local_ns(dump)
    table = group_table([dump]) if groups is None else groups
    labels = {group: group_label(members) for group, members in table.items()}
    events = _metadata(dump["rank"], str(dump.get("host", "")))
    events += [
        _collective(dump, row, labels.get(group, []), t0_ns, end_ns)
        for row, group in enumerate(dump["events"]["group"])
    ]
    events += [_region(dump, row, t0_ns, end_ns) for row in range(len(dump.get("regions", {}).get("name", ())))]
    return sorted(events, key=_sort_key)


def _wait_moment(dump: Mapping[str, Any], row: int) -> int:
    """Where a peer's wait for the last rank ended: the agreement if recorded, else completion, else the call."""
    events = dump["events"]
    return events["agreed"][row] or events["complete"][row] or events["called"][row]


def _flows(
    collective: MatchedCollective, by_rank: Mapping[int, Mapping[str, Any]], t0_ns: int, ids: Iterator[int]
) -> list[dict[str, Any]]:
    last = by_rank[collective.last]
    start = _us(last["events"]["called"][collective.row[collective.last]], last, t0_ns)
    base = {"name": f"waited for rank {collective.last}", "cat": "straggler", "tid": _COLLECTIVES}
    flows = []
    for peer in collective.members:
        if peer != collective.last:
            flow_id, dump = next(ids), by_rank[peer]
            flows.append({**base, "ph": "s", "id": flow_id, "pid": collective.last, "ts": start})
            ts = _us(_wait_moment(dump, collective.row[peer]), dump, t0_ns)
            flows.append({**base, "ph": "f", "bp": "e", "id": flow_id, "pid": peer, "ts": ts})
    return flows


def _sort_key(event: Mapping[str, Any]) -> tuple[int, int, float, int, float]:
    return (event["pid"], event["tid"], event["ts"], _PHASE_ORDER[event["ph"]], -event.get("dur", 0.0))


def chrome_trace(dumps: Sequence[Mapping[str, Any]], summary: TraceSummary | None = None) -> dict[str, Any]:
    """The Chrome Trace Event object of a run: every rank's collectives and regions, and straggler flows.

    Args:
        dumps: the ranks' dumps (the recorder's format), any order.
        summary: `summarize(dumps)`, if already computed.

    Returns:
        ``{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}``, JSON-serialisable, events
        sorted by (pid, tid, ts).

    Raises:
        TypeError, ValueError: as `summarize`.
    """
    ordered = check_dumps(dumps)
    summary = summary if summary is not None else summarize(ordered)
    t0_ns = earliest_ns(ordered)
    by_rank = {dump["rank"]: dump for dump in ordered}
    table = group_table(ordered)
    events = [event for dump in ordered for event in rank_events(dump, t0_ns, table)]
    ids = itertools.count(1)
    events += [flow for collective in summary.collectives for flow in _flows(collective, by_rank, t0_ns, ids)]
    events.sort(key=_sort_key)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "clock": "common (rank 0's) clock, microseconds from the earliest recorded moment",
            "t0_ns": t0_ns,
            "mpitensor_summary": summary.as_dict(),
        },
    }
