"""The plan cache of a context: what a kind of call needs, kept after its first call.

The first call of a kind goes the general way: its collective takes the input, plans the
reduction, chooses the transport (`_transport/select.py`) and builds the check's record. Where
the choice depends only on the kind and the context, the call keeps its plan here, and a later
call of that kind looks it up and runs it (`lane.py`: the all-reduce's copies, carried checks
and protected inputs; `all_reduce.py` and `held.py`: calls on buffers their caller holds; each
plan with its compiled counterpart where the compiled code has one). A plan is only ever right
for the calls its key matches, so every rank runs the call as the general path would.

One cache per context, in its full group's extra state and freed with it (which also drops the
compiled front's memo of the context's plans, `native.forget`). Keys start with the
collective's name and hold everything that picks the path: dtype, shape, op argument, root,
buffer mode. One eviction rule: beyond `MAX_PLANS` kinds the cache starts over.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from .native import forget

__all__ = ["MAX_PLANS", "PLANS", "Plans", "find_plan", "keep_plan"]

PLANS = "plans"  # the key of the cache in the full group's extra state
MAX_PLANS = 256  # kinds of call remembered per context; beyond, the cache starts over


class Plans(dict):
    """A context's plans by kind, which the context frees with its group's other caches.

    Args:
        ctx: the context.
    """

    __slots__ = ("ctx",)

    def __init__(self, ctx: Any) -> None:
        super().__init__()
        self.ctx = ctx

    def free(self) -> None:
        """Forget the plans here and in the compiled front's memo (the context is closing)."""
        forget(self.ctx)
        self.clear()


def find_plan(ctx: Any, key: Hashable) -> Any:
    """The plan kept for calls of kind `key` on `ctx`, or None (also for an unhashable key)."""
    plans = ctx.full_group.extra.get(PLANS)
    if plans is None:
        return None
    try:
        return plans.get(key)
    except TypeError:  # an unhashable op: the general path says what is wrong with it
        return None


def keep_plan(ctx: Any, key: Hashable, plan: Any) -> None:
    """Keep `plan` (None: the calls of this kind have none) for the calls of kind `key` on `ctx`."""
    extra = ctx.full_group.extra
    plans = extra.get(PLANS)
    if plans is None or len(plans) >= MAX_PLANS:
        plans = extra[PLANS] = Plans(ctx)
    try:
        plans[key] = plan
    except TypeError:  # an unhashable op that parsed: such calls keep the general path
        pass
