"""Checks that mpitensor behaves under a real launcher and across hosts.

Run it under ``mpiexec`` or ``srun`` like any mpitensor program::

    srun --mpi=pmi2 python scripts/cluster/cluster_check.py --slurm --launcher srun
    mpiexec -hosts h1:2,h2:2 -n 4 python scripts/cluster/cluster_check.py --hosts 2 --ranks-per-host 2,2

Every rank runs every check; rank 0 gathers the verdicts and prints one ``PASS`` or
``FAIL`` line per check, the ``python -m mpitensor info`` table, and the bandwidth it
measured. The exit status is 0 on every rank when all checks pass, 1 otherwise, so the
launcher (and ``sbatch --wait``) reports the outcome. ``--fail-on-rank R`` instead makes
rank R raise mid-job, to show that the whole job ends (fail-fast) rather than hangs.

The file sits outside ``tests/`` on purpose: it is a job, not a pytest module.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import mpitensor as mt
from mpitensor._core.device import gpu_for_local_rank, local_rank_from_env, visible_gpu_count
from mpitensor._core.mpi import vendor
from mpitensor._runtime.context import local_rank_env_check
from mpitensor._tools.info import collect, format_table

Verdict = tuple[bool, str]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", type=int, help="expected number of distinct hosts")
    parser.add_argument(
        "--ranks-per-host", help="expected ranks on each host, in order of first rank, e.g. 2,2,1"
    )
    parser.add_argument("--slurm", action="store_true", help="expect to run inside a Slurm job")
    parser.add_argument(
        "--launcher", choices=("srun", "mpiexec"), default="mpiexec",
        help="what started the ranks (srun: SLURM_PROCID and SLURM_LOCALID must match MPI)",
    )
    parser.add_argument(
        "--gpus-per-task", type=int, default=0,
        help="expect Slurm to have bound this many GPUs to each task (CUDA_VISIBLE_DEVICES)",
    )
    parser.add_argument("--mib", type=float, default=8.0, help="message size of the large checks, MiB")
    parser.add_argument("--iterations", type=int, default=10, help="timed repetitions per bandwidth figure")
    parser.add_argument("--json", help="rank 0 writes the verdicts and figures here")
    parser.add_argument("--fail-on-rank", type=int, help="this rank raises after the first all-reduce")
    parser.add_argument(
        "--no-fail-fast", action="store_true",
        help="open the context with fail_fast=False (a control: the fail-fast case must then hang or time out)",
    )
    return parser.parse_args(argv)


# -- helpers -------------------------------------------------------------------------------


def gather_verdicts(ctx: mt.DistributedContext, verdict: Verdict) -> Verdict:
    """Combine every rank's verdict: ok only if all are, with the failing ranks' details."""
    everyone = ctx.comm.allgather(verdict)
    bad = [f"rank {r}: {detail}" for r, (ok, detail) in enumerate(everyone) if not ok]
    if bad:
        return False, "; ".join(bad)
    return True, everyone[0][1]


def hosts_in_order(hosts: tuple[str, ...]) -> list[str]:
    """The distinct hosts, ordered by their lowest rank."""
    return list(dict.fromkeys(hosts))


def ranks_of(ctx: mt.DistributedContext, host: str) -> list[int]:
    """The ranks on `host`, ascending."""
    return [r for r, h in enumerate(ctx.hosts) if h == host]


def exact(array: Any, expected: np.ndarray) -> bool:
    """True when `array` equals `expected` in shape, dtype and every value."""
    got = np.asarray(array)
    return got.shape == expected.shape and got.dtype == expected.dtype and bool(np.array_equal(got, expected))


def first_difference(array: Any, expected: np.ndarray) -> str:
    """A short description of how `array` differs from `expected`."""
    got = np.asarray(array)
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return f"got {got.dtype}{list(got.shape)}, expected {expected.dtype}{list(expected.shape)}"
    index = int(np.flatnonzero(got.ravel() != expected.ravel())[0])
    return f"element {index}: got {got.ravel()[index]}, expected {expected.ravel()[index]}"


def compare(name: str, array: Any, expected: np.ndarray) -> Verdict:
    """A verdict on one result."""
    if exact(array, expected):
        return True, f"{name} exact"
    return False, f"{name}: {first_difference(array, expected)}"


# -- the checks ----------------------------------------------------------------------------


def check_placement(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """Hosts and local ranks: each host's ranks have local ranks 0..k-1 in rank order."""
    hosts = hosts_in_order(ctx.hosts)
    counts = [len(ranks_of(ctx, h)) for h in hosts]
    problems = []
    if args.hosts is not None and len(hosts) != args.hosts:
        problems.append(f"expected {args.hosts} host(s), found {len(hosts)}: {hosts}")
    if args.ranks_per_host:
        wanted = [int(n) for n in args.ranks_per_host.split(",")]
        if counts != wanted:
            problems.append(f"expected {wanted} ranks per host, found {counts} on {hosts}")
    for host in hosts:
        local = [ctx.local_ranks[r] for r in ranks_of(ctx, host)]
        if local != list(range(len(local))):
            problems.append(f"{host}: local ranks {local} for ranks {ranks_of(ctx, host)}")
    mine = ranks_of(ctx, ctx.host)
    if ctx.local_size != len(mine):
        problems.append(f"local_size {ctx.local_size} but {len(mine)} rank(s) on {ctx.host}")
    if problems:
        return False, "; ".join(problems)
    layout = ", ".join(f"{h}: ranks {ranks_of(ctx, h)}" for h in hosts)
    return True, f"{len(hosts)} host(s) [{layout}], local ranks 0..k-1 on each"


