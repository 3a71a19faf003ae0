"""Data-parallel training of a small MLP on scikit-learn's handwritten digits, with mpitensor.

Every rank holds the same model and trains on its own shard of each global mini-batch.
Gradients are averaged across ranks with `mpitensor.GradientSync`: the last layer's
gradients are submitted first and their all-reduce starts at once, overlapping the
backward pass of the first layer. At the end, rank 0 trains the same model in a single
process on the full batches and compares the weights: they must agree to round-off.

Run it with ``mpiexec -n 4 python examples/data_parallel.py`` (or ``make demo``). The
exit status is non-zero if the data-parallel and single-process weights disagree.

``--trace PATH`` records a timeline of every rank's collectives and phases (data,
backward, update) into PATH; ``--slow-rank R`` makes rank R's data loading slower by
``--slow-ms`` each step, the straggler ``python -m mpitensor trace PATH`` then names
(``make demo TRACE=trace.json SLOW_RANK=3``).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np
from sklearn.datasets import load_digits

import mpitensor as mt

Params = dict[str, np.ndarray]
Grads = Iterator[tuple[str, np.ndarray]]


def load_data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The digits (1797 8x8 images, scaled to [0, 1]), split 80/20 into train and test."""
    digits = load_digits()
    x = digits.data.astype(np.float64) / 16.0
    y = digits.target.astype(np.int64)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def init_params(seed: int, hidden: int) -> Params:
    """Small random weights, in forward order (the order GradientSync registers)."""
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.normal(0.0, 0.125, (64, hidden)),
        "b1": np.zeros(hidden),
        "w2": rng.normal(0.0, 0.125, (hidden, 10)),
        "b2": np.zeros(10),
    }


def forward(p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hidden activations and class probabilities."""
    h = np.tanh(x @ p["w1"] + p["b1"])
    logits = h @ p["w2"] + p["b2"]
    logits -= logits.max(axis=1, keepdims=True)
    e = np.exp(logits)
    return h, e / e.sum(axis=1, keepdims=True)


def backward(p: Params, x: np.ndarray, y: np.ndarray, scale: float, losses: list[float]) -> Grads:
    """Yield (name, gradient) in the order backward produces them, last layer first.

    Gradients are sums over the rows of `x`, times `scale`; the cross-entropy summed over
    the rows is appended to `losses`.
    """
    h, probs = forward(p, x)
    losses.append(float(-np.log(probs[np.arange(len(y)), y] + 1e-300).sum()))
    d = probs
    d[np.arange(len(y)), y] -= 1.0
    d *= scale
    yield "b2", d.sum(axis=0)
    yield "w2", h.T @ d
    # The all-reduce of the layer above is in flight while this runs.
    dh = (d @ p["w2"].T) * (1.0 - h * h)
    yield "b1", dh.sum(axis=0)
    yield "w1", x.T @ dh


def batches(n: int, batch: int, epoch: int) -> list[np.ndarray]:
    """The global mini-batches of one epoch (the same on every rank)."""
    order = np.random.default_rng(1000 + epoch).permutation(n)
    return [order[i : i + batch] for i in range(0, n, batch)]


def train(
    p: Params,
    x: np.ndarray,
    y: np.ndarray,
    epochs: int,
    batch: int,
    lr: float,
    step_grads: Callable[[Params, np.ndarray, list[float]], Params],
    on_epoch: Callable[[int, float, Params], None] | None = None,
) -> Params:
    """Plain SGD; `step_grads` turns one global batch into the averaged gradients."""
    for epoch in range(epochs):
        losses: list[float] = []
        for indices in batches(len(x), batch, epoch):
            grads = step_grads(p, indices, losses)
            for name in p:
                p[name] -= lr * grads[name]
        if on_epoch is not None:
            on_epoch(epoch, sum(losses), p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Train data-parallel, compare with a single process; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=128, help="global mini-batch size")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--bucket-bytes", type=int, default=4096, help="GradientSync bucket size")
    parser.add_argument("--tolerance", type=float, default=1e-9)
    parser.add_argument("--trace", default=None, help="write a timeline of every rank here")
    parser.add_argument("--slow-rank", type=int, default=None, help="a rank whose data loading is slower")
    parser.add_argument("--slow-ms", type=float, default=5.0, help="how much slower, per step (5 ms)")
    args = parser.parse_args(argv)
    x_train, y_train, x_test, y_test = load_data()

    with mt.DistributedContext.init(config=mt.DistributedConfig(trace=args.trace)) as ctx:
        rank, size = ctx.rank, ctx.size
        # Rank 0's initial weights go to everyone, so all replicas start identical.
        start = init_params(seed=42, hidden=args.hidden) if rank == 0 else None
        shapes = {name: (w.shape, w.dtype) for name, w in init_params(42, args.hidden).items()}
        params = {
            name: mt.broadcast(start[name] if start else None, root=0, shape=shape, dtype=dtype).resolve().numpy()
            for name, (shape, dtype) in shapes.items()
        }
        initial = {name: w.copy() for name, w in params.items()}
        sync = mt.GradientSync(shapes, op=mt.ReduceOperation.MEAN, bucket_bytes=args.bucket_bytes)
        my_test = np.arange(len(x_test))[rank::size]

        def data_parallel_step(p: Params, indices: np.ndarray, losses: list[float]) -> Params:
            with mt.trace_region("data"):
                mine = indices[rank::size]
                if rank == args.slow_rank:
                    time.sleep(args.slow_ms / 1000)  # a slow loader, a busy node
                x, y = x_train[mine], y_train[mine]
            # Sums over this shard, scaled so that the MEAN over ranks is the batch mean.
            with mt.trace_region("backward"):
                for name, grad in backward(p, x, y, size / len(indices), losses):
                    sync.submit(name, grad)
                return {name: g.numpy() for name, g in sync.wait().items()}

        def report(epoch: int, loss: float, p: Params) -> None:
            _, probs = forward(p, x_test[my_test])
            correct = float((probs.argmax(axis=1) == y_test[my_test]).sum())
            total_loss, total_correct = mt.all_reduce([np.array(loss), np.array(correct)]).resolve()
            if rank == 0:
                print(
                    f"epoch {epoch + 1:3d}/{args.epochs}  loss {total_loss.item() / len(x_train):.4f}  "
                    f"test accuracy {100 * total_correct.item() / len(x_test):5.1f}%",
                    flush=True,
                )

        began = time.perf_counter()
        trained = train(params, x_train, y_train, args.epochs, args.batch, args.lr, data_parallel_step, report)
        seconds = time.perf_counter() - began

        ok = True
        if rank == 0:
            def single_step(p: Params, indices: np.ndarray, losses: list[float]) -> Params:
                return dict(backward(p, x_train[indices], y_train[indices], 1.0 / len(indices), losses))

            reference = train(initial, x_train, y_train, args.epochs, args.batch, args.lr, single_step)
            diff = max(float(np.max(np.abs(trained[n] - reference[n]))) for n in trained)
            scale = max(float(np.max(np.abs(reference[n]))) for n in reference)
            ok = diff <= args.tolerance * max(scale, 1.0)
            print(f"{size} rank(s), {args.epochs} epochs in {seconds:.2f} s", flush=True)
            print(
                f"largest difference between data-parallel and single-process weights: {diff:.3e} "
                f"({'round-off level: they agree' if ok else 'THEY DISAGREE'})",
                flush=True,
            )
        ok = bool(mt.broadcast(np.array(ok), root=0).resolve().item())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
