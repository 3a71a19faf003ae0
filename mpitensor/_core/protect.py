"""Write protection of buffers while a collective reads or writes them.

A NumPy array handed to a collective is made read-only until MPI is done with it, so a
write through it raises instead of changing what is being sent; a `Tensor` also refuses
in-place operators and item assignment. Writes through other views of the same memory
cannot be seen; the docs say so. Protection nests: an array in two collectives at once
becomes writable again only after both.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .pool import Lease, Private
from .tensor import Tensor, tensors_in_flight

__all__ = ["CallScope", "Protection", "claim", "foreign", "restorable"]

_lock = threading.Lock()
# The protections taken by the collective call this thread is in (`CallScope`), or None.
_scope = threading.local()
# id(array) -> [array, count, was_writeable]; the array is held so its id stays unique.
_locked: dict[int, list[Any]] = {}


def restorable(array: np.ndarray) -> bool:
    """True if NumPy will let `array` become writable again after it was made read-only.

    NumPy's rule: an array that owns its memory may; otherwise the chain of its bases is
    followed, and a writable array on it, or a final object with a writable buffer, allows
    it. Memory another object exposes through ``__array_interface__`` alone does not, nor
    does an array made over raw memory with no base (a compiled caller's buffer).
    """
    if array.flags.owndata:
        return True
    if array.base is None:
        return False
    base = array.base
    while isinstance(base, np.ndarray):
        if base.flags.writeable:
            return True
        if base.base is None or base.flags.owndata:
            return False
        base = base.base
    try:
        with memoryview(base) as view:
            return not view.readonly
    except TypeError:
        return False


def foreign(array: np.ndarray) -> bool:
    """True if `array`'s memory belongs to an object other than NumPy or mpitensor's pool.

    Such memory (a torch tensor's, a ctypes buffer, a bytearray, a DLPack export) can be
    written through its owner, which making the array read-only does not stop: a collective
    must copy it instead.
    """
    base = array
    while isinstance(base, np.ndarray):
        if base.base is None or isinstance(base, (Lease, Private)):
            return False
        base = base.base
    return True


class Protection:
    """Protects one input (a Tensor or an array) until `release()` is called.

    One taken inside a collective call (`CallScope`) belongs to that call until an op holds it
    (`claim`): if the call fails first, the call's scope lifts it.
    """

    __slots__ = ("_array", "_tensor", "claimed")

    def __init__(self, tensor: Tensor | None, array: Any) -> None:
        self._tensor = tensor
        self._array = array = array if isinstance(array, np.ndarray) else None
        self.claimed = False
        if tensor is None and array is None:
            return
        taken = getattr(_scope, "taken", None)
        if taken is not None:
            taken.append(self)
        with _lock:
            if tensor is not None:
                key = id(tensor)
                counted = tensors_in_flight.get(key)
                if counted is None:
                    tensors_in_flight[key] = [tensor, 1]
                else:
                    counted[1] += 1
            if array is not None:
                key = id(array)
                entry = _locked.get(key)
                if entry is None:
                    # An array NumPy could not make writable again (a view of a torch
                    # tensor given as out=) stays writable: only its owner could protect it.
                    lockable = array.flags.writeable and restorable(array)
                    _locked[key] = [array, 1, lockable]
                    if lockable:
                        array.flags.writeable = False
                else:
                    entry[1] += 1

    def release(self) -> None:
        """Lift this protection (idempotent)."""
        tensor, self._tensor = self._tensor, None
        array, self._array = self._array, None
        if tensor is None and array is None:
            return
        with _lock:
            if tensor is not None:
                key = id(tensor)
                counted = tensors_in_flight[key]
                counted[1] -= 1
                if counted[1] == 0:
                    del tensors_in_flight[key]
            if array is not None:
                key = id(array)
                entry = _locked[key]
                entry[1] -= 1
                if entry[1] == 0:
                    del _locked[key]
                    if entry[2]:
                        array.flags.writeable = True


class CallScope:
    """The protections one collective call takes before an op holds them, lifted if the call fails first.

    A call protects its input (`Input.guard`) before it has built and submitted its op;
    an error in between (a bad `out=`, bad splits, a mismatch raised by an earlier step)
    would leave the input read-only for good. The collectives' entry opens a scope around
    each call: `fail()` lifts what no op claimed (the engine claims an op's protections
    when it submits it, and lifts them itself when the op completes or fails).
    """

    __slots__ = ("previous", "taken")

    def __init__(self) -> None:
        self.previous = getattr(_scope, "taken", None)
        self.taken: list[Protection] = []
        _scope.taken = self.taken

    def close(self) -> None:
        """End the scope (the call returned or raised; idempotent)."""
        _scope.taken = self.previous

    def fail(self) -> None:
        """The call failed: lift the protections it took that no op claimed, then end the scope."""
        self.close()
        for protection in self.taken:
            if not protection.claimed:
                protection.release()


def claim(protections: tuple[Protection, ...]) -> None:
    """Mark `protections` as an op's: the op's completion lifts them, not its call's failure."""
    for protection in protections:
        protection.claimed = True
