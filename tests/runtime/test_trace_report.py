"""The trace report: matching the ranks' recorded collectives, naming stragglers, the Chrome file, the CLI."""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import pytest

from mpitensor.__main__ import main as cli_main
from mpitensor._runtime.tracing.chrome import chrome_trace
from mpitensor._runtime.tracing.files import part_paths, read_dumps, write_part, write_trace
from mpitensor._runtime.tracing.plot import plot_summary
from mpitensor._runtime.tracing.stragglers import duration_text, summarize

WORLD = 111
MS = 1_000_000
S = 1_000_000_000
# Common clock = local + offset. Rank 2's local clock is 5 s behind rank 0's: on local times alone it would look
# the earliest at every collective, so a report that ignored the offsets would blame the wrong rank.
OFFSETS = {0: 0, 1: 2 * S, 2: 5 * S}
T0 = 100 * S  # the run's start on the common clock; every local clock is positive from there on


def make_dump(rank, size, events, *, offset_ns=None, check=True, groups=None, regions=(), dropped=0, capacity=0):
    """A recorder dump of `rank` from event dicts whose times are on the common clock (converted to local here)."""
    offset = OFFSETS.get(rank, 0) if offset_ns is None else offset_ns
    columns = defaultdict(list)
    for number, event in enumerate(events):
        moments = {name: event.get(name, 0) for name in ("called", "agreed", "posted", "complete", "resolved")}
        row = {
            "id": event.get("id", number + 1),
            "kind": event.get("kind", "all_reduce"),
            "group": event.get("group", WORLD),
            "seq": event["seq"],
            "nbytes": event.get("nbytes", 4096),
            "dtype": "float32",
            "transport": event.get("transport", "mpi"),
            **{name: (time - offset if time else 0) for name, time in moments.items()},
        }
        for key, value in row.items():
            columns[key].append(value)
    region_columns = {"name": [], "start": [], "end": [], "depth": []}
    for name, start, end, depth in regions:
        for key, value in zip(region_columns, (name, start - offset, end - offset if end else 0, depth)):
            region_columns[key].append(value)
    return {
        "rank": rank,
        "size": size,
        "host": f"node{rank}",
        "offset_ns": offset,
        "check": check,
        "capacity": capacity,
        "dropped": dropped,
        "groups": {str(group): members for group, members in (groups or {WORLD: list(range(size))}).items()},
        "events": dict(columns)
        if events
        else {
            key: []
            for key in (
                "id",
                "kind",
                "group",
                "seq",
                "nbytes",
                "dtype",
                "transport",
                "called",
                "agreed",
                "posted",
                "complete",
                "resolved",
            )
        },
        "regions": region_columns,
    }


def arrival(seq: int, rank: int) -> int:
    """Rank 2 comes 5 ms after rank 1 (which is 1 ms after rank 0) at seqs 0-7; rank 1 is last by 1 ms at 8 and 9."""
    base = T0 + seq * 100 * MS
    if seq < 8:
        return base + {0: 0, 1: 1 * MS, 2: 6 * MS}[rank]
    return base + {0: 0, 1: 1 * MS, 2: 0}[rank]


def event(seq: int, rank: int, **extra) -> dict:
    called = arrival(seq, rank)
    last = max(arrival(seq, peer) for peer in range(3))
    return {
        "seq": seq,
        "called": called,
        "agreed": last + 10_000,
        "posted": last + 20_000,
        "complete": last + 2 * MS,
        **extra,
    }


def straggler_run(seqs=range(10), **dump_options):
    return [make_dump(rank, 3, [event(seq, rank) for seq in seqs], **dump_options) for rank in range(3)]


def test_late_rank_named_with_its_lateness_and_the_waits():
    summary = summarize(straggler_run())
    assert summary.matched == 10 and summary.unmatched == 0
    two, one, zero = summary.rank(2), summary.rank(1), summary.rank(0)
    assert (two.times_last, one.times_last, zero.times_last) == (8, 2, 0)
    assert two.median_lateness_ns == 5 * MS and one.median_lateness_ns == 1 * MS
    # Each of rank 2's eight: rank 0 waited 6 ms, rank 1 5 ms; each of rank 1's two: ranks 0 and 2 waited 1 ms.
    assert two.wait_caused_ns == 8 * 11 * MS and one.wait_caused_ns == 2 * 2 * MS
    assert (zero.wait_suffered_ns, one.wait_suffered_ns, two.wait_suffered_ns) == (50 * MS, 40 * MS, 2 * MS)
    assert two.by_kind["all_reduce"].share == pytest.approx(0.8)
    assert summary.worst() == 2
    assert summary.lateness_series(2) == [(arrival(seq, 2), 5 * MS) for seq in range(8)]


