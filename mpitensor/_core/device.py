"""`Device`, node-local rank detection, and the mapping from local rank to GPU.

Each rank owns one device. A rank's GPU is ``local_rank % visible_gpus``: ranks on one node
share the node's visible GPUs round robin (several ranks per GPU is allowed).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

from .errors import DeviceError

__all__ = [
    "Device",
    "LOCAL_RANK_VARIABLES",
    "choose_device",
    "gpu_for_local_rank",
    "local_rank_from_env",
    "plan_device",
    "probe_gpus",
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

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, Device):
            return NotImplemented
        return _order(self) < _order(other)

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


def _order(device: Device) -> tuple[int, str, int]:
    """What devices sort by: rank (none first), kind, index."""
    return (-1 if device.rank is None else device.rank, device.kind, device.index)


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
    return probe_gpus()[0]


def probe_gpus() -> tuple[int, str | None]:
    """Count the CUDA GPUs this process sees, and say why when there are none.

    Returns:
        ``(count, reason)``: `reason` is None when a GPU is visible, else a short phrase
        (CuPy missing, ``CUDA_VISIBLE_DEVICES`` empty, the CUDA runtime's error).
    """
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0, "CUDA_VISIBLE_DEVICES is empty, which hides every GPU"
    if importlib.util.find_spec("cupy") is None:
        return 0, "CuPy is not installed"
    return _probe_cuda()


@functools.cache
def _probe_cuda() -> tuple[int, str | None]:
    # CUDA reads CUDA_VISIBLE_DEVICES once, when it initializes, so the count is fixed for
    # the life of the process and one query is enough.
    try:
        import cupy

        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return 0, f"the CUDA runtime reports: {exc}"
    return count, None if count > 0 else "the CUDA runtime reports no device"


def _visible_devices_note(environ: dict[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    value = env.get("CUDA_VISIBLE_DEVICES")
    return "CUDA_VISIBLE_DEVICES is not set" if value is None else f"CUDA_VISIBLE_DEVICES={value!r}"


def plan_device(
    local_rank: int,
    visible_gpus: int,
    *,
    kind: str | None = None,
    index: int | None = None,
    cupy_installed: bool = True,
    rank: int | None = None,
    reason: str | None = None,
    environ: dict[str, str] | None = None,
) -> tuple[str, int]:
    """Decide a rank's device from what it asked for and what it sees (no side effects).

    Without a request, a rank uses GPU ``local_rank % visible_gpus`` when CuPy is installed
    and a GPU is visible, else its CPU. Several ranks may share a GPU.

    Args:
        local_rank: the rank's number among the ranks of its node.
        visible_gpus: how many GPUs the rank sees (after ``CUDA_VISIBLE_DEVICES``).
        kind: ``"cpu"`` or ``"cuda"`` to force a kind (``DistributedConfig.device`` or a
            `Device` passed to init), None to choose.
        index: the GPU the rank was given (a `Device` passed to init), None to map it
            from the local rank.
        cupy_installed: whether CuPy can be imported.
        rank: the rank, for messages.
        reason: why no GPU is visible (from `probe_gpus`), for messages.
        environ: the environment to quote ``CUDA_VISIBLE_DEVICES`` from (default: this
            process's).

    Returns:
        ``(kind, index)``: ``("cpu", 0)`` or ``("cuda", i)``.

    Raises:
        DeviceError: a GPU was asked for, and CuPy is missing, no GPU is visible, or the
            GPU given does not exist here.
        ValueError: `local_rank` or `index` is negative, or `kind` is unknown.
    """
    if kind not in (None, "cpu", "cuda"):
        raise ValueError(f"device kind must be 'cpu', 'cuda' or None, got {kind!r}")
    if local_rank < 0:
        raise ValueError(f"local rank must be >= 0, got {local_rank}")
    if kind is None:
        kind = "cuda" if cupy_installed and visible_gpus > 0 else "cpu"
    if kind == "cpu":
        return "cpu", 0
    who = "this rank" if rank is None else f"rank {rank}"
    _require_gpu(who, index, visible_gpus, cupy_installed, reason, environ)
    if index is None:
        return "cuda", local_rank % visible_gpus
    return "cuda", _given_gpu(who, index, visible_gpus, environ)


def _require_gpu(
    who: str,
    index: int | None,
    visible_gpus: int,
    cupy_installed: bool,
    reason: str | None,
    environ: dict[str, str] | None,
) -> None:
    """Raise `DeviceError` when a GPU was asked for and CuPy is missing or no GPU is visible."""
    asked = "a CUDA device" if index is None else f"device cuda:{index}"
    if not cupy_installed:
        raise DeviceError(
            f"{who} was asked for {asked}, but CuPy is not installed: pip install 'mpitensor[cuda]' "
            "(CuPy for CUDA 12; 'mpitensor[cuda11]' or 'mpitensor[cuda13]' for other CUDA major "
            "versions), or run on the CPU with DistributedConfig(device='cpu')"
        )
    if visible_gpus <= 0:
        why = f" ({reason})" if reason else ""
        raise DeviceError(
            f"{who} was asked for {asked}, but it sees no CUDA GPU{why}; "
            f"{_visible_devices_note(environ)}. Check the job's GPU allocation, or run on the "
            "CPU with DistributedConfig(device='cpu')"
        )


def _given_gpu(who: str, index: int, visible_gpus: int, environ: dict[str, str] | None) -> int:
    """`index`, the GPU a rank was given, once it is known to exist among the visible ones.

    Raises:
        ValueError: `index` is negative.
        DeviceError: `index` is not below `visible_gpus`.
    """
    if index < 0:
        raise ValueError(f"GPU index must be >= 0, got {index}")
    if index >= visible_gpus:
        raise DeviceError(
            f"{who} was given device cuda:{index}, but it sees {visible_gpus} CUDA GPU(s), "
            f"cuda:0 to cuda:{visible_gpus - 1} ({_visible_devices_note(environ)})"
        )
    return index


def choose_device(
    local_rank: int,
    rank: int,
    *,
    kind: str | None = None,
    index: int | None = None,
) -> Device:
    """This rank's device: `plan_device` applied to what this process sees.

    Args:
        local_rank: the rank's number among the ranks of its node.
        rank: the rank (in ``MPI_COMM_WORLD``) that will own the device.
        kind: ``"cpu"`` or ``"cuda"`` to force a kind, None to choose.
        index: the GPU the rank was given, None to map it from the local rank.

    Returns:
        The device, owned by `rank`.

    Raises:
        DeviceError: a GPU was asked for that this rank does not have (or CuPy is missing).
    """
    cupy_installed = importlib.util.find_spec("cupy") is not None
    # Probing imports CuPy; skip it when the CPU is forced.
    count, reason = probe_gpus() if kind != "cpu" else (0, None)
    chosen_kind, chosen_index = plan_device(
        local_rank,
        count,
        kind=kind,
        index=index,
        cupy_installed=cupy_installed,
        rank=rank,
        reason=reason,
    )
    return Device(chosen_kind, chosen_index, rank)
