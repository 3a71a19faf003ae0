"""What the ranks of a fault-tolerance test job do: lose a rank in a collective, shrink, check against NumPy.

Imported by the child jobs of ``tests/faults`` (never by pytest itself). Every rank derives
every rank's input from the seed and the world rank, so that after a shrink each survivor
computes NumPy's result over the survivors' inputs. Each rank reports (``report``, defined
by the job's preamble) what it saw: ``died`` with the time just before a rank ends itself,
``detected`` with the time a survivor got `RankFailedError` and the ranks it named,
``recovered`` with the times of the shrink and of the first collective on the new context,
``verified`` once a check against NumPy passed, ``bad`` with what differed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

import mpitensor as mt


def report(*parts: object) -> None:
    """Record a line of this rank's report: the job sets it (``phases.report = report``)."""
    raise RuntimeError("the job sets phases.report to its own report()")


# Every survivor must get RankFailedError within this many seconds of the death.
DETECTION_BOUND = 10.0
SMALL, LARGE = 8, 1 << 17  # float64 elements: 64 B, and 1 MiB (the shared-memory all-reduce's sizes)
OP = mt.ReduceOperation


def data(seed: int, world_rank: int, count: int) -> np.ndarray:
    """World rank `world_rank`'s input for `seed`: small integers as float64, so sums are exact."""
    return np.random.default_rng([seed, world_rank]).integers(-3, 4, count).astype(np.float64)


@dataclass
class Call:
    """One collective as a test phase sees it.

    Attributes:
        start: posts the call on `ctx` over `members` (context ranks, sorted; None for the
            whole context), this rank's input `x`; returns a handle, or the result for a
            blocking call.
        expect: NumPy's result on this rank from every member's input (world rank -> input),
            this rank's place in the group and the members' world ranks.
    """

    start: Callable[[mt.DistributedContext, np.ndarray, list[int] | None], Any]
    expect: Callable[[dict[int, np.ndarray], int, list[int]], Any]


def _root(ctx: mt.DistributedContext, members: list[int] | None) -> mt.Device:
    return ctx.devices[members[0] if members else 0]


def _held_all_reduce(ctx: mt.DistributedContext, x: np.ndarray, members: list[int] | None) -> Any:
    out = np.empty_like(x)
    handle = mt.all_reduce(x, OP.SUM, members, out=out, held=True)
    return _Resolved(handle, out)


class _Resolved:
    """A handle whose result is the caller's buffer."""

    def __init__(self, handle: mt.CollectiveTensor, out: np.ndarray) -> None:
        self.handle, self.out = handle, out

    def resolve(self, timeout: float | None = None) -> np.ndarray:
        self.handle.resolve(timeout)
        return self.out


def _p2p(ctx: mt.DistributedContext, x: np.ndarray, members: list[int] | None) -> Any:
    size = ctx.size
    sent = mt.send(x, (ctx.rank + 1) % size)
    got = mt.recv(source=(ctx.rank - 1) % size, shape=x.shape, dtype=x.dtype)
    return _Both(sent, got)


class _Both:
    def __init__(self, sent: mt.CollectiveTensor, got: mt.CollectiveTensor) -> None:
        self.sent, self.got = sent, got

    def resolve(self, timeout: float | None = None) -> Any:
        self.sent.resolve(timeout)
        return self.got.resolve(timeout)


def _total(inputs: dict[int, np.ndarray], members: list[int]) -> np.ndarray:
    return sum(inputs[w] for w in members)


def _joined(inputs: dict[int, np.ndarray], members: list[int]) -> np.ndarray:
    return np.concatenate([inputs[w] for w in members])


def _tiled(ctx: mt.DistributedContext, x: np.ndarray, members: list[int] | None) -> np.ndarray:
    """`x` once per member: every member's block of a reduce_scatter or all_to_all is `x`."""
    return np.tile(x, len(members) if members else ctx.size)


def _scatter(ctx: mt.DistributedContext, x: np.ndarray, members: list[int] | None) -> Any:
    root = _root(ctx, members)
    count = len(members) if members else ctx.size
    whole = np.tile(x, count)
    if ctx.device == root:
        return mt.scatter(whole, root, devices=members)
    return mt.scatter(None, root, shape=whole.shape, dtype=whole.dtype, devices=members)


