"""The record types of mpitensor's runtime objects: the fields compiled code reads and writes.

`Tensor`, `CollectiveTensor`, the engine's `Op`, `Group` and `Engine`, and the
`DistributedContext` derive from these: their fields here are all the state compiled code
(the lane of repeated calls, `_collectives/native`) touches, in structs the records' own
module defines (`native/records.h`: the interface between the Python runtime and its
compiled parts, which reads no Python object by attribute name or at a slot offset of a
Python class). The Python classes add their methods and other fields, and read and write
these by name, as slots. Where the compiled module was not built (no C compiler at install),
the records are the Python classes below, with the same fields.
"""

from __future__ import annotations

__all__ = ["ContextRecord", "EngineRecord", "GroupRecord", "HandleRecord", "OpRecord", "TensorRecord", "compiled"]

try:
    from ._records import ContextRecord, EngineRecord, GroupRecord, HandleRecord, OpRecord, TensorRecord

    compiled = True
except ImportError:  # built without a compiler, or for another interpreter: the same records in Python
    compiled = False

    class TensorRecord:  # type: ignore[no-redef]
        """The fields of a Tensor: ``_array``, ``_device``."""

        __slots__ = ("_array", "_device")

    class HandleRecord:  # type: ignore[no-redef]
        """The fields of a CollectiveTensor: ``_op``, ``_value``, ``_ctx``, ``_resolved``."""

        __slots__ = ("_ctx", "_op", "_resolved", "_value")

    class OpRecord:  # type: ignore[no-redef]
        """The fields of an engine Op."""

        __slots__ = (
            "check_recv", "check_req", "check_send", "check_sizes", "check_stage", "compare", "error", "exchange",
            "finish", "gathered", "group", "keep", "name", "nbytes", "payload", "post", "protections", "record",
            "requests", "result", "seq", "state", "stepper", "trace",
        )

    class GroupRecord:  # type: ignore[no-redef]
        """The fields of a Group: its ``queue``, ``holder`` and ``check_seq``."""

        __slots__ = ("check_seq", "holder", "queue")

    class EngineRecord:  # type: ignore[no-redef]
        """The engine's state and the functions compiled code calls (see native/records.h)."""

        __slots__ = (
            "await_check", "checks_posted", "lock", "lock_acquire", "lock_owned", "lock_release", "mark_broken_hook",
            "mpi_failed_hook", "posted", "spin_pauses", "stepping", "waiting_groups",
        )

    class ContextRecord:  # type: ignore[no-redef]
        """The fields of a DistributedContext: ``engine``, ``usable``, ``closed``, ``owner_thread``, ``timeout``."""

        __slots__ = ("closed", "engine", "owner_thread", "timeout", "usable")
