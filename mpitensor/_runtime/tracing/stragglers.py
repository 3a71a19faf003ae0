"""Who arrived last at each collective, and how long the others waited for it.

A collective is the same one on every member of its group when (group, seq) agree. Its arrival on a rank is
``called + offset_ns``: the call's entry on the common (rank 0's) clock.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MOMENTS",
    "KindStats",
    "MatchedCollective",
    "Matching",
    "RankStats",
    "TraceSummary",
    "check_dump_values",
    "check_dumps",
    "duration_text",
    "group_table",
    "match_collectives",
    "summarize",
]

MOMENTS = ("called", "agreed", "posted", "complete", "resolved")
_EVENT_COLUMNS = ("id", "kind", "group", "seq", "nbytes", "dtype", "transport", *MOMENTS)
_REGION_COLUMNS = ("name", "start", "end", "depth")
_DUMP_KEYS = ("rank", "size", "offset_ns", "groups", "events")
_UNITS = (("s", 1_000_000_000), ("ms", 1_000_000), ("us", 1_000))


def duration_text(ns: float) -> str:
    """A duration in words with two significant figures or more: ``830 ns``, ``4.1 s``, ``12 ms``.

    Args:
        ns: the duration in nanoseconds.

    Returns:
        The duration in the largest unit (s, ms, us, ns) in which it is at least 1.
    """
    for unit, scale in _UNITS:
        if abs(ns) >= scale:
            value = ns / scale
            return f"{value:.1f} {unit}" if abs(value) < 9.95 else f"{value:.0f} {unit}"
    return f"{ns:.0f} ns"


def _columns(dump: Mapping[str, Any], name: str, keys: Sequence[str]) -> Mapping[str, list[Any]]:
    table = dump.get(name, {key: [] for key in keys})
    if not isinstance(table, Mapping):
        raise TypeError(
            f"rank {dump['rank']}'s {name} is a {type(table).__name__}, not a dict of columns: the dump is corrupt"
        )
    missing = [key for key in keys if key not in table]
    if missing:
        raise ValueError(f"rank {dump['rank']}'s dump has no {name} column(s) {missing}: expected {list(keys)}")
    wrong = [key for key in keys if not isinstance(table[key], list)]
    if wrong:
        raise TypeError(f"rank {dump['rank']}'s {name} column(s) {wrong} are not lists: the dump is corrupt")
    lengths = {key: len(table[key]) for key in keys}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"rank {dump['rank']}'s {name} columns differ in length ({lengths}): the dump is corrupt")
    return table


def _check_dump(dump: Mapping[str, Any]) -> None:
    if not isinstance(dump, Mapping):
        raise TypeError(f"expected each dump to be a dict, got {type(dump).__name__}")
    missing = [key for key in _DUMP_KEYS if key not in dump]
    if missing:
        raise ValueError(f"a dump lacks {missing}: expected the recorder's dump with keys {list(_DUMP_KEYS)}")
    wrong = [key for key in ("rank", "size", "offset_ns") if not _is_int(dump[key])]
    if wrong:
        values = {key: dump[key] for key in wrong}
        raise TypeError(f"a dump's {wrong} are not integers ({values!r:.200}): the dump is corrupt")
    if dump["rank"] < 0 or dump["size"] < 1:
        raise ValueError(f"a dump has rank {dump['rank']} of size {dump['size']}: the dump is corrupt")
    if not isinstance(dump["groups"], Mapping):
        raise TypeError(
            f"rank {dump['rank']}'s groups is a {type(dump['groups']).__name__}, not a dict of group -> ranks: "
            "the dump is corrupt"
        )
    events = _columns(dump, "events", _EVENT_COLUMNS)
    _columns(dump, "regions", _REGION_COLUMNS)
    if 0 in events["called"]:
        row = events["called"].index(0)
        raise ValueError(f"rank {dump['rank']}'s event {events['id'][row]} has no 'called' time: the dump is corrupt")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_TEXT_COLUMNS = {"kind", "dtype", "transport", "name"}


def check_dump_values(dump: Mapping[str, Any]) -> None:
    """Check every value of one dump (read from a file) against the recorder's format.

    `check_dumps` checks the structure (what the recorder always gets right); this checks
    each value too, for a dump from a file that may have been damaged or edited.

    Args:
        dump: a dump that passed `check_dumps`.

    Raises:
        TypeError: a value of the wrong type (a group's ranks that are not integers, a text
            column with a number...), naming where.
        ValueError: a group's key that is not an integer.
    """
    rank = dump["rank"]
    for key, ranks in dump["groups"].items():
        if not isinstance(key, str) or not key.lstrip("-").isdigit():
            raise ValueError(f"rank {rank}'s groups has the key {key!r}, not a group number: the dump is corrupt")
        if not isinstance(ranks, list) or not all(_is_int(member) for member in ranks):
            raise TypeError(f"rank {rank}'s group {key} is {ranks!r:.200}, not a list of ranks: the dump is corrupt")
    for name, keys in (("events", _EVENT_COLUMNS), ("regions", _REGION_COLUMNS)):
        table = dump.get(name, {})
        for key in keys:
            expected, kind = ("strings", str) if key in _TEXT_COLUMNS else ("integers", int)
            column = table.get(key, [])
            row = next((row for row, value in enumerate(column) if type(value) is not kind), None)
            if row is not None:
                raise TypeError(
                    f"rank {rank}'s {name} column {key!r} holds {column[row]!r:.100} at row {row}, where it "
                    f"holds {expected}: the dump is corrupt"
                )
    for key, kind in (("host", str), ("check", bool), ("dropped", int), ("capacity", int)):
        if key in dump and type(dump[key]) is not kind:
            raise TypeError(f"rank {rank}'s {key} is {dump[key]!r:.100}, not a {kind.__name__}: the dump is corrupt")


def check_dumps(dumps: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Check that the dumps are one run's, one per rank, and return them in rank order.

    Args:
        dumps: the ranks' dumps (any subset of the ranks, in any order).

    Returns:
        The dumps sorted by rank.

    Raises:
        TypeError: a dump is not a dict.
        ValueError: no dumps, a dump lacks keys or columns, two dumps share a rank, or the sizes differ.
    """
    if not dumps:
        raise ValueError("no dumps given: expected one dump per rank (at least one)")
    for dump in dumps:
        _check_dump(dump)
    ordered = sorted(dumps, key=lambda dump: dump["rank"])
    ranks = [dump["rank"] for dump in ordered]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"two dumps have the same rank (ranks {ranks}): expected one dump per rank of one run")
    sizes = {dump["rank"]: dump["size"] for dump in ordered}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"the dumps disagree on the job's size (rank: size {sizes}): they are not from one run")
    return ordered


