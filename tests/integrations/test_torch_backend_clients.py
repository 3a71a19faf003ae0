"""What torch's own clients ask of the "mpitensor" backend beyond its collectives: child jobs under mpiexec.

A gloo sub-group beside the mpitensor default group (Lightning's ``prepare_data`` barrier,
Fabric's ``rank_zero_first``), ``torch.compile(DDP(model))``, ``dcp.async_save``, the
store's fallback, and ``destroy_process_group`` after a ``monitored_barrier`` one rank
skipped. Each job prints what every rank saw; the test compares it with NumPy or gloo.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.helpers import run_job

pytest.importorskip("torch")
pytestmark = pytest.mark.subprocess

START = """
import os, sys, time, datetime, tempfile, warnings
import numpy as np
import torch
import torch.distributed as dist
import mpitensor as mt
import mpitensor.torch
torch.set_num_threads(1)
"""


def script(body: str) -> str:
    """A child job's source: the imports, then `body`."""
    return START + textwrap.dedent(body)


def test_a_gloo_sub_group_works_beside_the_mpitensor_group(tmp_path):
    """dist.new_group(backend="gloo") rendezvouses through the store the backend gives torch."""
    result = run_job(
        script("""
        dist.init_process_group("mpitensor")
        rank, size = dist.get_rank(), dist.get_world_size()
        gloo = dist.new_group(backend="gloo")
        report("backends", dist.get_backend(), dist.get_backend(gloo))
        # rank 0 first, the others after (Lightning's prepare_data, Fabric's rank_zero_first)
        folder = mt.broadcast_object(tempfile.mkdtemp() if rank == 0 else None).resolve()
        if rank == 0:
            with open(os.path.join(folder, "data"), "w") as f:
                f.write("downloaded")
        dist.barrier(group=gloo)
        with open(os.path.join(folder, "data")) as f:
            report("read", f.read())
        rows = [np.arange(4.0) * (r + 1) + r for r in range(size)]
        t = torch.from_numpy(rows[rank].copy())
        dist.all_reduce(t, group=gloo)
        report("gloo sum", np.array_equal(t.numpy(), np.sum(rows, axis=0)))
        u = torch.from_numpy(rows[rank].copy())
        dist.all_reduce(u)
        report("mpitensor sum", np.array_equal(u.numpy(), np.sum(rows, axis=0)))
        dist.destroy_process_group()
        """),
        2,
        timeout=120,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("backends") == ["backends mpitensor gloo"] * 2, result.output
    assert result.reported("read") == ["read downloaded"] * 2
    assert result.reported("gloo sum") == ["gloo sum True"] * 2
    assert result.reported("mpitensor sum") == ["mpitensor sum True"] * 2


def test_the_store_falls_back_with_a_warning_where_rank_0_opens_no_port(tmp_path):
    """A TCPStore that cannot be served: every rank warns, saying why, and the mpitensor group works."""
    result = run_job(
        script("""
        served = dist.TCPStore
        def refuse(host, port, world_size=None, is_master=False, *args, **kwargs):
            if is_master:
                raise RuntimeError("no port for you")
            return served(host, port, world_size, is_master, *args, **kwargs)
        dist.TCPStore = refuse
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            dist.init_process_group("mpitensor")
        said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        report("warned", len(said), "rank 0 could not open a port" in said[0], "no port for you" in said[0])
        t = torch.ones(3)
        dist.all_reduce(t)
        report("sum", t.tolist())
        dist.destroy_process_group()
        """),
        2,
        timeout=120,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("warned") == ["warned 1 True True"] * 2, result.output
    assert result.reported("sum") == ["sum [2.0, 2.0, 2.0]"] * 2


COMPILED_DDP = """
dist.init_process_group("mpitensor")
rank = dist.get_rank()
gloo = dist.new_group(backend="gloo")
weights = {}
for name, group in (("gloo", gloo), ("mpitensor", None)):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
    compiled = torch.compile(ddp)
    optim = torch.optim.SGD(ddp.parameters(), lr=0.1)
    batches = torch.Generator().manual_seed(rank)
    for step in range(3):
        optim.zero_grad()
        compiled(torch.randn(4, 8, generator=batches)).square().sum().backward()
        optim.step()
    weights[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
report("same", torch.equal(weights["gloo"], weights["mpitensor"]))
report("trained", not torch.equal(weights["mpitensor"][:3], torch.zeros(3)))
dist.destroy_process_group()
"""


def test_compiled_ddp_trains_to_gloos_weights(tmp_path):
    """torch.compile(DDP(model)): the reducer's calls into the group run as plain Python under Dynamo."""
    result = run_job(script(COMPILED_DDP), 2, timeout=300, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.reported("same") == ["same True"] * 2, result.output
    assert result.reported("trained") == ["trained True"] * 2


SAVE_TWICE = """
import torch.distributed.checkpoint as dcp
dist.init_process_group("mpitensor")
rank, size = dist.get_rank(), dist.get_world_size()
folder = mt.broadcast_object(tempfile.mkdtemp() if rank == 0 else None).resolve()
torch.manual_seed(0)  # replicated weights (dcp saves one rank's copy of a key every rank has)
model = torch.nn.Linear(4, 3)
mine = torch.from_numpy(np.random.default_rng(rank).standard_normal(5))  # a key of this rank's alone
state = {"model": model.state_dict(), f"own{rank}": mine}
every = mt.all_gather_object((model.weight.detach().numpy(), model.bias.detach().numpy(), mine.numpy())).resolve()


def loaded_right(name):
    torch.manual_seed(1)
    fresh = torch.nn.Linear(4, 3)
    loaded = {"model": fresh.state_dict(), **{f"own{r}": torch.zeros(5, dtype=torch.float64) for r in range(size)}}
    dcp.load(loaded, checkpoint_id=folder + "/" + name)
    return all(np.array_equal(loaded["model"]["weight"].numpy(), weight)
               and np.array_equal(loaded["model"]["bias"].numpy(), bias)
               and np.array_equal(loaded[f"own{r}"].numpy(), own) for r, (weight, bias, own) in enumerate(every))


def next_sum():
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t)
    return t.tolist() == [size * (size + 1) / 2] * 2


saving = dcp.async_save(state, checkpoint_id=folder + "/gloo", process_group=dist.new_group(backend="gloo"))
saving.result()
report("gloo", loaded_right("gloo"), next_sum())
owned = dist.new_group()  # the default backend's: mpitensor
for name in ("first", "second"):  # each save plans on a thread of its own
    dcp.async_save(state, checkpoint_id=folder + "/" + name, process_group=owned).result()
    report(name, loaded_right(name), next_sum())
try:
    dcp.async_save(state, checkpoint_id=folder + "/refused").result()
except mt.ThreadMisuseError as exc:
    report("default group", "dist.new_group(...)" in str(exc), "process_group=" in str(exc))
report("next", next_sum())
dist.destroy_process_group()
"""


@pytest.mark.parametrize("ranks", [2, 3])
def test_async_save_on_a_gloo_group_and_on_a_group_its_thread_owns(tmp_path, ranks):
    """dcp.async_save plans on a thread of its own: with a gloo group, and twice with an mpitensor group of
    dist.new_group (which belongs to the thread that first uses it), dcp.load gives back every rank's state.

    On the default group its thread is refused, saying what to pass; the next collective is right.
    """
    result = run_job(script(SAVE_TWICE), ranks, timeout=240, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.reported("gloo") == ["gloo True True"] * ranks, result.output
    assert result.reported("first") == ["first True True"] * ranks, result.output
    assert result.reported("second") == ["second True True"] * ranks, result.output
    assert result.reported("default group") == ["default group True True"] * ranks, result.output
    assert result.reported("next") == ["next True"] * ranks


ON_A_THREAD = """
import threading


def floats(r, shape=(2, 3)):
    return np.random.default_rng(r).standard_normal(shape)


def ints(r):
    return (np.arange(6, dtype=np.int64).reshape(2, 3) - 2) * (r + 1) + r


def check(name, ok):
    report(name, bool(ok))


def run_on_a_thread(body):
    errors = []

    def run():
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - reported, and the test fails on it
            errors.append(exc)

    thread = threading.Thread(target=run, name="helper")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
"""

COLLECTIVES = ON_A_THREAD + """
REDUCTIONS = {"SUM": np.sum, "AVG": np.mean, "PRODUCT": np.prod, "MIN": np.min, "MAX": np.max}


def collectives():
    every = np.stack([floats(r) for r in range(size)])
    for name, reference in REDUCTIONS.items():
        t = torch.from_numpy(floats(rank))
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name), group=owned)
        check(f"all_reduce float {name}", np.allclose(t.numpy(), reference(every, axis=0), rtol=1e-12, atol=0))
        t = torch.from_numpy(ints(rank))
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name), group=owned)
        whole = np.stack([ints(r) for r in range(size)])
        expected = np.trunc(whole.sum(axis=0) / size) if name == "AVG" else reference(whole, axis=0)
        check(f"all_reduce int {name}", np.array_equal(t.numpy(), expected.astype(np.int64)))
    t = torch.from_numpy(floats(rank))
    dist.all_reduce(t, group=owned, async_op=True).wait()
    check("all_reduce async", np.allclose(t.numpy(), every.sum(axis=0), rtol=1e-12, atol=0))
    outs = [torch.empty(2, 3, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(outs, torch.from_numpy(floats(rank)), group=owned)
    check("all_gather", all(np.array_equal(out.numpy(), every[r]) for r, out in enumerate(outs)))
    halves = [torch.empty(3, dtype=torch.bfloat16) for _ in range(size)]
    dist.all_gather(halves, torch.full((3,), rank + 0.5, dtype=torch.bfloat16), group=owned)
    check("all_gather bfloat16", [h.float().tolist() for h in halves] == [[r + 0.5] * 3 for r in range(size)])
    into = torch.empty(size * 2, 3, dtype=torch.float64)
    dist.all_gather_into_tensor(into, torch.from_numpy(floats(rank)), group=owned)
    check("all_gather_into_tensor", np.array_equal(into.numpy(), np.concatenate(every)))
    t = torch.from_numpy(floats(rank))
    dist.broadcast(t, src=size - 1, group=owned)
    check("broadcast", np.array_equal(t.numpy(), every[size - 1]))
    gathered = [torch.empty(2, 3, dtype=torch.float64) for _ in range(size)] if rank == 1 else None
    dist.gather(torch.from_numpy(floats(rank)), gathered, dst=1, group=owned)
    check("gather", rank != 1 or all(np.array_equal(g.numpy(), every[r]) for r, g in enumerate(gathered)))
    out = torch.empty(2, 3, dtype=torch.float64)
    parts = [torch.from_numpy(floats(100 + r)) for r in range(size)] if rank == 0 else None
    dist.scatter(out, parts, src=0, group=owned)
    check("scatter", np.array_equal(out.numpy(), floats(100 + rank)))
    dist.barrier(group=owned)
    check("barrier", True)
    objects = [None] * size
    dist.all_gather_object(objects, {"rank": rank}, group=owned)
    check("all_gather_object", objects == [{"rank": r} for r in range(size)])
    listed = [rank, "x" * rank] if rank == 0 else [None, None]
    dist.broadcast_object_list(listed, src=0, group=owned)
    check("broadcast_object_list", listed == [0, ""])
    objects = [None] * size if rank == 0 else None
    dist.gather_object(("r", rank), objects, dst=0, group=owned)
    check("gather_object", rank != 0 or objects == [("r", r) for r in range(size)])
    received = [None]
    dist.scatter_object_list(received, [r * 10 for r in range(size)] if rank == 0 else None, src=0, group=owned)
    check("scatter_object_list", received == [rank * 10])
    if rank != 0:  # the tail group: global ranks 1.., so its root and its sums are theirs
        t = torch.from_numpy(floats(rank))
        dist.all_reduce(t, group=tail)
        check("tail all_reduce", np.allclose(t.numpy(), every[1:].sum(axis=0), rtol=1e-12, atol=0))
        t = torch.from_numpy(floats(rank))
        dist.broadcast(t, src=size - 1, group=tail)  # src is a global rank
        check("tail broadcast", np.array_equal(t.numpy(), every[size - 1]))


dist.init_process_group("mpitensor")
rank, size = dist.get_rank(), dist.get_world_size()
owned = dist.new_group()
tail = dist.new_group(ranks=list(range(1, size)))  # group rank k is rank k + 1
run_on_a_thread(collectives)
t = torch.full((2,), float(rank + 1))
dist.all_reduce(t)
report("next", t.tolist() == [size * (size + 1) / 2] * 2)
dist.destroy_process_group(owned)  # frees its communicators
t = torch.full((2,), float(rank + 1))
dist.all_reduce(t)
report("after destroy", t.tolist() == [size * (size + 1) / 2] * 2)
dist.destroy_process_group()
"""

CHECKS = [
    *(f"all_reduce {kind} {op}" for op in ("SUM", "AVG", "PRODUCT", "MIN", "MAX") for kind in ("float", "int")),
    "all_reduce async", "all_gather", "all_gather bfloat16", "all_gather_into_tensor", "broadcast", "gather", "scatter",
    "barrier", "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
]


@pytest.mark.parametrize("ranks", [2, 3])
def test_collectives_on_a_group_a_thread_owns(tmp_path, ranks):
    """Every collective a thread-owned group runs, from a thread, against NumPy over every rank's inputs.

    A group of every rank and a sub-group of ranks 1..; then the default group's next call
    from the program's thread, and after the thread-owned group is destroyed.
    """
    result = run_job(script(COLLECTIVES), ranks, timeout=240, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    for rank in range(ranks):
        lines = result.reports[rank]
        expected = [f"{name} True" for name in CHECKS]
        if rank != 0:
            expected += ["tail all_reduce True", "tail broadcast True"]
        assert lines == [*expected, "next True", "after destroy True"], (rank, result.output)


CHECKED = ON_A_THREAD + """
def expect(name, call, error, *parts):
    try:
        call()
    except error as exc:
        missing = [part for part in parts if part not in str(exc)]
        report(name, type(exc).__name__, "ok" if not missing else f"missing {missing} in {str(exc)!r}")
    else:
        report(name, "no error")


def right(name, group):
    t = torch.full((2,), float(rank + 1))
    dist.all_reduce(t, group=group)
    report(name, t.tolist() == [size * (size + 1) / 2] * 2)


dist.init_process_group("mpitensor")
rank, size = dist.get_rank(), dist.get_world_size()
owned = dist.new_group()
"""

MISMATCHES = CHECKED + """
last = size - 1


def calls():
    parts = [f"rank {r}: all_reduce SUM of float32 [{4 if r == last else 3}]" for r in range(size)]
    expect("shapes", lambda: dist.all_reduce(torch.ones(4 if rank == last else 3), group=owned),
           mt.CollectiveMismatchError, *parts)
    right("after shapes", owned)
    outputs = [torch.empty(2) for _ in range(1 if rank == 0 else size)]
    gathered = [f"rank {r}: all_gather of float32 [2]" for r in range(1, size)]
    expect("bad argument", lambda: dist.all_gather(outputs, torch.ones(2), group=owned),
           mt.CollectiveMismatchError if rank else ValueError,
           *(["rank 0: all_gather failed there: ValueError: all_gather: tensor_list has 1 tensors, but the group "
              f"has {size} ranks", *gathered] if rank else [f"tensor_list has 1 tensors, but the group has {size}"]))
    right("after bad argument", owned)
    meta = torch.ones(2, device="meta") if rank == last else torch.ones(2)
    expect("device", lambda: dist.all_reduce(meta, group=owned),
           mt.DeviceError if rank == last else mt.CollectiveMismatchError,
           "takes CPU tensors, got one on meta" if rank == last else
           f"rank {last}: all_reduce failed there: DeviceError")
    right("after device", owned)
    out, flat = torch.empty(2), torch.ones(2 * size)
    expect("unsupported", lambda: dist.reduce_scatter_tensor(out, flat, group=owned), NotImplementedError,
           "reduce_scatter_tensor on a group that a helper thread owns", "dist.new_group(backend='gloo')")
    right("after unsupported", owned)
    expect("unsupported op", lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), dist.ReduceOp.BAND, owned),
           NotImplementedError, "all_reduce BAND on a group that a helper thread owns")
    right("after unsupported op", owned)
    reduced = torch.ones(2)
    expect("unsupported on one rank",
           lambda: dist.reduce(reduced, dst=0, group=owned) if rank == 0 else dist.all_reduce(reduced, group=owned),
           NotImplementedError if rank == 0 else mt.CollectiveMismatchError,
           "reduce on a group that a helper thread owns" if rank == 0 else
           "rank 0: reduce failed there: NotImplementedError")
    right("after unsupported on one rank", owned)
    objects = [None] * size
    expect("pickling", lambda: dist.all_gather_object(objects, threading.Lock() if rank == 0 else rank, group=owned),
           TypeError if rank == 0 else mt.CollectiveMismatchError,
           "cannot pickle" if rank == 0 else "rank 0: all_gather failed there: TypeError: cannot pickle")
    right("after pickling", owned)


run_on_a_thread(calls)
right("default group", None)
dist.destroy_process_group()
"""

MISMATCH_LINES = ["shapes CollectiveMismatchError ok", "after shapes True"]
CASES = ["bad argument", "device", "unsupported", "unsupported op", "unsupported on one rank", "pickling"]


@pytest.mark.parametrize("ranks", [2, 3])
def test_mismatches_and_bad_arguments_on_a_group_a_thread_owns(tmp_path, ranks):
    """Calls that differ between ranks, and a rank's own bad argument, on a thread-owned group.

    Shapes that differ: CollectiveMismatchError on every rank naming each rank's call. A bad
    argument, a non-CPU tensor, a call or operation the group does not run, or an object
    that does not pickle, on one rank: its own error there, a mismatch naming it on the
    peers (every rank's own error where every rank makes it). The next call is right each time.
    """
    result = run_job(script(MISMATCHES), ranks, timeout=240, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    last = ranks - 1
    own = {
        "bad argument": {0: "ValueError"},
        "device": {last: "DeviceError"},
        "unsupported": {r: "NotImplementedError" for r in range(ranks)},
        "unsupported op": {r: "NotImplementedError" for r in range(ranks)},
        "unsupported on one rank": {0: "NotImplementedError"},
        "pickling": {0: "TypeError"},
    }
    for rank in range(ranks):
        expected = list(MISMATCH_LINES)
        for case in CASES:
            expected += [f"{case} {own[case].get(rank, 'CollectiveMismatchError')} ok", f"after {case} True"]
        assert result.reports[rank] == [*expected, "default group True"], (rank, result.output)


MISUSE = CHECKED + """
claimed, release = threading.Event(), threading.Event()


def planner():
    right("claimed", owned)  # the group's first call: this thread's
    claimed.set()
    release.wait()
    right("still its thread's", owned)


thread = threading.Thread(target=planner, name="planner")
thread.start()
claimed.wait()
expect("owner", lambda: dist.all_reduce(torch.ones(2), group=owned), mt.ThreadMisuseError,
       "called from thread 'MainThread', but the group belongs to thread 'planner'")
expect("owner's object call", lambda: dist.all_gather_object([None] * size, rank, group=owned), mt.ThreadMisuseError,
       "belongs to thread 'planner'")
release.set()
thread.join()
right("handed over", owned)  # its thread ended: the next thread to call takes the group


def on_the_default_group():
    expect("default all_reduce", lambda: dist.all_reduce(torch.ones(2)), mt.ThreadMisuseError,
           "called from thread 'helper'", "dist.new_group(...)")
    expect("default barrier", lambda: dist.barrier(), mt.ThreadMisuseError, "dist.new_group(...)")
    expect("default broadcast", lambda: dist.broadcast(torch.ones(2), src=0), mt.ThreadMisuseError,
           "dist.new_group(...)")


run_on_a_thread(on_the_default_group)
right("default group", None)
dist.destroy_process_group()
"""


def test_a_thread_owned_group_refuses_other_threads(tmp_path):
    """The program's thread calling a group a helper thread owns: ThreadMisuseError naming that thread; the
    group then works from its thread, and passes to the next thread once its own ended. A helper thread
    calling the default group keeps the ThreadMisuseError, which now says to make it a group of its own."""
    result = run_job(script(MISUSE), 2, timeout=180, tmp_path=tmp_path)
    assert result.returncode == 0, result.output
    assert result.reports[0] == result.reports[1] == [
        "claimed True", "owner ThreadMisuseError ok", "owner's object call ThreadMisuseError ok",
        "still its thread's True", "handed over True", "default all_reduce ThreadMisuseError ok",
        "default barrier ThreadMisuseError ok", "default broadcast ThreadMisuseError ok", "default group True",
    ], result.output


WITHOUT_THREAD_MULTIPLE = CHECKED + """
run_on_a_thread(lambda: expect("refused", lambda: dist.all_reduce(torch.ones(2), group=owned), mt.MpitensorError,
                               "MPI_THREAD_MULTIPLE", "dist.new_group(backend='gloo')"))
right("the program's thread", owned)  # the group's first call after all: an ordinary group
dist.destroy_process_group()
"""


def test_a_helper_threads_group_needs_thread_multiple(tmp_path):
    """Without MPI_THREAD_MULTIPLE a helper thread's first call is refused on every rank, saying what to use;
    the group is then the program's thread's."""
    result = run_job(script(WITHOUT_THREAD_MULTIPLE), 2, timeout=120, tmp_path=tmp_path,
                     env={"MPITENSOR_THREAD_LEVEL": "serialized"})
    assert result.returncode == 0, result.output
    assert result.reports[0] == result.reports[1] == ["refused MpitensorError ok", "the program's thread True"], (
        result.output)


def test_destroy_after_a_monitored_barrier_one_rank_skipped(tmp_path):
    """Rank 1 skips a monitored_barrier: rank 0 names it, rank 2 says so in gloo's words, and every rank
    then destroys the group (what the failed call left posted is settled there) and opens the next."""
    result = run_job(
        script("""
        timeout = datetime.timedelta(seconds=1)
        dist.init_process_group("mpitensor")
        rank = dist.get_rank()
        sub = dist.new_group(ranks=[0, 1])
        if rank != 1:
            try:
                dist.monitored_barrier(timeout=timeout)
            except RuntimeError as exc:
                report("world", str(exc).splitlines()[0])
        if rank == 0:
            try:
                dist.monitored_barrier(sub, timeout)
            except RuntimeError as exc:
                report("sub", str(exc).splitlines()[0])
        dist.destroy_process_group()
        report("destroyed", True)
        dist.init_process_group("mpitensor")
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        report("next", t.tolist())
        dist.destroy_process_group()
        """),
        3,
        timeout=120,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("world") == [
        "world [Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms",
        "world Rank 2 successfully reached monitoredBarrier, but received errors while waiting for send/recv "
        "from rank 0. Please check rank 0 logs for faulty rank.",
    ], result.output
    assert result.reported("sub") == ["sub [Rank 0]: Rank 1 failed to pass monitoredBarrier in 1000 ms"]
    assert result.reported("destroyed") == ["destroyed True"] * 3
    assert result.reported("next") == ["next [6.0, 6.0]"] * 3