CALLS: dict[str, Call] = {
    "all_reduce": Call(lambda ctx, x, m: mt.all_reduce(x, OP.SUM, m), lambda i, me, w: _total(i, w)),
    "held_all_reduce": Call(_held_all_reduce, lambda i, me, w: _total(i, w)),
    "fused_all_reduce": Call(lambda ctx, x, m: mt.all_reduce([x, 2 * x], OP.SUM, m),
                             lambda i, me, w: [_total(i, w), 2 * _total(i, w)]),
    "broadcast": Call(lambda ctx, x, m: mt.broadcast(x, root=_root(ctx, m), devices=m), lambda i, me, w: i[w[0]]),
    "reduce": Call(lambda ctx, x, m: mt.reduce(x, OP.SUM, root=_root(ctx, m), devices=m),
                   lambda i, me, w: _total(i, w) if me == 0 else None),
    "all_gather": Call(lambda ctx, x, m: mt.all_gather(x, devices=m), lambda i, me, w: _joined(i, w)),
    "reduce_scatter": Call(lambda ctx, x, m: mt.reduce_scatter(_tiled(ctx, x, m), OP.SUM, devices=m),
                           lambda i, me, w: _total(i, w)),
    "all_to_all": Call(lambda ctx, x, m: mt.all_to_all(_tiled(ctx, x, m), devices=m), lambda i, me, w: _joined(i, w)),
    "gather": Call(lambda ctx, x, m: mt.gather(x, _root(ctx, m), devices=m),
                   lambda i, me, w: _joined(i, w) if me == 0 else None),
    "scatter": Call(_scatter, lambda i, me, w: i[w[0]]),
    "scan": Call(lambda ctx, x, m: mt.scan(x, OP.SUM, devices=m), lambda i, me, w: _total(i, w[: me + 1])),
    "barrier": Call(lambda ctx, x, m: mt.barrier(m), lambda i, me, w: None),
    "broadcast_object": Call(lambda ctx, x, m: mt.broadcast_object({"sum": float(x.sum())}, _root(ctx, m), devices=m),
                             lambda i, me, w: {"sum": float(i[w[0]].sum())}),
    "send_recv": Call(_p2p, lambda i, me, w: i[w[(me - 1) % len(w)]]),
}


def resolve(value: Any) -> Any:
    """The result of a started call: a handle's (and a list of handles'), or the value itself."""
    if hasattr(value, "resolve"):
        value = value.resolve()
    if isinstance(value, list):
        return [np.asarray(v) for v in value]
    if isinstance(value, mt.Tensor):
        return value.numpy()
    return value


def same(got: Any, expected: Any) -> bool:
    """`got` equals NumPy's `expected` (arrays, lists of arrays, None, objects)."""
    if expected is None or isinstance(expected, dict):
        return got == expected
    if isinstance(expected, list):
        return isinstance(got, list) and len(got) == len(expected) and all(map(same, got, expected))
    got = np.asarray(got)
    return got.shape == expected.shape and bool(np.array_equal(got, expected))


def world_ranks(ctx: mt.DistributedContext, members: Sequence[int] | None) -> list[int]:
    """The world ranks of the context ranks `members` (every rank when None)."""
    return [ctx.devices[r].rank for r in (members if members is not None else range(ctx.size))]


def check(ctx: mt.DistributedContext, name: str, seed: int, count: int, members: list[int] | None = None) -> bool:
    """Run collective `name` on `ctx` and compare with NumPy over the members' inputs; report ``bad`` if it differs."""
    me_world = ctx.devices[ctx.rank].rank
    world = world_ranks(ctx, members)
    inputs = {w: data(seed, w, count) for w in world}
    got = resolve(CALLS[name].start(ctx, inputs[me_world], members))
    expected = CALLS[name].expect(inputs, world.index(me_world), world)
    if not same(got, expected):
        report("bad", name, "size", ctx.size, "members", members, "got", repr(got)[:200],
               "expected", repr(expected)[:200])
        return False
    return True


