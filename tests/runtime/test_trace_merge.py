"""The merge of a large run's trace: each group's members once, and bounded per event.

A traced context's close gathers every rank's dump at rank 0. Each dump lists a group only
where its rank is the group's first member, so the whole context's members come once and
not once per rank; the file's events name a large group by its size and ends.
"""

from __future__ import annotations

import json

from mpitensor._runtime.tracing.chrome import chrome_trace, group_label
from mpitensor._runtime.tracing.files import read_dumps, write_trace
from mpitensor._runtime.tracing.stragglers import group_table, summarize
from mpitensor._runtime.tracing.tracer import Tracer
from tests.runtime.test_trace_report import MS, T0, make_dump

RANKS = 256
WORLD, EVENS = 1001, 1002


def _merged_dumps(size: int) -> list[dict]:
    """Every rank's dump as the close's merge gathers it: a group listed by its first member only."""
    world, evens = list(range(size)), list(range(0, size, 2))
    dumps = []
    for rank in range(size):
        events = [{"seq": 0, "group": WORLD, "called": T0 + rank * MS, "complete": T0 + size * MS}]
        groups = {WORLD: world} if rank == 0 else {}
        if rank % 2 == 0:
            events.append({"seq": 0, "group": EVENS, "called": T0 + size * MS, "complete": T0 + (size + 1) * MS})
        dumps.append(make_dump(rank, size, events, offset_ns=0, groups=groups or {EVENS: evens}))
        if rank != 0:
            dumps[-1]["groups"] = {}
    dumps[0]["groups"][str(EVENS)] = evens
    return dumps


def test_the_merge_lists_each_group_once_and_names_big_groups_briefly(tmp_path):
    dumps = _merged_dumps(RANKS)
    listed = sum(len(members) for dump in dumps for members in dump["groups"].values())
    assert listed == RANKS + RANKS // 2  # not RANKS ** 2
    assert group_table(dumps)[WORLD] == tuple(range(RANKS))
    summary = summarize(dumps)
    assert len(summary.collectives) == 2 and summary.collectives[0].last == RANKS - 1
    trace = chrome_trace(dumps, summary)
    labels = {json.dumps(event["args"]["group"]) for event in trace["traceEvents"] if event.get("cat") == "collective"}
    assert labels == {json.dumps(f"{RANKS} ranks, 0..{RANKS - 1}"), json.dumps(f"{RANKS // 2} ranks, 0..{RANKS - 2}")}
    path = tmp_path / "trace.json"
    write_trace(path, dumps)
    text = path.read_text()
    assert text.count(json.dumps(list(range(RANKS)))) == 1  # the whole context's members, once in the file
    again = read_dumps(path)
    # Read back, each dump lists the groups its events are on (the table's lists, shared).
    assert again[5]["groups"][str(WORLD)] == list(range(RANKS))
    assert again[5]["groups"][str(WORLD)] is again[7]["groups"][str(WORLD)]
    assert str(EVENS) in again[6]["groups"] and str(EVENS) not in again[5]["groups"]
    assert group_label([0, 1, 2]) == [0, 1, 2]


def test_a_tracer_lists_only_the_groups_it_leads_for_a_merge():
    class _Group:
        def __init__(self, members):
            self.members = tuple(members)

    tracer = Tracer(8, tuple(range(4)))
    world, tail = _Group(range(4)), _Group(range(1, 4))
    keys = tracer.group_key(world), tracer.group_key(tail)
    whole = tracer.dump(1, 4, "node", 0, True)
    assert set(whole["groups"]) == {str(key) for key in keys}
    merged = tracer.dump(1, 4, "node", 0, True, every_group=False)
    assert set(merged["groups"]) == {str(keys[1])}  # rank 1 leads [1, 2, 3], not the world