def check_launcher_local_rank(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """The launcher's local-rank variable, where set, agrees with MPI's node split."""
    note = local_rank_env_check(ctx)
    if note:
        return False, note
    found = local_rank_from_env()
    return True, "no launcher variable" if found is None else f"{found[1]} agrees"


def check_device(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """The device follows the rule: cuda:(local_rank % visible GPUs), else the CPU."""
    gpus = visible_gpu_count()
    expected = ("cuda", gpu_for_local_rank(ctx.local_rank, gpus)) if gpus else ("cpu", 0)
    got = (ctx.device.kind, ctx.device.index)
    if got != expected:
        return False, f"device {ctx.device} but {gpus} visible GPU(s) and local rank {ctx.local_rank} give {expected}"
    if ctx.devices[ctx.rank] != ctx.device or ctx.device.rank != ctx.rank:
        return False, f"ctx.devices[{ctx.rank}] is {ctx.devices[ctx.rank]}, ctx.device is {ctx.device}"
    return True, f"{ctx.device} ({gpus} visible GPU(s))"


def check_slurm(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """Inside Slurm: one job on as many nodes as hosts; under srun Slurm's ids equal MPI's.

    With ``--gpus-per-task``, Slurm's GPU binding is checked too. Under srun each task sees
    exactly its own GPU(s); under mpiexec every rank sees the node's GPUs of the job. Either
    way, the GPU mpitensor drives (the visible one at ``local_rank % visible``) must differ
    between the ranks of a host.
    """
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return False, "SLURM_JOB_ID is not set"
    problems = []
    jobs = set(ctx.comm.allgather(env["SLURM_JOB_ID"]))
    if len(jobs) != 1:
        problems.append(f"ranks see different Slurm jobs {sorted(jobs)}")
    hosts = hosts_in_order(ctx.hosts)
    if env.get("SLURM_JOB_NUM_NODES") != str(len(hosts)):
        problems.append(f"SLURM_JOB_NUM_NODES={env.get('SLURM_JOB_NUM_NODES')} but ranks on {len(hosts)} host(s)")
    if args.launcher == "srun":
        # Under mpiexec these describe the step that started MPI's daemons, not the ranks.
        ids = {"SLURM_NTASKS": ctx.size, "SLURM_PROCID": ctx.rank, "SLURM_LOCALID": ctx.local_rank}
        for name, want in ids.items():
            if env.get(name) != str(want):
                problems.append(f"{name}={env.get(name)} but MPI gives {want}")
    gpu_detail = ""
    if args.gpus_per_task:
        seen = env.get("CUDA_VISIBLE_DEVICES")
        visible = [v for v in (seen or "").split(",") if v]
        if not visible:
            problems.append(f"CUDA_VISIBLE_DEVICES={seen!r}: Slurm bound no GPU")
        elif args.launcher == "srun" and len(visible) != args.gpus_per_task:
            problems.append(f"CUDA_VISIBLE_DEVICES={seen!r}, expected {args.gpus_per_task} GPU(s) for this task")
        driven = visible[gpu_for_local_rank(ctx.local_rank, len(visible))] if visible else None
        chosen = ctx.comm.allgather((ctx.host, driven))
        on_host = [gpu for host, gpu in chosen if host == ctx.host]
        if len(set(on_host)) != len(on_host):
            problems.append(f"ranks on {ctx.host} would share GPUs: {on_host}")
        gpu_detail = f", GPUs per rank on {ctx.host}: {on_host} (CUDA_VISIBLE_DEVICES={seen})"
    if problems:
        return False, "; ".join(problems)
    detail = f"job {env['SLURM_JOB_ID']} on {len(hosts)} node(s)"
    if args.launcher == "srun":
        detail += f", SLURM_NTASKS={ctx.size}, SLURM_PROCID/SLURM_LOCALID = MPI rank/local rank"
    return True, detail + gpu_detail


def check_info_table(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """``python -m mpitensor info`` shows every rank's host and local rank (and Slurm ids)."""
    rows = collect(ctx)
    table = format_table(rows)
    if ctx.rank == 0:
        print(table, flush=True)
    lines = table.splitlines()
    problems = []
    for r in range(ctx.size):
        cells = lines[2 + r].split()
        if cells[:3] != [str(r), ctx.hosts[r], str(ctx.local_ranks[r])]:
            problems.append(f"row {r} is {cells[:3]}, expected {[str(r), ctx.hosts[r], str(ctx.local_ranks[r])]}")
    hosts = hosts_in_order(ctx.hosts)
    if not any(line.startswith(f"{ctx.size} rank(s) on {len(hosts)} host(s)") for line in lines):
        problems.append("no summary line of ranks and hosts")
    if args.slurm and "slurm proc/local/node" not in lines[0]:
        problems.append("no Slurm column although SLURM_* is set")
    if problems:
        return False, "; ".join(problems)
    return True, f"{ctx.size} row(s), {len(hosts)} host(s)" + (", Slurm column" if args.slurm else "")


def check_all_reduce_world(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """World all-reduce: SUM, MEAN, MAX on small tensors, exact."""
    n, size = 1000, ctx.size
    base = np.arange(n, dtype=np.float64)
    pending = {
        "sum": mt.all_reduce(mt.from_numpy(base * (ctx.rank + 1)), mt.ReduceOperation.SUM),
        "mean": mt.all_reduce(mt.from_numpy(np.full(n, 2.0 * ctx.rank, np.float32)), mt.ReduceOperation.MEAN),
        "max": mt.all_reduce(mt.from_numpy(np.full(n, ctx.rank, np.int64)), mt.ReduceOperation.MAX),
    }
    expected = {
        "sum": base * (size * (size + 1) // 2),
        "mean": np.full(n, float(size - 1), np.float32),
        "max": np.full(n, size - 1, np.int64),
    }
    for name, handle in pending.items():
        ok, detail = compare(name, handle.resolve().numpy(), expected[name])
        if not ok:
            return ok, detail
    return True, "sum, mean, max exact"


def check_all_reduce_large(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """A large world all-reduce (``--mib``), exact."""
    count = int(args.mib * 2**20) // 4
    result = mt.all_reduce(mt.from_numpy(np.full(count, ctx.rank + 1, np.float32))).resolve()
    want = np.full(count, ctx.size * (ctx.size + 1) / 2, np.float32)
    ok, detail = compare(f"{args.mib:g} MiB float32 sum", result.numpy(), want)
    return ok, detail


def cross_host_groups(ctx: mt.DistributedContext) -> list[list[int]]:
    """Sub-groups that span hosts: one rank per host (the leaders), and the last rank of each.

    On a single host the groups are {0, size-1} and the odd ranks, so the check still runs.
    """
    hosts = hosts_in_order(ctx.hosts)
    if len(hosts) > 1:
        groups = [[ranks_of(ctx, h)[0] for h in hosts], [ranks_of(ctx, h)[-1] for h in hosts]]
    else:
        groups = [[0, ctx.size - 1], list(range(1, ctx.size, 2))]
    unique = []
    for group in groups:
        members = sorted(set(group))
        if len(members) > 1 and members not in unique and len(members) < ctx.size:
            unique.append(members)
    return unique


def check_sub_groups(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """All-reduce and barrier on sub-groups that span hosts, exact; outsiders untouched."""
    groups = cross_host_groups(ctx)
    if not groups:
        return True, "no proper sub-group at this size (skipped)"
    done, problems = [], []
    for members in groups:
        # No early return: a rank that stopped here would leave its group in the barrier.
        if ctx.rank in members:
            devices = [ctx.devices[r] for r in members]
            value = np.full(4096, ctx.rank + 1, np.int64)
            result = mt.all_reduce(mt.from_numpy(value), mt.ReduceOperation.SUM, devices=devices).resolve()
            want = np.full(4096, sum(m + 1 for m in members), np.int64)
            ok, detail = compare(f"group {members}", result.numpy(), want)
            if not ok:
                problems.append(detail)
            mt.barrier(devices=devices)
        spans = sorted({ctx.hosts[r] for r in members})
        done.append(f"{members} on {spans}")
    if problems:
        return False, "; ".join(problems)
    return True, "; ".join(done)


def check_broadcast(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """Broadcast from the last rank (another host where there are several) and in a sub-group."""
    root = ctx.size - 1
    want = np.arange(100_000, dtype=np.float64) * 3.5
    mine = want if ctx.rank == root else np.zeros_like(want)
    result = mt.broadcast(mt.from_numpy(mine), root=root).resolve()
    verdicts = [compare(f"world from rank {root}", result.numpy(), want)]
    groups = cross_host_groups(ctx)
    if groups and ctx.rank in groups[0]:
        members = groups[0]
        sub_root = members[-1]
        sub_want = np.arange(5000, dtype=np.int32) - sub_root
        sub_mine = sub_want if ctx.rank == sub_root else np.zeros_like(sub_want)
        devices = [ctx.devices[r] for r in members]
        got = mt.broadcast(mt.from_numpy(sub_mine), root=ctx.devices[sub_root], devices=devices).resolve()
        verdicts.append(compare(f"group {members} from rank {sub_root}", got.numpy(), sub_want))
    problems = [detail for ok, detail in verdicts if not ok]
    if problems:
        return False, "; ".join(problems)
    if groups:
        return True, f"world from rank {root}, group {groups[0]} from rank {groups[0][-1]}: exact"
    return True, f"world from rank {root}: exact"


def check_fused(ctx: mt.DistributedContext, args: argparse.Namespace) -> Verdict:
    """The fused all-reduce of a list and of a dict returns the same structure, exact."""
    r, size = ctx.rank + 1, ctx.size
    total = size * (size + 1) // 2
    as_list = [
        mt.from_numpy(np.full(3000, r, np.float32)),
        mt.from_numpy(np.full((7, 5), 2 * r, np.float64)),
        mt.from_numpy(np.full(1, r, np.int32)),
    ]
    as_dict = {"w": mt.from_numpy(np.full((64, 64), r, np.float32)), "b": mt.from_numpy(np.full(64, -r, np.float64))}
    got_list = mt.all_reduce(as_list).resolve()
    got_dict = mt.all_reduce(as_dict).resolve()
    if not isinstance(got_list, list) or len(got_list) != 3:
        return False, f"list in, {type(got_list).__name__} of {len(got_list)} out"
    if not isinstance(got_dict, dict) or sorted(got_dict) != ["b", "w"]:
        return False, f"dict in, {type(got_dict).__name__} {sorted(got_dict) if isinstance(got_dict, dict) else ''} out"
    expected = [
        ("list[0]", got_list[0], np.full(3000, total, np.float32)),
        ("list[1]", got_list[1], np.full((7, 5), 2 * total, np.float64)),
        ("list[2]", got_list[2], np.full(1, total, np.int32)),
        ("dict['w']", got_dict["w"], np.full((64, 64), total, np.float32)),
        ("dict['b']", got_dict["b"], np.full(64, -total, np.float64)),
    ]
    for name, tensor, want in expected:
        ok, detail = compare(name, tensor.numpy(), want)
        if not ok:
            return ok, detail
    return True, "list of 3 and dict of 2: structure and values exact"


def measure_bandwidth(ctx: mt.DistributedContext, args: argparse.Namespace, figures: dict[str, Any]) -> Verdict:
    """Ping-pong between two hosts and a timed world all-reduce; figures go to `figures`.

    The ping-pong pairs rank 0 with the first rank of another host (rank 1 on one host);
    every other rank waits at a barrier. Bandwidth counts the bytes of one message per
    one-way trip. The all-reduce figure is the bus bandwidth, 2(n-1)/n x bytes / time, the
    usual measure of a ring all-reduce.
    """
    nbytes = int(args.mib * 2**20)
    hosts = hosts_in_order(ctx.hosts)
    peer = ranks_of(ctx, hosts[1])[0] if len(hosts) > 1 else (1 if ctx.size > 1 else 0)
    message = np.full(nbytes // 8, float(ctx.rank + 1), np.float64)
    verdict: Verdict = (True, "")
    mt.barrier()
    if peer != 0 and ctx.rank in (0, peer):
        other = peer if ctx.rank == 0 else 0
        # Each side sends its own tensor and checks the other's: the reply is not the
        # received tensor sent back, so a fault in one direction cannot hide in the other.
        payload = mt.from_numpy(message)
        for i in range(args.iterations + 2):  # two warm-up round trips, untimed
            if i == 2:
                start = time.perf_counter()
            if ctx.rank == 0:
                mt.send(payload, other, tag=1).resolve()
                got = mt.recv(source=other, tag=2).resolve()
            else:
                got = mt.recv(source=other, tag=1).resolve()
                mt.send(payload, other, tag=2).resolve()
        seconds = (time.perf_counter() - start) / (2 * args.iterations)
        if not exact(got.numpy(), np.full(nbytes // 8, float(other + 1), np.float64)):
            verdict = (False, f"ping-pong: the message from rank {other} arrived altered")
        figures["pingpong"] = {
            "ranks": [0, peer], "hosts": [ctx.hosts[0], ctx.hosts[peer]], "bytes": nbytes,
            "seconds_one_way": seconds, "mib_per_s": nbytes / 2**20 / seconds,
        }
    mt.barrier()
    payload = mt.from_numpy(np.full(nbytes // 4, 1.0, np.float32))
    for _ in range(2):
        mt.all_reduce(payload).resolve()
    mt.barrier()
    start = time.perf_counter()
    for _ in range(args.iterations):
        result = mt.all_reduce(payload).resolve()
    seconds = (time.perf_counter() - start) / args.iterations
    seconds = max(ctx.comm.allgather(seconds))
    if not exact(result.numpy(), np.full(nbytes // 4, float(ctx.size), np.float32)):
        verdict = (False, "timed all-reduce result wrong")
    bus = 2 * (ctx.size - 1) / ctx.size * nbytes / 2**20 / seconds if ctx.size > 1 else 0.0
    figures["all_reduce"] = {"ranks": ctx.size, "bytes": nbytes, "seconds": seconds, "bus_mib_per_s": bus}
    shared = ctx.comm.bcast(figures.get("pingpong"), root=0)
    if shared:
        figures["pingpong"] = shared
    if not verdict[0]:
        return verdict
    parts = []
    if shared:
        parts.append(
            f"ping-pong {shared['hosts'][0]}<->{shared['hosts'][1]} {args.mib:g} MiB: {shared['mib_per_s']:.0f} MiB/s"
        )
    parts.append(f"all-reduce {args.mib:g} MiB over {ctx.size} ranks: {seconds * 1e3:.1f} ms, bus {bus:.0f} MiB/s")
    return True, "; ".join(parts)


CHECKS: list[tuple[str, Callable[[mt.DistributedContext, argparse.Namespace], Verdict]]] = [
    ("placement", check_placement),
    ("launcher-local-rank", check_launcher_local_rank),
    ("device", check_device),
    ("info-table", check_info_table),
    ("all-reduce-world", check_all_reduce_world),
    ("all-reduce-large", check_all_reduce_large),
    ("sub-groups", check_sub_groups),
    ("broadcast", check_broadcast),
    ("fused-all-reduce", check_fused),
]


def run_checks(ctx: mt.DistributedContext, args: argparse.Namespace) -> int:
    """Run every check on every rank; rank 0 prints the verdicts. Returns the exit status."""
    checks = list(CHECKS)
    if args.slurm:
        checks.insert(3, ("slurm", check_slurm))
    figures: dict[str, Any] = {}
    checks.append(("bandwidth", lambda c, a: measure_bandwidth(c, a, figures)))
    verdicts = []
    for name, check in checks:
        try:
            local = check(ctx, args)
        except mt.MpitensorError as error:
            # A clear mpitensor error on one rank is a failed check, not a crash: every rank
            # still reaches the gather below, because collectives raise on all ranks alike.
            local = (False, f"{type(error).__name__}: {error}")
        ok, detail = gather_verdicts(ctx, local)
        verdicts.append({"check": name, "ok": ok, "detail": detail})
        if ctx.rank == 0:
            print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    failed = [v["check"] for v in verdicts if not v["ok"]]
    if ctx.rank == 0:
        if failed:
            print(f"cluster_check: {len(failed)} of {len(verdicts)} checks FAILED: {', '.join(failed)}", flush=True)
        else:
            print(f"cluster_check: all {len(verdicts)} checks passed", flush=True)
        if args.json:
            summary = {
                "mpi": " ".join(vendor()),
                "ranks": ctx.size,
                "hosts": hosts_in_order(ctx.hosts),
                "verdicts": verdicts,
                "figures": figures,
            }
            with open(args.json, "w") as out:
                json.dump(summary, out, indent=2)
    return 1 if failed else 0


def fail_on_rank(ctx: mt.DistributedContext, rank: int) -> int:
    """Rank `rank` raises after one all-reduce; the others wait in the next one.

    Without fail-fast the others would wait until the timeout; with it, the whole job is
    aborted within moments of the exception.
    """
    mt.all_reduce(mt.from_numpy(np.ones(16))).resolve()
    if ctx.rank == rank:
        raise RuntimeError(f"cluster_check: deliberate failure on rank {rank} (host {ctx.host})")
    mt.all_reduce(mt.from_numpy(np.ones(16))).resolve()
    print(f"[rank {ctx.rank}] cluster_check: the all-reduce completed without rank {rank}", flush=True)
    return 3


def main(argv: list[str] | None = None) -> int:
    """Open a context, run the checks (or the fail-fast case); return the exit status."""
    args = parse_args(argv)
    config = mt.DistributedConfig(fail_fast=False) if args.no_fail_fast else None
    with mt.DistributedContext.init(config=config) as ctx:
        if args.fail_on_rank is not None:
            return fail_on_rank(ctx, args.fail_on_rank)
        return run_checks(ctx, args)


if __name__ == "__main__":
    sys.exit(main())
