"""Trace files under faults: damaged files read by the CLI, write errors, and the summary's text."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import types
import warnings

import numpy as np
import pytest

import mpitensor as mt
from mpitensor.__main__ import main as cli_main
from mpitensor._core.mpi import MPI
from mpitensor._runtime.tracing import files, flight
from mpitensor._runtime.tracing.files import read_dumps, write_part, write_trace
from mpitensor._runtime.tracing.stragglers import summarize
from tests.runtime.test_trace_report import straggler_run


def _merged(tmp_path, change) -> str:
    """A merged trace of the straggler run, `change(content)` applied to its JSON; its path."""
    path = tmp_path / "run.json"
    write_trace(path, straggler_run())
    content = json.loads(path.read_text())
    change(content)
    path.write_text(json.dumps(content))
    return str(path)


def _dump(content: dict, rank: int = 0) -> dict:
    return content["mpitensor"]["dumps"][rank]


def _set(target: dict, key: str, value: object) -> None:
    target[key] = value


# (id, how the file is damaged, what the one line says)
DAMAGED = [
    ("groups-a-list", lambda c: _set(_dump(c), "groups", [[0, 1, 2]]),
     "rank 0's groups is a list, not a dict of group -> ranks: the dump is corrupt"),
    ("group-key", lambda c: _set(_dump(c), "groups", {"abc": [0, 1, 2]}),
     "rank 0's groups has the key 'abc', not a group number"),
    ("group-ranks", lambda c: _set(_dump(c)["groups"], "111", ["a"]),
     "rank 0's group 111 is ['a'], not a list of ranks"),
    ("rank-a-string", lambda c: _set(_dump(c), "rank", "0"), "a dump's ['rank'] are not integers"),
    ("size-zero", lambda c: _set(_dump(c), "size", 0), "a dump has rank 0 of size 0"),
    ("events-a-list", lambda c: _set(_dump(c), "events", []), "rank 0's events is a list, not a dict of columns"),
    ("column-a-number", lambda c: _set(_dump(c)["events"], "called", 5),
     "rank 0's events column(s) ['called'] are not lists"),
    ("column-lengths", lambda c: _dump(c)["events"]["seq"].pop(), "rank 0's events columns differ in length"),
    ("time-a-string", lambda c: _set(_dump(c)["events"]["called"], 3, "soon"),
     "rank 0's events column 'called' holds 'soon' at row 3, where it holds integers"),
    ("time-null", lambda c: _set(_dump(c)["events"]["complete"], 0, None),
     "rank 0's events column 'complete' holds None at row 0, where it holds integers"),
    ("time-a-float", lambda c: _set(_dump(c, 2)["events"]["seq"], 1, 1.5),
     "rank 2's events column 'seq' holds 1.5 at row 1, where it holds integers"),
    ("kind-a-number", lambda c: _set(_dump(c)["events"]["kind"], 0, 7),
     "rank 0's events column 'kind' holds 7 at row 0, where it holds strings"),
    ("regions-a-list", lambda c: _set(_dump(c), "regions", []), "rank 0's regions is a list, not a dict of columns"),
    ("host-a-number", lambda c: _set(_dump(c), "host", 3), "rank 0's host is 3, not a str"),
    ("dumps-a-dict", lambda c: _set(c["mpitensor"], "dumps", {}), "has no list of dumps with a 'rank' each"),
    ("section-a-list", lambda c: _set(c, "mpitensor", []), "is not an mpitensor trace (no 'mpitensor' key)"),
    ("same-rank-twice", lambda c: _set(_dump(c, 1), "rank", 0), "two dumps have the same rank"),
]


def _one_line_exit_2(capsys, path: str, fragment: str) -> None:
    assert cli_main(["trace", path, "--no-plot"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("python -m mpitensor trace: ") and path in lines[0], lines[0]
    assert fragment in lines[0], lines[0]
    assert "Traceback" not in captured.err and not captured.out


@pytest.mark.parametrize(("change", "fragment"), [case[1:] for case in DAMAGED], ids=[case[0] for case in DAMAGED])
def test_a_damaged_trace_is_exit_2_and_one_line_saying_what_is_wrong(tmp_path, capsys, change, fragment):
    _one_line_exit_2(capsys, _merged(tmp_path, change), fragment)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "its JSON nests deeper than a trace does"),
        (b'{"mpitensor": ' * 50_000 + b"1" + b"}" * 50_000, "its JSON nests deeper than a trace does"),
        (b"\xff\xfe\x00garbage", "is not an mpitensor trace: it is not UTF-8 text"),
        (b"", "is not an mpitensor trace: it is not JSON"),
        (b"[]", "is not an mpitensor trace (no 'mpitensor' key)"),
    ],
    ids=["nested-lists", "nested-objects", "binary", "empty", "a-list"],
)
def test_a_file_that_is_not_a_trace_is_exit_2_and_one_line(tmp_path, capsys, content, fragment):
    path = tmp_path / "run.json"
    path.write_bytes(content)
    _one_line_exit_2(capsys, str(path), fragment)


def test_a_directory_or_a_damaged_part_is_exit_2_and_one_line(tmp_path, capsys):
    _one_line_exit_2(capsys, str(tmp_path), "Is a directory")
    path = tmp_path / "run.json"
    for dump in straggler_run():
        write_part(path, dump)
    part = tmp_path / "run.json.rank1.json"
    content = json.loads(part.read_text())
    content["mpitensor"]["dumps"][0]["groups"] = [[0, 1, 2]]
    part.write_text(json.dumps(content))
    _one_line_exit_2(capsys, str(path), f"{part} is a damaged mpitensor trace: rank 1's groups is a list")
    assert not path.exists()  # nothing merged from damaged parts


def test_the_command_line_itself_exits_2_with_one_line(tmp_path):
    path = tmp_path / "run.json"
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    done = subprocess.run([sys.executable, "-m", "mpitensor", "trace", str(path), "--no-plot"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"python -m mpitensor trace: {path} is not an mpitensor trace: its JSON nests deeper than a trace does "
        "(and than Python's parser can read)"
    ]


def test_a_write_error_leaves_no_tmp_file_and_says_where_and_what_to_do(tmp_path):
    # A file-size limit makes the write fail for real (EFBIG) part way, as a full disk does (ENOSPC).
    path = tmp_path / "run.json"
    write_trace(path, straggler_run(range(2)))
    earlier = path.read_bytes()
    previous_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, previous_limit[1]))
    try:
        with pytest.raises(OSError) as info:
            write_trace(path, straggler_run())
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
        signal.signal(signal.SIGXFSZ, previous_handler)
    assert info.value.errno == errno.EFBIG
    assert str(info.value) == (
        f"[Errno {errno.EFBIG}] the trace could not be written to {path} ({os.strerror(errno.EFBIG)}); free space "
        "there or trace to another path (DistributedConfig(trace=...) or MPITENSOR_TRACE)"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.json"]  # no run.json.tmp
    assert path.read_bytes() == earlier  # the earlier file is intact


def test_a_full_disk_leaves_no_tmp_file_for_a_part_either(tmp_path, monkeypatch):
    def full(content, file):
        file.write("{")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(files.json, "dump", full)
    path = tmp_path / "run.json"
    with pytest.raises(OSError, match=r"could not be written to .*run\.json\.rank0\.json \(No space left on device\)"):
        write_part(path, straggler_run()[0])
    monkeypatch.undo()
    assert list(tmp_path.iterdir()) == []
    assert read_dumps(write_part(path, straggler_run()[0]))[0]["rank"] == 0  # and it works once there is room


def test_printing_a_summary_prints_its_report(capsys):
    summary = summarize(straggler_run())
    assert str(summary) == summary.text()
    print(summary)
    out = capsys.readouterr().out
    assert out == summary.text() + "\n"
    assert "rank 2 arrived last at 80% of all_reduces" in out
    assert repr(summary).startswith("TraceSummary(size=3, ranks=(RankStats(rank=0")


@pytest.mark.mpi(min_size=2)
def test_a_flight_recorder_without_its_thread_warns_and_the_context_works(tmp_path, monkeypatch):
    class NoThread(threading.Thread):
        def start(self):
            raise RuntimeError("can't start new thread")

    rank = MPI.COMM_WORLD.Get_rank()
    path = MPI.COMM_WORLD.bcast(str(tmp_path / "trace.json"), root=0)
    if rank == 1:
        monkeypatch.setattr(flight, "threading", types.SimpleNamespace(Thread=NoThread, Lock=threading.Lock))
    expected = pytest.warns(RuntimeWarning, match="flight recorder cannot start its listener") if rank == 1 \
        else _no_flight_warning()
    with expected:
        ctx = mt.DistributedContext.init(config=mt.DistributedConfig(trace=path))
    with ctx:
        inputs = [np.arange(3.0) + r for r in range(ctx.size)]
        total = mt.all_reduce(inputs[ctx.rank]).resolve().numpy()
        np.testing.assert_array_equal(total, np.sum(inputs, axis=0))
    MPI.COMM_WORLD.Barrier()
    assert [dump["rank"] for dump in read_dumps(path)] == list(range(ctx.size))


@contextlib.contextmanager
def _no_flight_warning():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if "flight recorder" in str(w.message)]
