"""`Device`, node-local rank detection, and the mapping from local rank to GPU.

Each rank owns one device. A rank's GPU is ``local_rank % visible_gpus``: ranks on one node
share the node's visible GPUs round robin (several ranks per GPU is allowed).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

from ._errors import DeviceError

__all__ = [
    "Device",
    "LOCAL_RANK_VARIABLES",
    "gpu_for_local_rank",
    "local_rank_from_env",
    "visible_gpu_count",
]

_KINDS = ("cpu", "cuda")


@functools.total_ordering
@dataclass(frozen=True)
class Device:
    """One compute device, owned by one rank.

    Devices compare and sort by rank, then kind, then index, so a sorted list of a
    context's devices is in rank order.

    Args:
        kind: ``"cpu"`` or ``"cuda"``.
        index: the device number on its node (always 0 for the CPU).
        rank: the rank (in ``MPI_COMM_WORLD``) that owns the device; ``None`` means the
            calling rank, e.g. ``Device("cuda", 0)`` in ``tensor.to(...)``.

    Raises:
        ValueError: unknown kind, or a negative index or rank.
        TypeError: index or rank is not an int.
    """

    kind: str = "cpu"
    index: int = 0
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"device kind must be 'cpu' or 'cuda', got {self.kind!r}")
        for name in ("index", "rank"):
            value = getattr(self, name)
            if value is None and name == "rank":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"device {name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"device {name} must be >= 0, got {value}")
        if self.kind == "cpu" and self.index != 0:
            raise ValueError(f"a rank has one CPU device, index 0; got index {self.index}")

    def _key(self) -> tuple[int, str, int]:
        return (-1 if self.rank is None else self.rank, self.kind, self.index)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return self._key() < other._key()

    def __str__(self) -> str:
        where = "" if self.rank is None else f"@rank{self.rank}"
        return f"{self.kind}:{self.index}{where}"

    @property
    def is_cuda(self) -> bool:
        """True for a CUDA GPU."""
        return self.kind == "cuda"

    def same_place(self, other: Device) -> bool:
        """True if both name the same kind and index (ignoring an unset rank)."""
        return (
            self.kind == other.kind
            and self.index == other.index
            and (self.rank is None or other.rank is None or self.rank == other.rank)
        )


# Launcher variables, in order of trust; SLURM_LOCALID comes last because it counts tasks
# of the job step, which is not the node-local MPI rank when mpirun runs inside salloc.
LOCAL_RANK_VARIABLES = (
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "MPI_LOCALRANKID",
    "PMI_LOCAL_RANK",
    "PALS_LOCAL_RANKID",
    "SLURM_LOCALID",
)


def local_rank_from_env(environ: dict[str, str] | None = None) -> tuple[int, str] | None:
    """The node-local rank the launcher announced, and the variable it came from.

    Returns:
        ``(local_rank, variable)``, or None when no launcher variable is set.
    """
    env = os.environ if environ is None else environ
    for name in LOCAL_RANK_VARIABLES:
        raw = env.get(name, "").strip()
        if raw.isdigit():
            return int(raw), name
    return None


def gpu_for_local_rank(local_rank: int, visible_gpus: int) -> int:
    """The GPU index a rank uses: ``local_rank % visible_gpus``.

    Raises:
        DeviceError: no GPU is visible.
        ValueError: `local_rank` is negative.
    """
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, got {local_rank}")
    if visible_gpus <= 0:
        raise DeviceError(
            "no CUDA GPU is visible to this rank (check CUDA_VISIBLE_DEVICES and the "
            "job's GPU allocation), so it cannot use device kind 'cuda'"
        )
    return local_rank % visible_gpus


def visible_gpu_count() -> int:
    """How many CUDA GPUs this process sees (0 without CuPy or without a GPU).

    ``CUDA_VISIBLE_DEVICES`` is honoured by CUDA itself; an empty value hides every GPU.
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0
