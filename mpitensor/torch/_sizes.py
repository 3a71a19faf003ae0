"""Every rank's sizes against what its peers' calls say they receive, for torch's list collectives.

torch's ``all_gather``, ``gather``, ``scatter``, ``all_to_all`` and ``all_to_all_single``
with split sizes let each rank state both what it sends to each rank (its inputs, its split
sizes) and what it receives from each (its outputs). MPI moves what the senders say; a
receiver whose outputs say otherwise would get the data cut where its outputs say (2 and 4
elements into outputs of 3 and 3: ``[[1, 1, 2], [2, 2, 2]]``). So before the data moves,
one small exchange tells each receiver what each sender sends it, and the receiver compares
that with its outputs. A receiver that finds a difference takes its turn of the data call
as failed and raises `CollectiveMismatchError`; its peers' data call raises
`CollectiveMismatchError` naming it and the sizes. Every rank has then made the same calls,
so the next collective is right.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import numpy as np

import mpitensor as mt

__all__ = ["agree_all_gather", "agree_all_to_all", "agree_gather", "agree_scatter", "refuse"]


def refuse(kind: str, devices: Any, message: str) -> NoReturn:
    """Take this rank's turn of the `kind` call on `devices` as failed, and raise a mismatch.

    For a rank whose own arguments disagree with what its peers send or expect: the peers'
    `kind` call raises `CollectiveMismatchError` naming this rank and `message`.

    Raises:
        CollectiveMismatchError: always, with `message`.
    """
    failure = ValueError(message)
    try:
        with mt.collective_call(kind, devices):
            raise failure
    except ValueError as exc:
        if exc is not failure:
            raise
    raise mt.CollectiveMismatchError(message)


def _counts(values: Sequence[int]) -> np.ndarray:
    return np.asarray(values, dtype=np.int64).reshape(-1)


def _differences(incoming: Sequence[int], expected: Sequence[int], sender: Callable[[int], int],
                 receiver: int, slot: str, unit: str = "elements") -> list[str]:
    """What each sender sends this `receiver` where its output (named by `slot` and k) expects otherwise."""
    return [
        f"rank {sender(k)} sends {int(got)} {unit}, but rank {receiver}'s {slot.format(k=k)} holds {int(want)}"
        for k, (got, want) in enumerate(zip(incoming, expected))
        if int(got) != int(want)
    ]


def _judge(kind: str, devices: Any, differences: list[str]) -> None:
    if differences:
        refuse(kind, devices, f"{kind}: the ranks' sizes disagree: {'; '.join(differences)} "
                              "(each rank's outputs must have the sizes its peers send)")


def agree_all_gather(devices: Any, rank: int, sent: int, expected: Sequence[int], names: Callable[[int], int]) -> None:
    """Check ``all_gather``: rank k's input has as many elements as every rank's output k.

    Args:
        devices: the group (mpitensor's ``devices``).
        rank: this rank's global rank (for messages).
        sent: the elements of this rank's input.
        expected: the elements of each of this rank's outputs, in group order.
        names: a group rank's global rank (for messages).

    Raises:
        CollectiveMismatchError: on every rank, where some rank's size differs.
    """
    incoming = mt.all_gather(_counts([sent]), devices=devices).resolve().numpy()
    _judge("all_gather", devices, _differences(incoming, expected, names, rank, "output {k}"))


def agree_gather(devices: Any, rank: int, root: int, sent: int, expected: Sequence[int] | None,
                 names: Callable[[int], int]) -> None:
    """Check ``gather``: rank k's input has as many elements as the root's output k.

    Args:
        devices: the group.
        rank: this rank's global rank.
        root: the root's global rank.
        sent: the elements of this rank's input.
        expected: on the root, the elements of each output (group order); None elsewhere.
        names: a group rank's global rank.

    Raises:
        CollectiveMismatchError: on every rank, where some rank's size differs.
    """
    incoming = mt.gather(_counts([sent]), root, devices=devices).resolve()
    if expected is None:
        _judge("gather", devices, [])
        return
    _judge("gather", devices, _differences(incoming.numpy(), expected, names, rank, "gather_list[{k}]"))


def agree_scatter(devices: Any, rank: int, root: int, sent: Sequence[int] | None, expected: int) -> list[int]:
    """Check ``scatter``: the root's k-th tensor has as many elements as rank k's output.

    Args:
        devices: the group.
        rank: this rank's global rank.
        root: the root's global rank.
        sent: on the root, the elements of each tensor of its list (group order); None elsewhere.
        expected: the elements of this rank's output.

    Returns:
        The root's sizes, in group order (every rank gets them, for the scatter's counts).

    Raises:
        CollectiveMismatchError: on every rank, where some rank's size differs.
    """
    size = mt.current_context().size if devices is None else len(devices)
    if sent is not None:
        every = mt.broadcast(_counts(sent), root=root, devices=devices).resolve().numpy()
    else:
        every = mt.broadcast(None, root=root, devices=devices, shape=(size,), dtype=np.int64).resolve().numpy()
    members = list(range(size)) if devices is None else list(devices)
    mine = int(every[members.index(rank)])
    differences = [] if mine == expected else [
        f"rank {root} (the root) sends {mine} elements, but rank {rank}'s output holds {expected}"
    ]
    _judge("scatter", devices, differences)
    return [int(count) for count in every]


def agree_all_to_all(kind: str, devices: Any, rank: int, sent: Sequence[int], expected: Sequence[int],
                     names: Callable[[int], int], slot: str, unit: str = "elements") -> None:
    """Check an all-to-all: what rank k sends this rank is what this rank's output k holds.

    Args:
        kind: the torch call, for messages (``"all_to_all"``, ``"all_to_all_single"``).
        devices: the group.
        rank: this rank's global rank.
        sent: what this rank sends each rank, in group order (elements or rows).
        expected: what this rank receives from each, by its outputs (group order).
        names: a group rank's global rank.
        slot: how the message names output k (``"output {k}"``, ``"output_split_sizes[{k}]"``).
        unit: what the sizes count (``"elements"``, ``"rows"``).

    Raises:
        CollectiveMismatchError: on every rank, where some rank's size differs.
    """
    incoming = mt.all_to_all(_counts(sent), devices=devices).resolve().numpy()
    differences = _differences(incoming, expected, names, rank, slot, unit)
    if differences:
        refuse("all_to_all", devices, f"{kind}: the ranks' sizes disagree: {'; '.join(differences)} "
                                      "(each rank's outputs must have the sizes its peers send)")
