"""The collectives make no data MPI call of their own: those live in `mpitensor/_transport/`.

A pure-logic check of the source (no MPI needed): it walks the syntax tree of every module
of `mpitensor/_collectives/` and `mpitensor/torch/` and names, file:line, each call of an
attribute named like an MPI data call: the non-blocking ones (``I`` and a lowercase letter:
``Iallreduce``, ``Ibcast``, ``Isend``, ``Irecv``, ``Ialltoallv``, ...), the blocking buffer
ones (``Bcast``, ``Allreduce``, ``Send``, ...) and mpi4py's pickle ones whose names nothing
else has (``bcast``, ``allreduce``, ``sendrecv``, ...). The lowercase names mpitensor's own
API shares (``send``, ``recv``, ``gather``, ``scatter``, ``reduce``, ``scan``,
``exscan``) are not checked.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import mpitensor

PACKAGE = Path(mpitensor.__file__).parent
CHECKED = ("_collectives", "torch")

_NONBLOCKING = re.compile(r"I[a-z][a-z_]*")
_NOT_DATA = frozenset({"Info", "Intercomm", "Intracomm"})  # mpi4py classes, not calls
_BLOCKING = frozenset({
    "Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw", "Barrier", "Bcast", "Bsend",
    "Exscan", "Gather", "Gatherv", "Recv", "Reduce", "Reduce_scatter", "Reduce_scatter_block", "Rsend", "Scan",
    "Scatter", "Scatterv", "Send", "Sendrecv", "Sendrecv_replace", "Ssend",
})
_PICKLED = frozenset({
    "allgather", "allreduce", "alltoall", "bcast", "bsend", "ibsend", "irecv", "isend", "issend",
    "sendrecv", "ssend",
})


def is_data_call_name(name: str) -> bool:
    """Whether an attribute called `name` looks like an MPI data call."""
    if name in _NOT_DATA:
        return False
    return bool(_NONBLOCKING.fullmatch(name)) or name in _BLOCKING or name in _PICKLED


def data_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of every call of an attribute named like an MPI data call in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_data_call_name(node.func.attr):
            found.append((node.lineno, node.func.attr))
    return sorted(found)


def calls_by_file() -> dict[str, list[tuple[int, str]]]:
    """The data calls of every checked module, by path relative to the package, for files that have any."""
    result = {}
    for folder in CHECKED:
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            calls = data_calls(path.read_text())
            if calls:
                result[path.relative_to(PACKAGE).as_posix()] = calls
    return result


def test_the_matcher_knows_data_calls_from_other_names():
    source = (
        "comm.Iallreduce(a, b, op)\nself.comm.Irecv(x, 1, 2)\ncomm.Ireduce_scatter_block(a, b, op)\n"
        "comm.Bcast(x)\ncomm.allreduce(1)\nMPI.Intracomm(c)\nmt.send(x, 1)\nmt.all_gather(x)\n"
        "comm.Get_rank()\nrequest.Test()\nfunctools.reduce(f, xs)\nIallreduce(a)\n"
    )
    assert data_calls(source) == [(1, "Iallreduce"), (2, "Irecv"), (3, "Ireduce_scatter_block"), (4, "Bcast"),
                                  (5, "allreduce")]


def test_the_transport_layer_is_where_the_calls_are():
    # The check would pass vacuously if it found nothing anywhere: it finds the moved calls.
    names = {name for path in (PACKAGE / "_transport" / "mpi").glob("*.py") for _, name in data_calls(path.read_text())}
    assert {"Iallreduce", "Ibcast", "Ireduce", "Igatherv", "Iscatterv", "Iallgather", "Ialltoallv",
            "Ireduce_scatter", "Iscan", "Iexscan", "Ibarrier", "Isend", "Irecv"} <= names


def test_collectives_make_no_data_mpi_call_of_their_own():
    stray = [
        f"mpitensor/{path}:{line}: {name}"
        for path, calls in calls_by_file().items()
        for line, name in calls
    ]
    assert not stray, (
        "data MPI calls outside mpitensor/_transport/ (post them through a function or transport "
        "of _transport/mpi/ taking the group as a Channel):\n" + "\n".join(stray)
    )

