"""The backend's Python code, kept out of Dynamo's reach (``torch.compile``).

torch calls a Python process group from C++: DDP's reducer broadcasts, all-reduces and
waits through it. Under ``torch.compile(DDP(model))`` such a call comes while Dynamo's frame
hook is set (a graph break inside a compiled forward), so Dynamo would try to compile the
group's method as a new frame, and fails on the group itself (an opaque script object). The
backend's frames are no graph to capture: each method of its classes is marked so that
Dynamo runs it, and every frame it calls, as plain Python. The mark is made on the code
objects once (no cost per call, in or out of a compiled region); a torch without that
mechanism gets ``torch.compiler.disable`` wrappers instead (about 0.6 us per call).
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["unseen_by_dynamo"]


def _code_marker() -> Any:
    """A function that makes Dynamo skip a code object and every frame it calls, or None."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:
        return None
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)

    def mark(code: types.CodeType) -> None:
        set_code_exec_strategy(code, skip)

    return mark


def unseen_by_dynamo(cls: type) -> type:
    """Make every function defined in `cls` run as plain Python under ``torch.compile``.

    Args:
        cls: a class of the backend (its methods are called from torch's C++).

    Returns:
        `cls` (a class decorator).
    """
    mark = _code_marker()
    for name, value in list(vars(cls).items()):
        function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if not isinstance(function, types.FunctionType):
            continue
        if mark is not None:
            mark(function.__code__)
        elif not name.startswith("__"):
            disabled = torch.compiler.disable(function, recursive=True)
            setattr(cls, name, type(value)(disabled) if function is not value else disabled)
    return cls
