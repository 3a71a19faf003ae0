"""Training that survives the loss of a rank: PyTorch DDP on mpitensor, with MPI's fault tolerance.

Every rank trains a small CNN on its share of scikit-learn's digits, in PyTorch's own
``DistributedDataParallel`` over the ``"mpitensor"`` backend, with a ``DistributedSampler``.
The context is opened with ``DistributedConfig(on_rank_failure="raise")``: when a rank dies,
every survivor's next collective raises `mpitensor.RankFailedError`. The loop catches it,
calls `mpitensor.torch.shrink_process_group()` (the default group, made again over the
survivors), reloads the state every rank kept of the epoch's start, wraps the model in a new
DDP, makes a new sampler (it shards over the survivors), and does the epoch again. The
global batch stays the same (each survivor takes a larger share), so the run follows the
same schedule as an uninterrupted one.

Run it with Open MPI's fault tolerance (``make demo-elastic`` does both runs)::

    scripts/mpirun.sh --fault-tolerant -n 4 python examples/elastic_training.py --save-result logs/whole.json
    scripts/mpirun.sh --fault-tolerant -n 4 python examples/elastic_training.py --kill-rank 3 \
        --compare-with logs/whole.json

The second run kills rank 3 (SIGKILL, as the kernel's out-of-memory killer or a lost node
would) in the middle of an epoch; the three survivors finish, and the final accuracy is
printed beside the uninterrupted run's. The exit status is non-zero if they differ by more
than ``--tolerance`` points.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import mpitensor as mt
import mpitensor.torch as mtt


def load_data() -> tuple[TensorDataset, TensorDataset]:
    """The digits as 1x8x8 float64 images in [0, 1], split 80/20 into train and test."""
    digits = load_digits()
    x = torch.from_numpy(digits.images / 16.0).unsqueeze(1)
    y = torch.from_numpy(digits.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(x)))
    x, y = x[order], y[order]
    split = int(0.8 * len(x))
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


def make_cnn() -> torch.nn.Module:
    """Two 3x3 convolutions, a pooling and two dense layers, in float64."""
    torch.manual_seed(42)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(16 * 4 * 4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10),
    ).double()


class Trainer:
    """The model, its DDP wrapper, optimizer and sampler over the current process group.

    Args:
        train: the training set.
        global_batch: samples per step over every rank together.
        lr: the SGD learning rate.
    """

    def __init__(self, train: TensorDataset, global_batch: int, lr: float) -> None:
        self.train_set = train
        self.global_batch = global_batch
        self.model = make_cnn()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.rebuild()

    def rebuild(self) -> None:
        """Wrap the model and shard the data over the group as it is now (after a shrink too)."""
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.ddp = DistributedDataParallel(self.model)  # rank 0's parameters on every rank
        self.sampler = DistributedSampler(self.train_set, num_replicas=self.size, rank=self.rank, seed=0,
                                          drop_last=True)
        self.loader = DataLoader(self.train_set, batch_size=self.global_batch // self.size, sampler=self.sampler,
                                 drop_last=True)

    def snapshot(self) -> dict[str, Any]:
        """This rank's copy of the model's and optimizer's state (every rank holds the same)."""
        return copy.deepcopy({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()})

    def restore(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    def epoch(self, number: int, kill: tuple[int, int, int] | None) -> float:
        """Train one epoch; the mean loss over every rank. `kill`: (world rank, epoch, step) that dies."""
        self.sampler.set_epoch(number)
        self.ddp.train()
        total = torch.zeros(2, dtype=torch.float64)
        for step, (x, y) in enumerate(self.loader):
            if kill is not None and kill[1:] == (number, step) and _world_rank() == kill[0]:
                print(f"rank {kill[0]}: killed (SIGKILL) in epoch {number + 1}, step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            self.optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.ddp(x), y)
            loss.backward()
            self.optimizer.step()
            total += torch.tensor([loss.item() * len(y), len(y)], dtype=torch.float64)
        dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def accuracy(self, test: TensorDataset) -> float:
        """Test accuracy in percent, the test set shared among the ranks."""
        x, y = test.tensors
        with torch.no_grad():
            mine = slice(self.rank, None, self.size)
            counts = torch.tensor([(self.model(x[mine]).argmax(dim=1) == y[mine]).sum().item(), len(y[mine])],
                                  dtype=torch.float64)
        dist.all_reduce(counts)
        return 100.0 * (counts[0] / counts[1]).item()


def _world_rank() -> int:
    return mt.current_context().devices[mt.current_context().rank].rank


def train(args: argparse.Namespace) -> tuple[float, int, list[str]]:
    """Train with fault tolerance; the final accuracy, the ranks left and what happened on the way."""
    train_set, test_set = load_data()
    trainer = Trainer(train_set, args.batch, args.lr)
    kill = None if args.kill_rank is None else (args.kill_rank, args.kill_epoch, args.kill_step)
    events: list[str] = []
    number = 0
    while number < args.epochs:
        kept = trainer.snapshot()  # the state every rank goes back to if a rank dies in this epoch
        try:
            loss = trainer.epoch(number, kill)
        except mt.RankFailedError as error:
            caught = time.perf_counter()
            mtt.shrink_process_group()
            trainer.restore(kept)
            trainer.rebuild()
            who = f"rank(s) {list(error.ranks)}" if error.ranks else "a rank"
            events.append(f"epoch {number + 1}: {who} died; "
                          f"{trainer.size} survivors went on after {1e3 * (time.perf_counter() - caught):.0f} ms "
                          "(shrink, new group, state reloaded), the epoch done again")
            if trainer.rank == 0:
                print(events[-1], flush=True)
            continue
        if trainer.rank == 0:
            print(f"epoch {number + 1:2d}/{args.epochs} on {trainer.size} ranks  loss {loss:.4f}", flush=True)
        number += 1
    return trainer.accuracy(test_set), trainer.size, events


def main(argv: list[str] | None = None) -> int:
    """Train (a rank killed on the way with --kill-rank); print the accuracy; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch", type=int, default=96, help="global mini-batch size (divisible by 3 and 4)")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--kill-rank", type=int, default=None, help="world rank to kill (SIGKILL) mid-epoch")
    parser.add_argument("--kill-epoch", type=int, default=3, help="epoch (from 0) in which it dies")
    parser.add_argument("--kill-step", type=int, default=5, help="step of that epoch at which it dies")
    parser.add_argument("--save-result", type=Path, default=None, help="write the final accuracy here (JSON)")
    parser.add_argument("--compare-with", type=Path, default=None, help="an uninterrupted run's --save-result")
    parser.add_argument("--tolerance", type=float, default=1.0, help="accuracy points the runs may differ by")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # ranks share the machine's cores

    with mt.DistributedContext.init(config=mt.DistributedConfig(on_rank_failure="raise")) as ctx:
        if not ctx.fault_tolerant:
            print("this MPI does not survive the loss of a rank (python -m mpitensor info says why); launch with "
                  "scripts/mpirun.sh --fault-tolerant on Open MPI", file=sys.stderr, flush=True)
            return 2
        started = ctx.size
        dist.init_process_group("mpitensor")
        began = time.perf_counter()
        accuracy, size, _ = train(args)
        seconds = time.perf_counter() - began
        rank = dist.get_rank()
        dist.destroy_process_group()
        survivors = mt.current_context()
        if survivors is not ctx:  # the survivors' context, made by shrink_process_group
            survivors.close()
    status = 0
    if rank == 0:
        print(f"final test accuracy {accuracy:.2f}% with {size} of {started} ranks, {args.epochs} epochs in "
              f"{seconds:.1f} s", flush=True)
        if args.save_result is not None:
            args.save_result.parent.mkdir(parents=True, exist_ok=True)
            args.save_result.write_text(json.dumps({"accuracy": accuracy, "ranks": size}))
        if args.compare_with is not None:
            whole = json.loads(args.compare_with.read_text())
            gap = abs(accuracy - whole["accuracy"])
            status = 0 if gap <= args.tolerance else 1
            print(f"uninterrupted run: {whole['accuracy']:.2f}% with {whole['ranks']} ranks; this run: "
                  f"{accuracy:.2f}% with {size}: {gap:.2f} points apart "
                  f"({'within' if status == 0 else 'MORE THAN'} {args.tolerance:g})", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