def check_every_call(ctx: mt.DistributedContext, seed: int, count: int) -> None:
    """Every collective of `CALLS` on the whole context, then on a sub-group made now: NumPy's results."""
    ok = all(check(ctx, name, seed + k, count) for k, name in enumerate(CALLS) if ctx.size > 1 or name != "send_recv")
    if ctx.size >= 2 and ctx.rank < 2:  # a sub-group the new context makes on demand
        ok = all(check(ctx, name, seed + 100 + k, count, [0, 1]) for k, name in enumerate(CALLS) if name != "send_recv")
    report("verified" if ok else "bad", "every call", ctx.size)


def die(how: str) -> None:
    """End this process now, as a killed or crashed rank does (`how`: ``"SIGKILL"`` or ``"_exit"``)."""
    report("died", repr(time.time()))
    if how == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def lose_a_rank(ctx: mt.DistributedContext, name: str, victims: Sequence[int], how: str, seed: int, count: int,
                members: list[int] | None = None) -> tuple[int, ...]:
    """Run collective `name` in a loop until `victims` (context ranks) die right after their third call.

    Each iteration starts two calls, then resolves both, so a survivor holds a started
    handle when the error comes: both must give `RankFailedError`. With `members`, the
    calls run on that sub-group, and the other ranks run the same collective on theirs (the
    rest of the context), which the dead rank is not in: they must learn of it too.

    Returns:
        The ranks the survivor's `RankFailedError` named (the victims never return).

    Raises:
        AssertionError: no RankFailedError within twice `DETECTION_BOUND` (reported ``bad``).
    """
    if members is not None and ctx.rank not in members:
        members = [r for r in range(ctx.size) if r not in members]
    world = world_ranks(ctx, members)
    me_world = ctx.devices[ctx.rank].rank
    inputs = {w: data(seed, w, count) for w in world}
    expected = CALLS[name].expect(inputs, world.index(me_world), world)
    started = time.time()
    iteration = 0
    second = None
    try:
        while time.time() - started < 2 * DETECTION_BOUND:
            first = CALLS[name].start(ctx, inputs[me_world], members)
            second = CALLS[name].start(ctx, inputs[me_world], members)
            if ctx.rank in victims and iteration == 2:
                die(how)
            results = [resolve(first), resolve(second)]
            second = None
            if not all(same(got, expected) for got in results):
                report("bad", name, "before the death", repr(results[0])[:200])
            iteration += 1
    except mt.RankFailedError as error:
        detected = time.time()
        report("detected", repr(detected), "ranks", *error.ranks, "pending", _second_fails(second),
               "message", str(error).replace("\n", " ")[:400])
        return error.ranks
    report("bad", name, "no RankFailedError within", 2 * DETECTION_BOUND, "s")
    raise AssertionError("no RankFailedError")


def _second_fails(handle: Any) -> bool:
    """Whether a started handle of the failed context resolves with RankFailedError (True also without one)."""
    if handle is None or not hasattr(handle, "resolve"):
        return True
    try:
        handle.resolve()
    except mt.RankFailedError:
        return True
    except Exception:
        return False
    return False


def shrink_and_check(ctx: mt.DistributedContext, name: str, seed: int, count: int,
                     config: mt.DistributedConfig | None = None) -> mt.DistributedContext:
    """Shrink `ctx`, run `name` on the survivors against NumPy, close the old context; the new one."""
    began = time.time()
    new = ctx.shrink(config)
    shrunk = time.time()
    ok = check(new, name, seed, count)
    first = time.time()
    ctx.close()
    report("recovered", repr(began), repr(shrunk), repr(first), "size", new.size, "rank", new.rank,
           "ok", ok)
    return new


def shrink_until_it_holds(ctx: mt.DistributedContext) -> mt.DistributedContext:
    """Shrink `ctx`, again while a rank dies before the survivors' first all-reduce; close the old contexts."""
    while True:
        new = ctx.shrink()
        ctx.close()
        try:
            mt.barrier()
            return new
        except mt.RankFailedError:
            ctx = new


def die_soon(delay: float) -> threading.Timer:
    """Kill this process (SIGKILL) `delay` seconds from now, whatever it is doing then."""
    timer = threading.Timer(delay, die, ("SIGKILL",))
    timer.daemon = True
    timer.start()
    return timer