@dataclass(frozen=True)
class MatchedCollective:
    """One collective found on every member of its group.

    Attributes:
        group: the group hash.
        seq: its ordinal in the group.
        kind: what it was ("all_reduce", ...), as the lowest member recorded it.
        members: the group's world ranks, ascending.
        arrival_ns: each member's arrival on the common clock.
        row: each member's index into its dump's event columns.
        last: the last-arriving rank (ties: the lowest).
        lateness_ns: how much later than the second-latest member it arrived.
        wait_ns: the others' waits for it, summed.
    """

    group: int
    seq: int
    kind: str
    members: tuple[int, ...]
    arrival_ns: Mapping[int, int]
    row: Mapping[int, int]
    last: int
    lateness_ns: int
    wait_ns: int


@dataclass(frozen=True)
class Matching:
    """The collectives of some dumps, matched across ranks.

    Attributes:
        collectives: the matched ones, in the order the last member arrived.
        unmatched_by_kind: per kind, how many (group, seq) were missing on some member (lost to a ring, or that
            member's dump is absent).
        single_rank: collectives of 1-rank groups, skipped.
    """

    collectives: tuple[MatchedCollective, ...]
    unmatched_by_kind: Mapping[str, int]
    single_rank: int


def group_table(dumps: Sequence[Mapping[str, Any]]) -> dict[int, tuple[int, ...]]:
    """Every group the dumps list, with its members (world ranks, ascending).

    A merged trace lists each group once, in its first member's dump; a part lists every group
    of its rank. Either way the table is the union.

    Raises:
        ValueError: two dumps list one group with different members.
    """
    members: dict[int, tuple[int, ...]] = {}
    listed_by: dict[int, int] = {}
    for dump in dumps:
        for key, listed in dump["groups"].items():
            group, ranks = int(key), tuple(sorted(int(rank) for rank in listed))
            if members.setdefault(group, ranks) != ranks:
                raise ValueError(
                    f"group {group} has members {list(members[group])} on rank {listed_by[group]} but "
                    f"{list(ranks)} on rank {dump['rank']}: the dumps are not from one run"
                )
            listed_by.setdefault(group, dump["rank"])
    return members


