"""The backend's Python runs as plain Python under torch.compile: Dynamo's frame hook never sees it.

DDP's reducer calls the group's methods from C++ while Dynamo's hook is set (a graph break
inside a compiled forward); the hook must not take those frames, nor the frames they call.
Here the hook is set by hand, as a compiled region sets it, and records the frames it is
offered.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
eval_frame = pytest.importorskip("torch._C._dynamo.eval_frame")
dynamo_types = pytest.importorskip("torch._dynamo.types")
from mpitensor.torch import _unseen  # noqa: E402 - after the skips when torch is missing


def _seen_by_the_hook(call) -> list[str]:
    """The names of the frames Dynamo's frame hook is offered while `call()` runs."""
    seen: list[str] = []

    def hook(frame, *rest):
        seen.append(frame.f_code.co_name)
        return dynamo_types.ConvertFrameReturn()  # run the frame as it is

    prior = eval_frame.set_eval_frame(hook)
    try:
        call()
    finally:
        eval_frame.set_eval_frame(prior)
    return seen


_SOURCE = """
def plain_helper(x):
    return x + 1

def marked_helper(x):
    return x + 2

class Plain:
    def method(self, x):
        return plain_helper(x)

class Marked:
    def method(self, x):
        return marked_helper(x)

    @staticmethod
    def static(x):
        return marked_helper(x)
"""


def _classes(name: str):
    """Two classes of fresh code objects (Dynamo's marks stay on a code object for good)."""
    namespace: dict = {}
    exec(compile(_SOURCE, f"<classes for {name}>", "exec"), namespace)
    return namespace["Plain"], namespace["Marked"]


@pytest.mark.parametrize("mechanism", ["code marks", "torch.compiler.disable"])
def test_marked_classes_and_what_they_call_are_not_offered_to_dynamo(monkeypatch, mechanism):
    if mechanism == "torch.compiler.disable":  # a torch without code marks gets wrappers
        monkeypatch.setattr(_unseen, "_code_marker", lambda: None)
    elif _unseen._code_marker() is None:
        pytest.skip("this torch has no code marks")
    plain, marked = _classes(mechanism)
    _unseen.unseen_by_dynamo(marked)
    assert marked().method(1) == 3 and marked.static(1) == 3  # still the same methods
    seen = _seen_by_the_hook(lambda: (plain().method(1), marked().method(1), marked.static(1)))
    assert "method" in seen and "plain_helper" in seen
    assert "marked_helper" not in seen
    assert seen.count("method") == 1 and "static" not in seen