def test_text_has_the_table_and_the_sentence():
    text = summarize(straggler_run()).text()
    assert (
        "rank 2 arrived last at 80% of all_reduces; the others waited 88 ms for it in total; "
        "its median lateness 5.0 ms" in text
    )
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.split()[0].isdigit()}
    assert rows["2"][:5] == ["2", "8", "80%", "88", "ms"]
    assert rows["0"][:3] == ["0", "0", "0%"]
    assert "check was off" not in text


def test_kinds_are_counted_and_pluralised():
    dumps = [
        make_dump(rank, 3, [event(seq, rank, kind="broadcast" if seq % 2 else "gradient sync") for seq in range(10)])
        for rank in range(3)
    ]
    summary = summarize(dumps)
    assert summary.matched_by_kind == {"broadcast": 5, "gradient sync": 5}
    assert summary.rank(2).by_kind["broadcast"].last == 4  # seqs 1, 3, 5, 7
    assert "rank 2 arrived last at 80% of gradient syncs; the others waited 44 ms" in summary.text()


def test_ties_go_to_the_lowest_rank():
    all_tied = [{"seq": 0, "called": T0, "complete": T0 + MS}] * 3
    two_tied = [{"seq": 1, "called": t, "complete": T0 + 10 * MS} for t in (T0, T0 + 3 * MS, T0 + 3 * MS)]
    dumps = [make_dump(rank, 3, [all_tied[rank], two_tied[rank]]) for rank in range(3)]
    summary = summarize(dumps)
    first, second = sorted(summary.collectives, key=lambda c: c.seq)
    assert (first.last, first.lateness_ns, first.wait_ns) == (0, 0, 0)
    assert (second.last, second.lateness_ns, second.wait_ns) == (1, 0, 3 * MS)
    assert summary.worst() == 1


def test_events_lost_to_the_ring_are_unmatched_not_misattributed():
    dumps = straggler_run()
    dumps[0] = make_dump(0, 3, [event(seq, 0) for seq in range(3, 10)], capacity=7, dropped=3)
    summary = summarize(dumps)
    assert (summary.matched, summary.unmatched) == (7, 3)
    assert summary.rank(2).times_last == 5  # seqs 3-7; 0-2 are on ranks 1 and 2 only
    assert summary.rank(1).wait_suffered_ns == 5 * 5 * MS
    assert "rank 0's ring lost its 3 oldest collectives" in summary.text()


def test_subgroup_collectives_match_on_their_members_only():
    pair = {WORLD: [0, 1, 2], 222: [0, 2]}
    sub = {
        0: {"seq": 0, "group": 222, "called": T0, "complete": T0 + 9 * MS},
        2: {"seq": 0, "group": 222, "called": T0 + 7 * MS, "complete": T0 + 9 * MS},
    }
    dumps = straggler_run(range(1))
    dumps[0] = make_dump(0, 3, [event(0, 0), sub[0]], groups=pair)
    dumps[2] = make_dump(2, 3, [event(0, 2), sub[2]], groups=pair)
    summary = summarize(dumps)
    assert (summary.matched, summary.unmatched) == (2, 0)
    assert summary.rank(1).collectives == 1
    assert summary.rank(2).wait_caused_ns == 11 * MS + 7 * MS
    assert summary.rank(0).wait_suffered_ns == 6 * MS + 7 * MS


def test_one_rank_groups_are_skipped():
    solo = {"seq": 0, "group": 333, "kind": "barrier", "called": T0 + 9 * S, "complete": T0 + 9 * S + MS}
    dumps = straggler_run(range(2))
    dumps[1] = make_dump(1, 3, [event(0, 1), event(1, 1), solo], groups={WORLD: [0, 1, 2], 333: [1]})
    summary = summarize(dumps)
    assert (summary.matched, summary.unmatched, summary.single_rank) == (2, 0, 1)
    assert "barrier" not in summary.matched_by_kind and summary.rank(1).collectives == 2


def test_check_off_caveat():
    dumps = straggler_run(range(2))
    dumps[1]["check"] = False
    text = summarize(dumps).text()
    assert "check was off on rank(s) 1" in text
    assert "a call does not wait for its peers at entry, so the wait shows at completion instead" in text


