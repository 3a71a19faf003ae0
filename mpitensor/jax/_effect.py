"""The ordered effect every compiled collective carries.

Ranks must run collectives in the same order. An effect JAX knows as *ordered* threads a
token from one collective to the next, so neither JAX nor XLA reorders two of them (or
drops one whose result is unused), inside one program and across programs. JAX keeps its
effect registries in a private module; there is no public way to declare an ordered
effect yet.
"""

from __future__ import annotations

from jax._src import effects as _effects
from jax.extend.core import Effect


class CollectiveEffect(Effect):
    """The effect of an mpitensor collective: ordered, allowed in control flow and remat."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CollectiveEffect)

    def __hash__(self) -> int:
        # Equal in every process and every run, so compiled programs' cache keys are too.
        return 0x6D70746E


COLLECTIVE = CollectiveEffect()

for _registry in (
    _effects.lowerable_effects,
    _effects.ordered_effects,
    _effects.control_flow_allowed_effects,
    _effects.custom_derivatives_allowed_effects,
    _effects.remat_allowed_effects,
):
    _registry.add_type(CollectiveEffect)
