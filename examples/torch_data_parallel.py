"""Data-parallel training of a small CNN on scikit-learn's digits with PyTorch and mpitensor.

The training loop is PyTorch's own: the model is wrapped in `mpitensor.torch.DataParallel`
(the drop-in for ``DistributedDataParallel``), and nothing else changes. Every rank trains
on its shard of each global mini-batch; gradients are averaged across ranks in buckets
while backward still runs. At the end, rank 0 trains the same model in a single process on
the full batches and compares the weights: they must agree to round-off.

Run it with ``mpiexec -n 4 python examples/torch_data_parallel.py`` (or ``make demo-torch``).
The exit status is non-zero if the data-parallel and single-process weights disagree.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from sklearn.datasets import load_digits

import mpitensor as mt
from mpitensor.torch import DataParallel

Data = tuple[torch.Tensor, torch.Tensor]


def load_data() -> tuple[Data, Data]:
    """The digits as 1x8x8 float64 images in [0, 1], split 80/20 into train and test."""
    digits = load_digits()
    x = torch.from_numpy(digits.images / 16.0).unsqueeze(1)
    y = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(x)))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return (x[:split], y[:split]), (x[split:], y[split:])


def make_cnn() -> torch.nn.Module:
    """Two 3x3 convolutions, a pooling and two dense layers; float64 so runs compare closely."""
    torch.manual_seed(42)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(16 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    ).double()


def batches(n: int, batch: int, epoch: int) -> list[torch.Tensor]:
    """The global mini-batches of one epoch (the same on every rank)."""
    order = torch.from_numpy(np.random.default_rng(1000 + epoch).permutation(n))
    return [order[i : i + batch] for i in range(0, n, batch)]


def train(
    model: torch.nn.Module,
    data: Data,
    epochs: int,
    batch: int,
    lr: float,
    rows: Callable[[torch.Tensor], torch.Tensor],
    scale: float,
    on_epoch: Callable[[int, float], None] | None = None,
) -> None:
    """SGD with momentum. Each step takes `rows(indices)` of the global batch `indices`; its loss is
    the cross-entropy summed over them, times ``scale / len(indices)`` (with DataParallel's
    average over ranks, every step follows the full batch's mean loss)."""
    x, y = data
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for epoch in range(epochs):
        total = 0.0
        for indices in batches(len(x), batch, epoch):
            mine = rows(indices)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[mine]), y[mine], reduction="sum")
            (loss * (scale / len(indices))).backward()
            opt.step()
            total += loss.item()
        if on_epoch is not None:
            on_epoch(epoch, total)


def main(argv: list[str] | None = None) -> int:
    """Train data-parallel, compare with a single process; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128, help="global mini-batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--bucket-bytes", type=int, default=16384, help="DataParallel bucket size")
    parser.add_argument("--tolerance", type=float, default=1e-9)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # ranks share the machine's cores
    train_data, (x_test, y_test) = load_data()

    with mt.DistributedContext.init() as ctx:
        rank, size = ctx.rank, ctx.size
        model = DataParallel(make_cnn(), bucket_bytes=args.bucket_bytes)  # rank 0's weights everywhere
        initial = copy.deepcopy(model.module)

        def report(epoch: int, loss: float) -> None:
            with torch.no_grad():
                mine = slice(rank, None, size)
                correct = (model(x_test[mine]).argmax(dim=1) == y_test[mine]).sum().item()
            total_loss, total_correct = mt.all_reduce([np.array(loss), np.array(float(correct))]).resolve()
            if rank == 0:
                print(f"epoch {epoch + 1:3d}/{args.epochs}  loss {total_loss.item() / len(train_data[0]):.4f}  "
                      f"test accuracy {100 * total_correct.item() / len(x_test):5.1f}%", flush=True)

        began = time.perf_counter()
        train(model, train_data, args.epochs, args.batch, args.lr, lambda i: i[rank::size], size, report)
        seconds = time.perf_counter() - began

        ok = True
        if rank == 0:
            train(initial, train_data, args.epochs, args.batch, args.lr, lambda i: i, 1.0)
            pairs = list(zip(model.module.parameters(), initial.parameters()))
            diff = max((a - b).abs().max().item() for a, b in pairs)
            scale = max(b.abs().max().item() for _, b in pairs)
            ok = diff <= args.tolerance * max(scale, 1.0)
            print(f"{size} rank(s), {args.epochs} epochs in {seconds:.2f} s", flush=True)
            print(f"largest difference between data-parallel and single-process weights: {diff:.3e} "
                  f"({'round-off level: they agree' if ok else 'THEY DISAGREE'})", flush=True)
        ok = bool(mt.broadcast(np.array(ok), root=0).resolve().item())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
