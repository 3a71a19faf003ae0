"""The shared pair's segment and its exchanges, in one process (`_core/native/pair.c`).

Two registrations of one segment, as rank 0 and rank 1 of two pretend communicators, take
turns as two ranks would: each call's input goes in, the other side reads it, and the slots
of the call before stay intact while the next call's input is written. A peer whose process
is gone ends a wait instead of keeping it forever. The multi-rank use is in
tests/collectives/test_held_contested.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

_pair = pytest.importorskip("mpitensor._core._pair", reason="the compiled pair module was not built")

CAPACITY = 1 << 16
SIZE = _pair.HEADER_BYTES + 4 * CAPACITY
FIRST, SECOND, LONELY, REFUSED = 9_001, 9_002, 9_003, 9_004  # pretend communicator handles


@pytest.fixture
def pair():
    """The same segment registered as rank 0 (FIRST) and rank 1 (SECOND) of this process."""
    fd, address = _pair.create(SIZE, 1234)
    try:
        assert _pair.attach(os.getpid(), fd, SIZE, 4321) == 0, "another token: not the segment meant"
        assert _pair.attach(os.getpid(), fd, SIZE + 4096, 1234) == 0, "another size: not the segment meant"
        mapped = _pair.attach(os.getpid(), fd, SIZE, 1234)
        assert mapped != 0
    finally:
        os.close(fd)
    assert _pair.register(FIRST, address, SIZE, CAPACITY, 0, os.getpid(), True)
    assert _pair.register(SECOND, mapped, SIZE, CAPACITY, 1, os.getpid(), True)
    yield
    _pair.forget(FIRST)
    _pair.forget(SECOND)


def _values(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, np.float64)


def test_each_side_reads_the_other_sides_input_of_each_call(pair):
    for call in range(5):
        mine, theirs = np.full(1000, call + 0.5), np.arange(1000.0) * (call + 1)
        assert _pair.post(FIRST, mine) and _pair.post(SECOND, theirs)
        assert np.array_equal(_values(_pair.await_peer(FIRST)), theirs)
        assert np.array_equal(_values(_pair.await_peer(SECOND)), mine)
        assert np.array_equal(_values(_pair.own(FIRST)), mine)
        assert np.array_equal(_values(_pair.own(SECOND)), theirs)
        _pair.done(FIRST)
        _pair.done(SECOND)


def test_the_next_call_is_written_while_the_peer_still_reads_the_last(pair):
    assert _pair.post(FIRST, np.full(10, 1.0)) and _pair.post(SECOND, np.full(10, 2.0))
    assert np.array_equal(_values(_pair.await_peer(FIRST)), np.full(10, 2.0))
    _pair.done(FIRST)
    # FIRST's next call goes into its other slot: SECOND, not done yet, still reads 1.0.
    assert _pair.post(FIRST, np.full(10, 3.0))
    assert np.array_equal(_values(_pair.await_peer(SECOND)), np.full(10, 1.0))
    _pair.done(SECOND)
    assert _pair.post(SECOND, np.full(10, 4.0))
    assert np.array_equal(_values(_pair.await_peer(SECOND)), np.full(10, 3.0))
    assert np.array_equal(_values(_pair.await_peer(FIRST)), np.full(10, 4.0))


def test_a_pair_carries_calls_up_to_its_slots_only(pair):
    assert _pair.state(FIRST, CAPACITY) == 1
    assert _pair.state(FIRST, CAPACITY + 1) == 0, "a larger call sets up a larger pair"
    assert _pair.state(FIRST, _pair.MAX_BYTES + 1) == -1, "beyond MAX_BYTES MPI moves it"
    assert _pair.state(LONELY, 8) == 0, "no pair set up yet"
    with pytest.raises(ValueError, match="larger than the pair's slots"):
        _pair.post(FIRST, np.zeros(CAPACITY // 8 + 1))


def test_a_pair_not_usable_on_both_sides_is_none_until_forgotten():
    fd, address = _pair.create(SIZE, 7)
    os.close(fd)
    assert _pair.register(REFUSED, address, SIZE, CAPACITY, 0, os.getpid(), False)
    assert _pair.state(REFUSED, 8) == -1, "MPI's exchange from now on"
    _pair.forget(REFUSED)
    assert _pair.state(REFUSED, 8) == 0
    with pytest.raises(RuntimeError, match="no shared pair"):
        _pair.own(REFUSED)


def test_a_wait_for_a_peer_whose_process_is_gone_ends():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    fd, address = _pair.create(SIZE, 8)
    os.close(fd)
    assert _pair.register(LONELY, address, SIZE, CAPACITY, 0, gone.pid, True)
    try:
        assert _pair.post(LONELY, np.zeros(4))
        start = time.monotonic()
        assert _pair.await_peer(LONELY) is None
        assert time.monotonic() - start < 5
    finally:
        _pair.forget(LONELY)
