"""`ReduceOperation` and `DistributedConfig`: the settings a context runs with."""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass
from typing import Literal

__all__ = ["DistributedConfig", "ReduceOperation", "compiled_parts_off", "parse_op"]

_MIB = 1 << 20


class ReduceOperation(enum.Enum):
    """How a reducing collective combines the ranks' tensors, element by element.

    `SUM` and `MEAN` are Burn's; `MAX`, `MIN` and `PROD` go beyond it. On `bool` tensors
    `SUM` and `MAX` are logical or, `PROD` and `MIN` logical and (NumPy's rules).
    `MEAN` of integer or `bool` tensors gives `float64`, as `numpy.mean` does.
    `BAND`, `BOR` and `BXOR` are bitwise and, or and exclusive or, for integer and `bool`
    tensors only (on `bool`, logical and, or and exclusive or); other dtypes raise `TypeError`.
    """

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"


_ALIASES = {"avg": "mean", "average": "mean"}


def compiled_parts_off() -> bool:
    """Whether ``MPITENSOR_NATIVE=0`` switches the compiled parts off (the compiled lane, the streaming sum)."""
    return os.environ.get("MPITENSOR_NATIVE", "").strip() == "0"


def parse_op(op: ReduceOperation | str) -> ReduceOperation:
    """Return `op` as a `ReduceOperation`; names such as ``"sum"`` are accepted too.

    Names are case-insensitive; ``"avg"`` and ``"average"`` (torch's and Horovod's names)
    mean `ReduceOperation.MEAN`.

    Raises:
        TypeError: `op` is neither a `ReduceOperation` nor a string.
        ValueError: `op` is a string that names no operation.
    """
    # Names already seen are looked up at once: an Enum lookup by value runs Python code,
    # and ``all_reduce(x, "sum")`` is on the path of the smallest messages.
    known = _BY_NAME.get(op) if type(op) is str else None
    if known is not None:
        return known
    if isinstance(op, ReduceOperation):
        return op
    if isinstance(op, str):
        name = op.lower()
        try:
            parsed = ReduceOperation(_ALIASES.get(name, name))
        except ValueError:
            names = ", ".join(m.name for m in ReduceOperation)
            raise ValueError(f"unknown reduce operation {op!r}; expected one of {names} (or AVG for MEAN)") from None
        if len(_BY_NAME) < 256:  # bounded: only names that parse are kept
            _BY_NAME[op] = parsed
        return parsed
    raise TypeError(f"op must be a ReduceOperation (or its name), got {type(op).__name__}")


_BY_NAME: dict[str, ReduceOperation] = {}


