"""Wrappers of torch.distributed's own functions, for what happens there before the backend is called.

Two things fail in torch's Python functions, before the ``mpitensor`` backend sees the call:

- **Conjugate views.** torch hands a complex tensor to every backend as its real view
  (``torch.view_as_real``), which refuses a conjugate view (``z.conj()``). For a group of
  this backend, such a tensor is resolved (``resolve_conj()``) before torch's function
  runs, and an output is written back once the call is complete (at ``wait()`` for
  ``async_op=True``), so its values are the result, as for any other tensor.
- **Object collectives.** ``broadcast_object_list``, ``all_gather_object``,
  ``gather_object`` and ``scatter_object_list`` pickle on one rank before its first
  collective: an object that does not pickle raised there, and the peers' call paired with
  that rank's next collective. For a group of this backend they run inside the door of a
  collective (`mpitensor.collective_call`), so that error takes the call's turn: the peers
  raise `CollectiveMismatchError` naming the rank, and the next collective is right. On a
  group a helper thread owns (``dcp.async_save`` plans on one, on a group of
  ``dist.new_group``), the door is that thread's, and the error takes the turn there.

Every other call goes to torch's function unchanged (a group of another backend too). A
name this torch does not have is left out.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._process_group import ProcessGroupMpitensor

__all__ = ["FRONTENDS"]

# torch's functions whose complex tensors become real views: (output parameters, input parameters).
_RESOLVED = {
    "all_reduce": (("tensor",), ()),
    "broadcast": (("tensor",), ()),
    "all_gather": (("tensor_list",), ("tensor",)),
    "all_gather_into_tensor": (("output_tensor",), ("input_tensor",)),
    "all_gather_single": (("output_tensor",), ("input_tensor",)),  # torch's newer name of the one above
    "scatter": (("tensor",), ("scatter_list",)),
    "all_to_all_single": (("output",), ("input",)),
    "all_to_all": (("output_tensor_list",), ("input_tensor_list",)),
    "send": ((), ("tensor",)),
    "recv": (("tensor",), ()),
}

# torch's object collectives, and the collective each starts with (the kind of its turn).
_OBJECTS = {
    "broadcast_object_list": "broadcast",
    "all_gather_object": "all_gather",
    "gather_object": "all_gather",
    "scatter_object_list": "broadcast",
}


def _conjugated(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_conj()
    if isinstance(value, (list, tuple)):
        for item in value:
            if isinstance(item, torch.Tensor) and item.is_conj():
                return True
    return False


def _any_conjugated(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a call has a conjugate view among its arguments (a loop: this runs on every call)."""
    for value in args:
        if _conjugated(value):
            return True
    return bool(kwargs) and any(_conjugated(value) for value in kwargs.values())


def _ours(group: Any) -> ProcessGroupMpitensor | None:
    """The ``mpitensor`` process group a call runs on, or None (another backend, or not initialized)."""
    if group is None:
        group = dist.group.WORLD if dist.is_initialized() else None
    return group if isinstance(group, ProcessGroupMpitensor) else None


def _resolve(value: Any, writes: list[tuple[torch.Tensor, torch.Tensor]] | None) -> Any:
    """`value` with each conjugate view resolved; (view, resolved) pairs to write back go to `writes`."""
    if isinstance(value, (list, tuple)):
        return type(value)(_resolve(item, writes) for item in value)
    if not isinstance(value, torch.Tensor) or not value.is_conj():
        return value
    resolved = value.resolve_conj()
    if writes is not None:
        writes.append((value, resolved))
    return resolved


def _write_back(writes: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for view, resolved in writes:
            view.copy_(resolved)  # through the view's conjugate bit: the view shows the result


def _wrap_resolving(name: str) -> Callable[[Any], Any]:
    outputs, inputs = _RESOLVED[name]

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # The common call, one plain tensor first and no keywords, in two tests (every all_reduce passes here).
            if not kwargs and args and type(args[0]) is torch.Tensor and len(args) == 1 and not args[0].is_conj():
                return original(*args)
            if not _any_conjugated(args, kwargs):
                return original(*args, **kwargs)
            bound = signature.bind(*args, **kwargs)
            group = _ours(bound.arguments.get("group"))
            if group is None:
                return original(*args, **kwargs)
            writes: list[tuple[torch.Tensor, torch.Tensor]] = []
            for parameter in outputs + inputs:
                if parameter in bound.arguments:
                    target = writes if parameter in outputs else None
                    bound.arguments[parameter] = _resolve(bound.arguments[parameter], target)
            result = original(*bound.args, **bound.kwargs)
            if not writes:
                return result
            if isinstance(result, dist.Work):  # async_op=True: written back once complete
                return group.after(result, lambda: _write_back(writes), [view for view, _ in writes])
            _write_back(writes)
            return result

        wrapper._mpitensor_wrapper = True  # type: ignore[attr-defined]
        return wrapper

    return wrap


def _wrap_object(name: str) -> Callable[[Any], Any]:
    kind = _OBJECTS[name]

    def wrap(original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            group = _ours(signature.bind(*args, **kwargs).arguments.get("group"))
            if group is None:  # another backend, or a rank outside the group (torch returns at once)
                return original(*args, **kwargs)
            with group.door(kind):  # a pickling error before the first collective takes its turn
                return original(*args, **kwargs)

        wrapper._mpitensor_wrapper = True  # type: ignore[attr-defined]
        return wrapper

    return wrap


# (torch's name, the wrapper maker): what `register` installs in torch.distributed.
FRONTENDS: tuple[tuple[str, Callable[[Any], Any]], ...] = (
    *((name, _wrap_resolving(name)) for name in _RESOLVED),
    *((name, _wrap_object(name)) for name in _OBJECTS),
)
