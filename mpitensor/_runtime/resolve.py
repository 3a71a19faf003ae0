"""How a collective's ``devices`` argument becomes its group's members: read once per argument.

A program names a sub-group by a list of devices (``evens = [d for d in ctx.devices if
d.rank % 2 == 0]``) or of ranks, and passes the same list on every call. Reading it costs
one look-up per device, 5 ms for a list of 16,384 devices; the group, once known, is a
look-up by the list's identity. A tuple cannot change, so its identity is enough; a list
can, so it is compared with a copy of what it held when it was read (item by item, in C:
about 0.6 ns per item). Only arguments made of devices and ints are remembered that way (a
mutable item could change unseen); anything else is read on every call.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from .._core.device import Device
from .._core.errors import DeviceError, NotAMemberError
from .check import Members

__all__ = ["KNOWN_ARGUMENTS", "GroupResolver", "describe_members"]

KNOWN_ARGUMENTS = 64  # devices arguments remembered; beyond, the oldest is forgotten
_PLAIN_ITEMS = (Device, int)


class GroupResolver:
    """The members each ``devices`` argument names, in one context.

    Args:
        devices: the context's devices, in rank order.
        rank: this rank in the context.
    """

    def __init__(self, devices: Sequence[Device], rank: int) -> None:
        self._devices = tuple(devices)
        self._rank = rank
        self._ranks: dict[Device, int] | None = None  # made on the first Device looked up
        # id(argument) -> (the argument, kept so that its id is not reused; a copy of a list
        # to compare it with, or None; its members; whether this rank is one of them)
        self._known: dict[int, tuple[Any, list[Any] | None, Members, bool]] = {}
        self._canonical: dict[Members, Members] = {}  # one object per member list

    def members(self, devices: Sequence[Device | int]) -> Members:
        """The sorted context ranks `devices` names.

        Args:
            devices: Devices (from ``ctx.devices``) or context ranks.

        Returns:
            The members, the same object for every argument that names them.

        Raises:
            TypeError: `devices` is not a sequence of Devices or ints.
            ValueError: empty, repeated or out-of-range ranks.
            DeviceError: a device that is not in this context.
            NotAMemberError: this rank is not one of them.
        """
        known = self._known.get(id(devices))
        if known is not None and known[0] is devices and (known[1] is None or devices == known[1]):
            members, mine = known[2], known[3]
        else:
            members = self._read(devices)
            mine = self._rank in members
            self._remember(devices, members, mine)
        if not mine:
            raise NotAMemberError(
                f"this rank ({self._rank}) is not in the group {describe_members(members)}: only the members "
                "of a group call its collectives"
            )
        return members

    def rank_of(self, device: Device) -> int:
        """`device`'s rank in the context.

        Raises:
            DeviceError: `device` is not one of the context's devices.
        """
        if self._ranks is None:
            self._ranks = {candidate: rank for rank, candidate in enumerate(self._devices)}
        rank = None if device.rank is None else self._ranks.get(device)
        if rank is None:
            shown = ", ".join(str(d) for d in self._devices[:8]) + (", ..." if len(self._devices) > 8 else "")
            raise DeviceError(
                f"device {device} is not in this context (its devices are {shown}); pass devices from ctx.devices"
            )
        return rank

    @property
    def remembered(self) -> int:
        """How many arguments are remembered (at most `KNOWN_ARGUMENTS`)."""
        return len(self._known)

    def forget(self) -> None:
        """Let go of every remembered argument (the context closes)."""
        self._known.clear()
        self._canonical.clear()

    def _read(self, devices: Sequence[Device | int]) -> Members:
        """The members `devices` names, read item by item."""
        if isinstance(devices, (Device, int, str)) or not isinstance(devices, Sequence):
            raise TypeError(
                "devices must be a list of mpitensor.Device (from ctx.devices) or of ranks, "
                f"or None for every rank; got {type(devices).__name__}"
            )
        size = len(self._devices)
        ranks = []
        for item in devices:
            if isinstance(item, Device):
                ranks.append(self.rank_of(item))
                continue
            try:
                rank = operator.index(item)
            except TypeError:
                raise TypeError(f"devices must hold Devices or int ranks, got {type(item).__name__}") from None
            if not 0 <= rank < size:
                raise ValueError(f"rank {rank} is out of range for a context of {size} ranks")
            ranks.append(rank)
        if not ranks:
            raise ValueError("devices is empty: a collective needs at least one rank")
        members = Members(sorted(set(ranks)))
        if len(members) != len(ranks):
            raise ValueError(f"devices names a rank twice: {describe_members(sorted(ranks))}")
        return self._canonical.setdefault(members, members)

    def _remember(self, devices: Any, members: Members, mine: bool) -> None:
        kind = type(devices)
        if kind is not tuple and kind is not list and kind is not range:
            return
        if kind is not range and not all(type(item) in _PLAIN_ITEMS for item in devices):
            return  # an item that could change in place would go unseen
        if len(self._known) >= KNOWN_ARGUMENTS:
            del self._known[next(iter(self._known))]
        self._known[id(devices)] = (devices, list(devices) if kind is list else None, members, mine)


def describe_members(members: Sequence[int], shown: int = 16) -> str:
    """A group's members as text, at most `shown` of them (``[0, 2, 4, ... 8190] (4096 ranks)``)."""
    if len(members) <= shown:
        return str(list(members))
    head = ", ".join(str(rank) for rank in members[: shown - 1])
    return f"[{head}, ... {members[-1]}] ({len(members)} ranks)"
