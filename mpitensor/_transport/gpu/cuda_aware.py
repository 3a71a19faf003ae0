"""Whether MPI accepts CUDA device buffers: detection, declaration and the decision.

mpi4py has no query for this, and handing a device pointer to an MPI that cannot take one
crashes the process, so mpitensor passes GPU buffers to MPI only when MPI was detected or
declared CUDA-aware, and stages them through host memory otherwise.

In order, the first that has an answer decides:

1. ``DistributedConfig(cuda_aware=True|"all"|False)``: declared by the program.
2. ``MPITENSOR_CUDA_AWARE=1|all|0``: declared by whoever launches it.
3. The MPI library, asked after ``MPI_Init`` through its extensions (via ctypes):
   ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)`` (MPICH and its derivatives),
   else ``MPIX_Query_cuda_support()`` (Open MPI, MPICH). An explicit "no" is final.
4. The MPI 4.1 info key ``mpi_memory_alloc_kinds`` of ``MPI_COMM_WORLD``: CUDA-aware when
   it lists ``cuda`` or ``cuda:device``.
5. Nothing said so: not CUDA-aware (staging is always correct).

A "yes" does not cover every call: which kinds of call take device pointers depends on the
MPI (`OPERATIONS`, `vendor_scope`). Open MPI documents CUDA-aware point-to-point and
blocking collectives; its non-blocking collectives take device buffers only in some builds
(with UCC, for example), so they are staged unless declared with
``MPITENSOR_CUDA_AWARE=all`` (or ``cuda_aware="all"``). MPICH's GPU support lies beneath
every operation, non-blocking collectives included, and so does an MPI 4.1
``mpi_memory_alloc_kinds`` that lists CUDA device memory (the standard makes a memory kind
valid for every operation). Any other MPI: point-to-point and blocking collectives.

`decide` is that table as a pure function; `detect` feeds it what this process sees.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Literal

from ..._core.mpi import MPI

__all__ = [
    "BLOCKING",
    "DOCUMENTED",
    "ENV_VARIABLE",
    "EVERY",
    "NONBLOCKING",
    "OPERATIONS",
    "P2P",
    "CudaAwareness",
    "Declaration",
    "LibraryAnswer",
    "decide",
    "detect",
    "kinds_support_cuda",
    "parse_override",
    "query_info_kinds",
    "query_library",
    "vendor_scope",
]

ENV_VARIABLE = "MPITENSOR_CUDA_AWARE"

# MPICH's mpi.h: #define MPIX_GPU_SUPPORT_CUDA (0)
_MPIX_GPU_SUPPORT_CUDA = 0

# The kinds of call, as far as device buffers go.
P2P = "p2p"  # send and receive, blocking or not
BLOCKING = "blocking"  # blocking collectives (MPI_Allreduce, MPI_Bcast, ...)
NONBLOCKING = "nonblocking"  # non-blocking collectives (MPI_Iallreduce, ...): what mpitensor posts
OPERATIONS = (P2P, BLOCKING, NONBLOCKING)
EVERY = frozenset(OPERATIONS)
DOCUMENTED = frozenset({P2P, BLOCKING})

# What each MPI documents as taking device buffers once it is CUDA-aware (see the module's
# docstring); an MPI not listed gets DOCUMENTED.
_VENDOR_SCOPES = {"MPICH": EVERY, "Open MPI": DOCUMENTED}

# A declaration: True (the MPI's documented scope), "all" (every kind of call), False, None.
Declaration = bool | Literal["all"] | None

_ALL_WORDS = frozenset({"all"})
_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})
_AUTO_WORDS = frozenset({"", "auto", "detect"})


@dataclass(frozen=True)
class CudaAwareness:
    """The decision: may device buffers go to MPI, and who said so.

    Attributes:
        aware: True if MPI takes CUDA device buffers directly (for some kinds of call).
        source: what decided: ``"config"``, ``"environment"``, ``"library"``,
            ``"info"`` or ``"default"``.
        detail: a sentence saying why, for ``python -m mpitensor info`` and errors.
        scope: the kinds of call (`OPERATIONS`) that take device buffers; empty when not
            aware, every kind when not given.
    """

    aware: bool
    source: str
    detail: str
    scope: frozenset[str] = field(default=EVERY)

    def __post_init__(self) -> None:
        if not self.aware:
            object.__setattr__(self, "scope", frozenset())

    def takes(self, operation: str) -> bool:
        """Whether a call of kind `operation` (`P2P`, `BLOCKING`, `NONBLOCKING`) may get device buffers."""
        return operation in self.scope

    @property
    def path(self) -> str:
        """The data path of GPU tensors, e.g. ``"cuda-aware"``, ``"staged"``.

        When only some kinds of call take device buffers, it names them:
        ``"cuda-aware p2p,blocking"``.
        """
        if not self.aware:
            return "staged"
        if self.scope == EVERY:
            return "cuda-aware"
        return "cuda-aware " + ",".join(op for op in OPERATIONS if op in self.scope)


def vendor_scope(vendor: str) -> frozenset[str]:
    """The kinds of call a CUDA-aware MPI of `vendor` documents for device buffers.

    Args:
        vendor: the MPI's name as ``MPI.get_vendor()`` gives it (``"Open MPI"``, ``"MPICH"``).

    Returns:
        Every kind for MPICH; point-to-point and blocking collectives for Open MPI and any
        other MPI.
    """
    return _VENDOR_SCOPES.get(vendor, DOCUMENTED)


@dataclass(frozen=True)
class LibraryAnswer:
    """What the MPI library itself said about CUDA support.

    Attributes:
        supported: True or False as the library answered; None when it could not be
            asked (no such extension, library not found, MPI not initialized).
        detail: which function answered and what it returned, or why none did.
    """

    supported: bool | None
    detail: str


def parse_override(raw: str | None) -> Declaration:
    """Read the value of ``MPITENSOR_CUDA_AWARE``.

    Args:
        raw: the variable's value, or None when it is not set.

    Returns:
        True for ``1``/``true``/``yes``/``on`` (the calls the MPI documents), ``"all"`` for
        ``all`` (every kind of call, non-blocking collectives included), False for
        ``0``/``false``/``no``/``off``, None (detect) when unset, empty, ``auto`` or
        ``detect``. Case is ignored.

    Raises:
        ValueError: any other value.
    """
    if raw is None:
        return None
    word = raw.strip().lower()
    if word in _AUTO_WORDS:
        return None
    if word in _ALL_WORDS:
        return "all"
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise ValueError(
        f"{ENV_VARIABLE} must be 1 (MPI takes CUDA buffers where it documents them), all (in "
        f"every call), 0 (stage them through host memory) or auto (detect), got {raw!r}"
    )


def kinds_support_cuda(kinds: str | None) -> bool | None:
    """Read the MPI 4.1 info value ``mpi_memory_alloc_kinds``.

    Args:
        kinds: the value, a comma-separated list such as ``"mpi,system,cuda:device"``,
            or None when the key is absent.

    Returns:
        None when `kinds` is None; else True if it lists ``cuda`` (every CUDA memory
        kind) or ``cuda:device`` (device memory, what CuPy allocates), False otherwise
        (``cuda:host`` or ``cuda:managed`` alone do not cover device memory).
    """
    if kinds is None:
        return None
    for entry in kinds.split(","):
        name, _, restrictors = entry.strip().lower().partition(":")
        if name != "cuda":
            continue
        if not restrictors or "device" in (r.strip() for r in restrictors.split(":")):
            return True
    return False


def decide(
    declared: Declaration,
    override: Declaration,
    library: LibraryAnswer | None,
    kinds: str | None,
    vendor: str = "",
) -> CudaAwareness:
    """The decision table (see the module's docstring), as a pure function.

    Args:
        declared: ``DistributedConfig.cuda_aware``.
        override: the parsed ``MPITENSOR_CUDA_AWARE`` (see `parse_override`).
        library: what the MPI library answered (see `query_library`), or None.
        kinds: the ``mpi_memory_alloc_kinds`` info value, or None when absent.
        vendor: the MPI's name (``MPI.get_vendor()``), for which calls a "yes" covers.

    Returns:
        The decision, its reason and its scope.
    """
    documented = vendor_scope(vendor)
    if declared is not None:
        return _declared(declared, "config", f"DistributedConfig(cuda_aware={declared!r})", documented)
    if override is not None:
        value = "all" if override == "all" else int(override)
        return _declared(override, "environment", f"{ENV_VARIABLE}={value}", documented)
    if library is not None and library.supported is not None:
        return CudaAwareness(library.supported, "library", library.detail, documented)
    from_kinds = kinds_support_cuda(kinds)
    if from_kinds:
        return CudaAwareness(True, "info", f"mpi_memory_alloc_kinds={kinds!r} lists CUDA device memory", EVERY)
    said = [library.detail] if library is not None else []
    if kinds is not None:
        said.append(f"mpi_memory_alloc_kinds={kinds!r} lists no CUDA device memory")
    else:
        said.append("no mpi_memory_alloc_kinds info key")
    return CudaAwareness(False, "default", "not detected (" + "; ".join(said) + ")")


def _declared(value: Declaration, source: str, detail: str, documented: frozenset[str]) -> CudaAwareness:
    """A declaration's decision: ``"all"`` covers every call, True what the MPI documents."""
    if value == "all":
        return CudaAwareness(True, source, detail, EVERY)
    return CudaAwareness(bool(value), source, detail, documented)


# -- asking this process's MPI ------------------------------------------------------------

_lock = threading.Lock()
_library_answer: LibraryAnswer | None = None


def _loaded_mpi_libraries() -> list[str]:
    """Paths of the MPI libraries mapped into this process (Linux), most likely first."""
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                path = fields[5].strip() if len(fields) == 6 else ""
                name = os.path.basename(path)
                if name.startswith(("libmpi.so", "libmpi_", "libmpich")) and ".so" in name and path not in found:
                    found.append(path)
    except OSError:
        return []
    # The library that defines MPI itself (libmpi.so.N) before its helpers.
    found.sort(key=lambda p: 0 if os.path.basename(p).startswith("libmpi.so") else 1)
    return found


def _open_loaded(path: str | None) -> ctypes.CDLL | None:
    # RTLD_NOLOAD: only ever reach a library already loaded, never load a second MPI.
    mode = getattr(os, "RTLD_NOLOAD", 0) | getattr(os, "RTLD_LAZY", 1)
    try:
        return ctypes.CDLL(path, mode=mode)
    except OSError:
        return None


def _ask(library: ctypes.CDLL, where: str) -> LibraryAnswer | None:
    query = getattr(library, "MPIX_GPU_query_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        flag = ctypes.c_int(0)
        if query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
            value = flag.value != 0
            return LibraryAnswer(value, f"MPIX_GPU_query_support(CUDA) in {where} says {int(value)}")
    query = getattr(library, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        query.argtypes = []
        value = query() != 0
        return LibraryAnswer(value, f"MPIX_Query_cuda_support() in {where} returned {int(value)}")
    return None


def query_library() -> LibraryAnswer:
    """Ask the loaded MPI library whether it supports CUDA device buffers.

    Only after ``MPI_Init`` (MPICH answers from its initialized state). The answer is
    cached for the process.

    Returns:
        The answer; ``supported`` is None when no query function could be reached.
    """
    global _library_answer
    with _lock:
        if _library_answer is not None:
            return _library_answer
        if not MPI.Is_initialized() or MPI.Is_finalized():
            return LibraryAnswer(None, "MPI is not initialized, so the library was not asked")
        answer = None
        candidates: list[str | None] = [*_loaded_mpi_libraries(), None]
        for path in candidates:
            library = _open_loaded(path)
            if library is None:
                continue
            try:
                answer = _ask(library, os.path.basename(path) if path else "the process")
            except Exception as exc:  # a broken extension must not stop the program
                answer = LibraryAnswer(None, f"asking {path or 'the process'} failed: {exc}")
            if answer is not None:
                break
        if answer is None:
            where = "Linux" if sys.platform.startswith("linux") else sys.platform
            answer = LibraryAnswer(
                None, f"the MPI library has no MPIX CUDA query (or could not be found on {where})"
            )
        _library_answer = answer
        return answer


def query_info_kinds() -> str | None:
    """The ``mpi_memory_alloc_kinds`` info value of ``MPI_COMM_WORLD`` (MPI 4.1), or None."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return None
    try:
        info = MPI.COMM_WORLD.Get_info()
    except MPI.Exception:
        return None
    try:
        return info.Get("mpi_memory_alloc_kinds")
    finally:
        info.Free()


def detect(declared: Declaration = None, environ: dict[str, str] | None = None) -> CudaAwareness:
    """Decide for this process: the declaration, the environment, then MPI's own answers.

    The library is asked only when neither the declaration nor the environment decides.

    Args:
        declared: ``DistributedConfig.cuda_aware``.
        environ: the environment to read ``MPITENSOR_CUDA_AWARE`` from (default: this
            process's).

    Returns:
        The decision and its reason.

    Raises:
        ValueError: ``MPITENSOR_CUDA_AWARE`` has a value that is not 0, 1 or auto.
    """
    env = os.environ if environ is None else environ
    override = parse_override(env.get(ENV_VARIABLE))
    vendor = MPI.get_vendor()[0]
    if declared is not None or override is not None:
        return decide(declared, override, None, None, vendor)
    return decide(None, None, query_library(), query_info_kinds(), vendor)
