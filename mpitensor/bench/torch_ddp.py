"""`mpitensor.torch.DataParallel` against torch DDP on gloo: one MLP's training steps.

Copies of the same MLP (5.8M float32 parameters by default; or pytorch/examples' mnist
CNN) train side by side on the same data, their steps interleaved (the order rotating
every step): ``local`` (no communication: the compute alone), ``ddp``
(``DistributedDataParallel`` on a gloo group), ``ddp_mt`` (DDP on the ``mpitensor``
backend) and ``mt`` (``DataParallel``). Every step starts at a barrier and is timed on every rank;
the step's time is the slowest rank's, and figures are medians over the steps. The
*exposed communication* of a variant is its backward's time minus the local backward's:
the time from the end of the gradient computation to gradients ready.

Run ``mpiexec -n 4 python -m mpitensor.bench torch``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._common import markdown_table, start_gloo, stop_gloo, text_table

__all__ = ["format_torch_ddp", "run_torch_ddp"]

VARIANTS = ("local", "ddp", "ddp_mt", "mt")


def _mlp(widths: Sequence[int]) -> Any:
    import torch

    torch.manual_seed(0)
    layers: list[Any] = []
    for width_in, width_out in itertools.pairwise(widths):
        layers += [torch.nn.Linear(width_in, width_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _cnn() -> Any:
    """pytorch/examples' mnist network (1.2M parameters)."""
    import torch

    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Dropout(0.25),
        nn.Flatten(), nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5), nn.Linear(128, 10),
    )


def _models(make: Callable[[], Any], bucket_bytes: int | None, group: Any) -> dict[str, Any]:
    import torch

    from mpitensor.torch import DataParallel

    return {
        "local": make(),
        "ddp": torch.nn.parallel.DistributedDataParallel(make()),
        "ddp_mt": torch.nn.parallel.DistributedDataParallel(make(), process_group=group),
        "mt": DataParallel(make(), bucket_bytes=bucket_bytes),
    }


def _step(model: Any, opt: Any, x: Any, y: Any, barrier: Callable[[], None]) -> tuple[float, float]:
    """One training step; its whole time and its backward's time."""
    import torch

    barrier()
    began = time.perf_counter()
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    backward = time.perf_counter()
    loss.backward()
    backward = time.perf_counter() - backward
    opt.step()
    return time.perf_counter() - began, backward


def run_torch_ddp(
    steps: int = 30,
    warmup: int = 5,
    batch: int = 32,
    widths: Sequence[int] = (784, 2048, 2048, 10),
    bucket_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
    model: str = "mlp",
) -> dict[str, Any]:
    """Time DataParallel, DDP on gloo and local steps of one MLP; every rank calls it.

    Args:
        steps: timed steps per variant.
        warmup: untimed steps first.
        batch: rows per rank and step.
        widths: the MLP's layer widths.
        bucket_bytes: DataParallel's bucket size (None: its default).
        progress: called with a line on rank 0 when the run is over.
        model: ``"mlp"`` (of `widths`) or ``"cnn"`` (pytorch/examples' mnist network on
            28x28 images).

    Returns:
        The settings and, per variant, the median step and backward seconds and the
        exposed communication; ``{"skipped": reason}`` without torch.
    """
    try:
        import torch
    except ImportError:
        return {"skipped": "torch is not installed (pip install torch)"}
    import mpitensor as mt

    with mt.DistributedContext.init() as ctx:
        dist = start_gloo(ctx.comm)
        try:
            import mpitensor.torch  # registers the backend

            group = dist.new_group(backend="mpitensor")
            make = _cnn if model == "cnn" else (lambda: _mlp(widths))
            models = _models(make, bucket_bytes, group)
            opts = {name: torch.optim.SGD(m.parameters(), lr=1e-3) for name, m in models.items()}
            gen = torch.Generator().manual_seed(ctx.rank)
            x = torch.randn((batch, 1, 28, 28) if model == "cnn" else (batch, widths[0]), generator=gen)
            y = torch.randint(0, 10 if model == "cnn" else widths[-1], (batch,), generator=gen)
            times = np.zeros((steps, len(VARIANTS), 2))
            for step in range(warmup + steps):
                for turn in range(len(VARIANTS)):
                    index = (turn + step) % len(VARIANTS)
                    name = VARIANTS[index]
                    took = _step(models[name], opts[name], x, y, ctx.comm.Barrier)
                    if step >= warmup:
                        times[step - warmup, index] = took
            slowest = mt.all_reduce(times, mt.ReduceOperation.MAX).resolve().numpy()
            params = sum(p.numel() for p in models["local"].parameters())
        finally:
            models = opts = group = {}  # DDP goes before its process group (see stop_gloo)
            stop_gloo(dist)
        result = _summarize(slowest, ctx.size, params, batch, steps)
        result["model"] = model
    if progress is not None and ctx.rank == 0:
        progress("torch: done")
    return result


def _summarize(slowest: np.ndarray, ranks: int, params: int, batch: int, steps: int) -> dict[str, Any]:
    step = np.median(slowest[:, :, 0], axis=0)
    backward = np.median(slowest[:, :, 1], axis=0)
    local = VARIANTS.index("local")
    exposed = np.median(slowest[:, :, 1] - slowest[:, [local], 1], axis=0)
    variants = {
        name: {"step_s": float(step[i]), "backward_s": float(backward[i]), "exposed_s": float(exposed[i])}
        for i, name in enumerate(VARIANTS)
    }
    return {"ranks": ranks, "params": params, "batch": batch, "steps": steps, "variants": variants,
            "mt_over_ddp": variants["mt"]["step_s"] / variants["ddp"]["step_s"],
            "ddp_mt_over_ddp": variants["ddp_mt"]["step_s"] / variants["ddp"]["step_s"],
            "ddp_mt_over_mt": variants["ddp_mt"]["step_s"] / variants["mt"]["step_s"]}


def format_torch_ddp(result: dict[str, Any], markdown: bool = True) -> str:
    """The result as a table: per variant the step, backward and exposed communication."""
    if "skipped" in result:
        return f"torch: skipped ({result['skipped']})"
    header = ["variant", "step ms", "backward ms", "exposed comm ms", "step / ddp"]
    ddp = result["variants"]["ddp"]["step_s"]
    rows = [
        [name, f"{v['step_s'] * 1e3:.1f}", f"{v['backward_s'] * 1e3:.1f}",
         "-" if name == "local" else f"{v['exposed_s'] * 1e3:.1f}", f"{v['step_s'] / ddp:.2f}"]
        for name, v in result["variants"].items()
    ]
    kind = "mnist CNN" if result.get("model") == "cnn" else "MLP"
    title = (f"DDP on gloo (ddp), DDP on mpitensor (ddp_mt), DataParallel (mt): {kind} of "
             f"{result['params'] / 1e6:.1f}M float32 parameters, "
             f"{result['ranks']} ranks, batch {result['batch']} per rank, medians of {result['steps']} steps")
    table = markdown_table(header, rows) if markdown else text_table(header, rows)
    return f"{title}\n\n{table}\n" if markdown else f"{title}\n{table}"