def _sightings(
    dumps: Sequence[Mapping[str, Any]], members: Mapping[int, tuple[int, ...]]
) -> dict[tuple[int, int], dict[int, int]]:
    """(group, seq) -> {rank: row}, checking that each rank is a member of the groups it recorded."""
    seen: dict[tuple[int, int], dict[int, int]] = defaultdict(dict)
    member_sets = {group: frozenset(ranks) for group, ranks in members.items()}  # a look-up per event, not a scan
    for dump in dumps:
        rank, events = dump["rank"], dump["events"]
        for row, key in enumerate(zip(events["group"], events["seq"])):
            if rank not in member_sets.get(key[0], ()):
                raise ValueError(
                    f"rank {rank}'s event {events['id'][row]} is on group {key[0]}, which its dump's 'groups' does "
                    f"not list with rank {rank} in it: the dump is corrupt"
                )
            if rank in seen[key]:
                raise ValueError(f"rank {rank} recorded seq {key[1]} of group {key[0]} twice: the dump is corrupt")
            seen[key][rank] = row
    return seen


def _matched(group: int, seq: int, kind: str, rows: dict[int, int], dumps: Mapping[int, Any]) -> MatchedCollective:
    arrival = {rank: dumps[rank]["events"]["called"][row] + dumps[rank]["offset_ns"] for rank, row in rows.items()}
    last = min(arrival, key=lambda rank: (-arrival[rank], rank))
    others = [time for rank, time in arrival.items() if rank != last]
    return MatchedCollective(
        group=group,
        seq=seq,
        kind=kind,
        members=tuple(sorted(rows)),
        arrival_ns=arrival,
        row=rows,
        last=last,
        lateness_ns=arrival[last] - max(others),
        wait_ns=sum(arrival[last] - time for time in others),
    )


def match_collectives(dumps: Sequence[Mapping[str, Any]]) -> Matching:
    """Match the collectives recorded by the ranks: those present on every member of their group.

    Args:
        dumps: the ranks' dumps.

    Returns:
        The matched collectives and the counts of the others.

    Raises:
        TypeError, ValueError: as `check_dumps`; also a group listed with different members by two ranks, or an
            event on a group that its rank's dump does not list it in.
    """
    ordered = check_dumps(dumps)
    by_rank = {dump["rank"]: dump for dump in ordered}
    members = group_table(ordered)
    matched, unmatched, single = [], Counter(), 0
    for (group, seq), rows in _sightings(ordered, members).items():
        first = min(rows)
        kind = by_rank[first]["events"]["kind"][rows[first]]
        if len(members[group]) == 1:
            single += 1
        elif set(rows) != set(members[group]):
            unmatched[kind] += 1
        else:
            matched.append(_matched(group, seq, kind, rows, by_rank))
    matched.sort(key=lambda c: (c.arrival_ns[c.last], c.group, c.seq))
    return Matching(tuple(matched), dict(unmatched), single)


@dataclass(frozen=True)
class KindStats:
    """One rank's record at one kind of collective.

    Attributes:
        member: matched collectives of this kind the rank was a member of.
        last: how many of them it arrived last at.
        wait_caused_ns: the others' total wait for it at them.
        median_lateness_ns: its median lateness when last (0 when never last).
    """

    member: int
    last: int
    wait_caused_ns: int
    median_lateness_ns: int

    @property
    def share(self) -> float:
        """The fraction of this kind's matched collectives (that it was in) that it arrived last at."""
        return self.last / self.member if self.member else 0.0


@dataclass(frozen=True)
class RankStats:
    """One rank's record as a straggler.

    Attributes:
        rank: the world rank.
        host: its host.
        check: whether the consistency check was on.
        dropped: collectives its ring lost.
        collectives: matched collectives it was a member of.
        times_last: how many it arrived last at.
        wait_caused_ns: the others' total wait for it.
        wait_suffered_ns: its total wait for the last rank at collectives it was not last at.
        median_lateness_ns: its median lateness when last (0 when never last).
        by_kind: the same, per kind.
    """

    rank: int
    host: str
    check: bool
    dropped: int
    collectives: int
    times_last: int
    wait_caused_ns: int
    wait_suffered_ns: int
    median_lateness_ns: int
    by_kind: Mapping[str, KindStats]

    @property
    def share(self) -> float:
        """The fraction of its matched collectives that it arrived last at."""
        return self.times_last / self.collectives if self.collectives else 0.0


