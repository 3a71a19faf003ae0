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


def test_async_save_with_a_gloo_group_and_its_error_on_the_mpitensor_group(tmp_path):
    """dcp.async_save: with a gloo group for its thread it saves what dcp.load gives back on every rank.

    On the mpitensor group its planning thread is refused (the program's thread runs the
    group's collectives), saying what to pass; the next collective is right.
    """
    result = run_job(
        script("""
        import torch.distributed.checkpoint as dcp
        dist.init_process_group("mpitensor")
        rank = dist.get_rank()
        folder = mt.broadcast_object(tempfile.mkdtemp() if rank == 0 else None).resolve()
        torch.manual_seed(rank)  # each rank's own weights: a checkpoint of the replicated state is rank 0's
        model = torch.nn.Linear(4, 3)
        state = {"model": model.state_dict()}
        saving = dcp.async_save(state, checkpoint_id=folder + "/one", process_group=dist.new_group(backend="gloo"))
        saving.result()
        fresh = torch.nn.Linear(4, 3)
        loaded = {"model": fresh.state_dict()}
        dcp.load(loaded, checkpoint_id=folder + "/one")
        weight = loaded["model"]["weight"]
        every = mt.all_gather_object(model.weight.detach().numpy()).resolve()
        report("loaded", np.array_equal(weight.numpy(), every[0]))
        try:
            dcp.async_save(state, checkpoint_id=folder + "/two").result()
        except mt.ThreadMisuseError as exc:
            report("refused", "new_group(backend='gloo')" in str(exc))
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)
        report("next", t.tolist())
        dist.destroy_process_group()
        """),
        2,
        timeout=180,
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.output
    assert result.reported("loaded") == ["loaded True"] * 2, result.output
    assert result.reported("refused") == ["refused True"] * 2, result.output
    assert result.reported("next") == ["next [3.0, 3.0]"] * 2


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