@dataclass(frozen=True)
class DistributedConfig:
    """Settings of a `DistributedContext` (immutable).

    Args:
        all_reduce_op: the operation `all_reduce` (and `reduce`, `reduce_scatter`) use
            when called with ``op=None``.
        check: run the cross-rank consistency check before every collective, so ranks
            that disagree on shape, dtype, op, root or group get `CollectiveMismatchError`
            instead of a hang or garbage. Costs one small all-reduce per collective.
            With ``check=False``, ranks that disagree get whatever MPI does: wrong data,
            a hang, or a crash of the whole job (a double free or segmentation fault
            inside MPI, seen with lengths 4096 against 4).
        timeout: seconds `CollectiveTensor.resolve()` (and `close()`) wait when given no
            timeout of their own; ``None`` reads ``MPITENSOR_TIMEOUT`` and otherwise waits
            forever. After a timeout the context is broken (MPI cannot cancel).
        check_grace: seconds a collective call waits for the consistency check before
            returning with the check still pending (it then completes in `resolve()`).
        bucket_bytes: the size of the buckets the fused all-reduce and `GradientSync`
            pack tensors into (near PyTorch DDP's 25 MiB by default).
        progress: drive communication from a background thread so that it advances
            while the program computes; ``None`` (or ``MPITENSOR_PROGRESS=0|1``) turns it on
            where MPI provides ``MPI_THREAD_MULTIPLE`` and it can help: the node has a core
            to spare beyond one per rank, or the ranks compute on GPUs.
        device: force the kind of device every rank uses, ``"cpu"`` or ``"cuda"``;
            ``None`` picks CUDA when GPUs are visible and CuPy is installed.
        cuda_aware: declare whether MPI accepts GPU buffers: True in the calls the MPI
            documents (Open MPI: point-to-point and blocking collectives), ``"all"`` in
            every call, False in none; ``None`` detects it (and honours
            ``MPITENSOR_CUDA_AWARE=0|1|all``).
        shared_memory: use the shared-memory all-reduce among the ranks of a node for
            large messages; ``None`` decides by size and topology.
        fail_fast: while a context is open, an exception that escapes on any rank prints
            its traceback (prefixed with the rank) and aborts the whole job.
        trace: record a timeline of every collective and `trace_region` and, when the
            context closes, write it to this path as one Chrome/Perfetto trace of every
            rank (``python -m mpitensor trace PATH`` reports who made the others wait).
            ``None`` reads ``MPITENSOR_TRACE``; an empty path (here or there) means no tracing.
        trace_events: collectives (and as many regions) each rank keeps, the last ones;
            0 keeps the whole run.
        on_rank_failure: what the surviving ranks get when a rank dies (its process ends
            without closing the context). ``"abort"``: the job ends (fail-fast). ``"raise"``:
            on an MPI with fault tolerance (Open MPI launched with ``mpiexec --with-ft
            ulfm``), every survivor's pending and next collective raises `RankFailedError`
            naming the dead ranks, and ``ctx.shrink()`` gives a context of the survivors;
            the shared-memory all-reduce is then not used (MPI's own transports detect a
            dead peer, it could not). On an MPI without it, the context warns at open and
            the job stays fail-fast. See docs/failures.md.

    Raises:
        ValueError: a setting is out of range.
    """

    all_reduce_op: ReduceOperation = ReduceOperation.SUM
    check: bool = True
    timeout: float | None = None
    check_grace: float = 1.0
    bucket_bytes: int = 25 * _MIB
    progress: bool | None = None
    device: Literal["cpu", "cuda"] | None = None
    cuda_aware: bool | Literal["all"] | None = None
    shared_memory: bool | None = None
    fail_fast: bool = True
    trace: str | os.PathLike[str] | None = None
    trace_events: int = 16384
    on_rank_failure: Literal["abort", "raise"] = "abort"

    def __post_init__(self) -> None:
        object.__setattr__(self, "all_reduce_op", parse_op(self.all_reduce_op))
        if self.timeout is not None and not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise ValueError(f"timeout must be a positive number of seconds or None, got {self.timeout!r}")
        if not self.check_grace >= 0:
            raise ValueError(f"check_grace must be >= 0 seconds, got {self.check_grace!r}")
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or self.bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu', 'cuda' or None, got {self.device!r}")
        if not (self.cuda_aware is None or isinstance(self.cuda_aware, bool) or self.cuda_aware == "all"):
            raise ValueError(f"cuda_aware must be True, False, 'all' or None, got {self.cuda_aware!r}")
        if not (self.trace is None or isinstance(self.trace, (str, os.PathLike))):
            raise ValueError(f"trace must be a file path or None, got {self.trace!r}")
        events = self.trace_events
        if isinstance(events, bool) or not isinstance(events, int) or not 0 <= events <= 1 << 32:
            raise ValueError(f"trace_events must be an int from 0 (keep every event) to 2**32, got {events!r}")
        if self.on_rank_failure not in ("abort", "raise"):
            raise ValueError(f"on_rank_failure must be 'abort' or 'raise', got {self.on_rank_failure!r}")

    def resolved_trace(self) -> str | None:
        """The trace file in force: `trace`, else ``MPITENSOR_TRACE``; None for no tracing (also for an empty path)."""
        if self.trace is not None:
            return os.fspath(self.trace) or None
        return os.environ.get("MPITENSOR_TRACE", "").strip() or None

    def resolved_timeout(self) -> float | None:
        """The timeout in force: `timeout`, else ``MPITENSOR_TIMEOUT``, else ``None``.

        Raises:
            ValueError: ``MPITENSOR_TIMEOUT`` is set but not a positive number.
        """
        if self.timeout is not None:
            return self.timeout
        raw = os.environ.get("MPITENSOR_TIMEOUT", "").strip()
        if not raw:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"MPITENSOR_TIMEOUT must be a positive number of seconds, got {raw!r}")
        return value