def _median(values: Sequence[int]) -> int:
    return round(statistics.median(values)) if values else 0


class _Tally:
    """One rank's running counts while the collectives are walked."""

    def __init__(self) -> None:
        self.member: Counter[str] = Counter()
        self.caused: Counter[str] = Counter()
        self.lateness: dict[str, list[int]] = defaultdict(list)
        self.suffered = 0

    def add(self, rank: int, collective: MatchedCollective) -> None:
        self.member[collective.kind] += 1
        if collective.last == rank:
            self.caused[collective.kind] += collective.wait_ns
            self.lateness[collective.kind].append(collective.lateness_ns)
        else:
            self.suffered += collective.arrival_ns[collective.last] - collective.arrival_ns[rank]

    def freeze(self, dump: Mapping[str, Any]) -> RankStats:
        by_kind = {
            kind: KindStats(count, len(self.lateness[kind]), self.caused[kind], _median(self.lateness[kind]))
            for kind, count in sorted(self.member.items())
        }
        return RankStats(
            rank=dump["rank"],
            host=str(dump.get("host", "")),
            check=bool(dump.get("check", True)),
            dropped=int(dump.get("dropped", 0)),
            collectives=sum(self.member.values()),
            times_last=sum(stats.last for stats in by_kind.values()),
            wait_caused_ns=sum(self.caused.values()),
            wait_suffered_ns=self.suffered,
            median_lateness_ns=_median([late for lates in self.lateness.values() for late in lates]),
            by_kind=by_kind,
        )


def summarize(dumps: Sequence[Mapping[str, Any]]) -> TraceSummary:
    """Name the stragglers: per rank, how often it arrived last, and the wait it caused and suffered.

    Args:
        dumps: the ranks' dumps (the recorder's format), any order.

    Returns:
        The summary.

    Raises:
        TypeError, ValueError: as `match_collectives`.
    """
    ordered = check_dumps(dumps)
    matching = match_collectives(ordered)
    tallies = {dump["rank"]: _Tally() for dump in ordered}
    for collective in matching.collectives:
        for rank in collective.members:
            tallies[rank].add(rank, collective)
    return TraceSummary(
        size=int(ordered[0]["size"]),
        ranks=tuple(tallies[dump["rank"]].freeze(dump) for dump in ordered),
        matched_by_kind=dict(sorted(Counter(c.kind for c in matching.collectives).items())),
        unmatched_by_kind=dict(sorted(matching.unmatched_by_kind.items())),
        single_rank=matching.single_rank,
        collectives=matching.collectives,
    )