def test_nothing_matched():
    summary = summarize([make_dump(0, 2, [event(0, 0)], groups={WORLD: [0, 1]})])
    assert summary.worst() is None and summary.unmatched == 1
    assert "nothing to attribute" in summary.text()


def test_bad_dumps_are_refused_with_the_reason():
    dumps = straggler_run(range(1))
    with pytest.raises(ValueError, match="two dumps have the same rank"):
        summarize([dumps[0], dumps[0]])
    dumps[1]["groups"] = {str(WORLD): [0, 1]}
    with pytest.raises(ValueError, match=r"group 111 has members \[0, 1, 2\] on rank 0 but \[0, 1\] on rank 1"):
        summarize(dumps)
    with pytest.raises(ValueError, match="no dumps given"):
        summarize([])


def test_duration_text():
    assert [duration_text(ns) for ns in (830, 4_100_000_000, 12 * MS, 1_500, 0)] == [
        "830 ns",
        "4.1 s",
        "12 ms",
        "1.5 us",
        "0 ns",
    ]


def test_summary_as_dict_round_trips_json():
    data = json.loads(json.dumps(summarize(straggler_run()).as_dict()))
    assert data["worst"] == 2 and data["matched"] == 10
    assert data["ranks"][2]["by_kind"]["all_reduce"] == {
        "member": 10,
        "last": 8,
        "wait_caused_ns": 88 * MS,
        "median_lateness_ns": 5 * MS,
    }


def chrome_run():
    dumps = straggler_run(range(3))
    # Rank 1 faulted in seq 2: still in flight, and its region never closed.
    dumps[1] = make_dump(
        1,
        3,
        [event(0, 1), event(1, 1), {**event(2, 1), "complete": 0, "agreed": 0, "posted": 0}],
        regions=[("step", T0 - MS, T0 + 50 * MS, 0), ("forward", T0, T0 + 40 * MS, 1), ("step", T0 + 300 * MS, 0, 0)],
    )
    return dumps


def test_chrome_trace_shape_and_order():
    trace = json.loads(json.dumps(chrome_trace(chrome_run())))
    events = trace["traceEvents"]
    assert trace["displayTimeUnit"] == "ms"
    assert all({"ph", "ts", "pid", "tid"} <= event.keys() for event in events)
    by_thread = defaultdict(list)
    for event in events:
        by_thread[event["pid"], event["tid"]].append(event["ts"])
    assert sorted(by_thread) == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(times == sorted(times) for times in by_thread.values())
    slices = [event for event in events if event["ph"] == "X"]
    assert len(slices) == 9 + 3 and all(event["dur"] >= 0 for event in slices)
    names = {event["pid"]: event["args"]["name"] for event in events if event["name"] == "process_name"}
    assert names == {0: "rank 0 (node0)", 1: "rank 1 (node1)", 2: "rank 2 (node2)"}
    # Relative to the earliest moment of all ranks: rank 1's first region, 1 ms before rank 0's first call.
    first_call = next(e for e in slices if e["pid"] == 0 and e["args"].get("seq") == 0)
    assert first_call["ts"] == pytest.approx(1000.0)
    assert trace["otherData"]["mpitensor_summary"]["worst"] == 2


def test_chrome_collective_args_and_incomplete_and_open():
    events = chrome_trace(chrome_run())["traceEvents"]
    calls = {(e["pid"], e["args"]["seq"]): e for e in events if e["ph"] == "X" and e["cat"] == "collective"}
    done = calls[0, 1]
    assert done["name"] == "all_reduce" and done["args"]["group"] == [0, 1, 2] and done["args"]["bytes"] == 4096
    assert done["args"]["agreed_us"] == pytest.approx(6000 + 10) and done["dur"] == pytest.approx(8000)
    assert "incomplete" not in done["args"]
    stuck = calls[1, 2]
    assert stuck["args"]["incomplete"] is True and "complete_us" not in stuck["args"]
    # It runs to rank 1's last recorded moment: the open region's start, 99 ms after its call.
    assert stuck["dur"] == pytest.approx(99_000)
    regions = [e for e in events if e["ph"] == "X" and e["cat"] == "region"]
    assert [(r["name"], r["args"]["depth"], r["args"].get("open", False)) for r in regions] == [
        ("step", 0, False),
        ("forward", 1, False),
        ("step", 0, True),
    ]
    assert regions[0]["dur"] == pytest.approx(51_000)