@dataclass(frozen=True)
class TraceSummary:
    """The straggler report of one run.

    Attributes:
        size: the job's size.
        ranks: one `RankStats` per rank that has a dump, in rank order.
        matched_by_kind: matched collectives per kind.
        unmatched_by_kind: unmatched collectives per kind (missing on some member).
        single_rank: collectives of 1-rank groups, skipped.
        collectives: the matched collectives, in the order the last member arrived.
    """

    size: int
    ranks: tuple[RankStats, ...]
    matched_by_kind: Mapping[str, int]
    unmatched_by_kind: Mapping[str, int]
    single_rank: int
    collectives: tuple[MatchedCollective, ...] = field(repr=False)

    @property
    def matched(self) -> int:
        """How many collectives were matched on every member."""
        return sum(self.matched_by_kind.values())

    @property
    def unmatched(self) -> int:
        """How many were missing on some member."""
        return sum(self.unmatched_by_kind.values())

    @property
    def check_off_ranks(self) -> tuple[int, ...]:
        """The ranks that ran with the consistency check off."""
        return tuple(stats.rank for stats in self.ranks if not stats.check)

    def rank(self, rank: int) -> RankStats:
        """One rank's numbers.

        Args:
            rank: a world rank.

        Returns:
            Its `RankStats`.

        Raises:
            ValueError: the trace has no dump of that rank.
        """
        for stats in self.ranks:
            if stats.rank == rank:
                return stats
        raise ValueError(f"the trace has no rank {rank}: it has ranks {[stats.rank for stats in self.ranks]}")

    def worst(self) -> int | None:
        """The rank that caused the most wait (ties: the most often last, then the lowest), or None if none matched."""
        if not self.collectives:
            return None
        return min(self.ranks, key=lambda stats: (-stats.wait_caused_ns, -stats.times_last, stats.rank)).rank

    def lateness_series(self, rank: int) -> list[tuple[int, int]]:
        """The collectives `rank` arrived last at, as (arrival on the common clock in ns, lateness in ns), in order.

        Args:
            rank: a world rank.

        Returns:
            The points, oldest first; empty when it was never last.
        """
        return [(c.arrival_ns[rank], c.lateness_ns) for c in self.collectives if c.last == rank]

    def as_dict(self) -> dict[str, Any]:
        """The summary as plain JSON-serialisable data (without the per-collective list).

        Returns:
            A dict of numbers, strings, lists and dicts with string keys.
        """
        ranks = []
        for stats in self.ranks:
            entry = {name: getattr(stats, name) for name in RankStats.__dataclass_fields__ if name != "by_kind"}
            entry["by_kind"] = {kind: {**vars(kind_stats)} for kind, kind_stats in stats.by_kind.items()}
            ranks.append(entry)
        return {
            "size": self.size,
            "matched": self.matched,
            "unmatched": self.unmatched,
            "single_rank": self.single_rank,
            "matched_by_kind": dict(self.matched_by_kind),
            "unmatched_by_kind": dict(self.unmatched_by_kind),
            "check_off_ranks": list(self.check_off_ranks),
            "worst": self.worst(),
            "ranks": ranks,
        }

    def text(self) -> str:
        """The report as text: a table of the ranks, then what the worst rank did, then caveats.

        Returns:
            Lines joined by newlines, without a trailing one.
        """
        return "\n".join([*_counts_lines(self), *_table_lines(self), *_worst_lines(self), *_caveat_lines(self)])

    def __str__(self) -> str:
        """The readable report (`text`), so that ``print(ctx.trace_summary())`` prints it; ``repr`` keeps the fields."""
        return self.text()


_HEADER = ("rank", "times last", "% of collectives", "wait caused", "wait suffered", "median lateness")


def _counts_lines(summary: TraceSummary) -> list[str]:
    kinds = ", ".join(f"{count} {kind}" for kind, count in summary.matched_by_kind.items()) or "none"
    line = f"{summary.matched} collectives matched across {len(summary.ranks)} of {summary.size} ranks ({kinds})"
    if summary.unmatched:
        line += f"; {summary.unmatched} unmatched (not recorded on every member of their group)"
    if summary.single_rank:
        line += f"; {summary.single_rank} on 1-rank groups skipped"
    return [line]


def _table_lines(summary: TraceSummary) -> list[str]:
    rows = [_HEADER] + [
        (
            str(stats.rank),
            str(stats.times_last),
            f"{100 * stats.share:.0f}%",
            duration_text(stats.wait_caused_ns),
            duration_text(stats.wait_suffered_ns),
            duration_text(stats.median_lateness_ns) if stats.times_last else "-",
        )
        for stats in summary.ranks
    ]
    widths = [max(len(row[column]) for row in rows) for column in range(len(_HEADER))]
    return ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]


def _worst_lines(summary: TraceSummary) -> list[str]:
    worst = summary.worst()
    if worst is None:
        return ["no collective was recorded on every member of its group: nothing to attribute"]
    return [
        f"rank {worst} arrived last at {100 * stats.share:.0f}% of {kind}s; the others waited "
        f"{duration_text(stats.wait_caused_ns)} for it in total; its median lateness "
        f"{duration_text(stats.median_lateness_ns)}"
        for kind, stats in summary.rank(worst).by_kind.items()
        if stats.last
    ]


def _caveat_lines(summary: TraceSummary) -> list[str]:
    lines = [
        f"rank {stats.rank}'s ring lost its {stats.dropped} oldest collectives; the others' records of them are "
        "counted unmatched"
        for stats in summary.ranks
        if stats.dropped
    ]
    if summary.check_off_ranks:
        ranks = ", ".join(map(str, summary.check_off_ranks))
        lines.append(
            f"note: the consistency check was off on rank(s) {ranks}, so arrivals are the calls' entry times; with "
            "the check off a call does not wait for its peers at entry, so the wait shows at completion instead"
        )
    return lines