def test_chrome_flows_pair_up_from_the_last_rank():
    events = chrome_trace(chrome_run())["traceEvents"]
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert set(starts) == set(finishes) and len(starts) == 3 * 2
    assert all(e["pid"] == 2 and e["name"] == "waited for rank 2" and e["cat"] == "straggler" for e in starts.values())
    assert sorted(e["pid"] for e in finishes.values()) == [0, 0, 0, 1, 1, 1]
    assert all(e["bp"] == "e" for e in finishes.values())
    # Rank 1's faulted call has no agreement and no completion: its wait ends at its call.
    rank1 = sorted(e["ts"] for e in finishes.values() if e["pid"] == 1)
    assert rank1[2] == pytest.approx((arrival(2, 1) - (T0 - MS)) / 1000)
    assert rank1[0] == pytest.approx((arrival(0, 2) + 10_000 - (T0 - MS)) / 1000)


def test_merged_file_round_trips(tmp_path):
    dumps = straggler_run(range(3))
    path = str(tmp_path / "trace.json")
    assert write_trace(path, dumps) == path
    assert read_dumps(path) == dumps
    with open(path) as file:
        content = json.load(file)
    assert content["mpitensor"]["format"] == 1 and len(content["traceEvents"]) > 0
    assert not os.path.exists(path + ".tmp")


def test_parts_round_trip_when_the_merged_file_is_absent(tmp_path):
    dumps = straggler_run(range(3))
    path = str(tmp_path / "trace.json")
    for dump in reversed(dumps):
        write_part(path, dump)
    assert part_paths(path) == [f"{path}.rank{rank}.json" for rank in range(3)]
    assert read_dumps(path) == dumps
    with open(f"{path}.rank1.json") as file:
        part = json.load(file)
    assert {e["pid"] for e in part["traceEvents"]} == {1}
    assert part["mpitensor"]["dumps"] == [dumps[1]]


def test_file_errors(tmp_path):
    path = str(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match=r"no trace at .*missing\.json, and no parts of one .*\.rank\*\.json"):
        read_dumps(path)
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="not an mpitensor trace \\(no 'mpitensor' key\\)"):
        read_dumps(foreign)
    future = tmp_path / "future.json"
    future.write_text(json.dumps({"mpitensor": {"format": 99, "dumps": []}}))
    with pytest.raises(ValueError, match="format 99, but this version reads format 1"):
        read_dumps(future)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json")
    with pytest.raises(ValueError, match="it is not JSON"):
        read_dumps(garbage)


def test_cli_prints_the_sentence_and_draws_the_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = str(tmp_path / "run.json")
    write_trace(path, straggler_run())
    assert cli_main(["trace", path]) == 0
    out = capsys.readouterr().out
    assert "rank 2 arrived last at 80% of all_reduces; the others waited 88 ms for it in total" in out
    assert f"trace: {path} (open it in https://ui.perfetto.dev" in out
    png = tmp_path / "run.png"
    assert f"plot: {png}" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_merges_parts_and_skips_the_plot(tmp_path, capsys):
    path = str(tmp_path / "run.json")
    for dump in straggler_run():
        write_part(path, dump)
    assert cli_main(["trace", path, "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert f"merged 3 part(s) {path}.rank*.json into {path}" in out and "rank 2 arrived last at 80%" in out
    assert read_dumps(path) == straggler_run() and not (tmp_path / "run.png").exists()


def test_cli_missing_file_exits_2(tmp_path, capsys):
    assert cli_main(["trace", str(tmp_path / "nope.json"), "--no-plot"]) == 2
    assert "no trace at" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert cli_main(["trace", str(bad), "--no-plot"]) == 2
    assert "is not an mpitensor trace" in capsys.readouterr().err


def test_without_matplotlib_the_cli_says_how_to_get_the_plot(tmp_path, capsys, monkeypatch):
    # None in sys.modules makes the import fail, as where matplotlib is not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    path = str(tmp_path / "run.json")
    write_trace(path, straggler_run())
    with pytest.raises(ImportError, match=r"pip install matplotlib \(or pip install 'mpitensor\[plot\]'\)"):
        plot_summary(summarize(straggler_run()), straggler_run(), str(tmp_path / "x.png"))
    assert cli_main(["trace", path]) == 0
    assert "no plot: plotting the trace needs matplotlib: pip install matplotlib" in capsys.readouterr().out
    assert not (tmp_path / "run.png").exists()
