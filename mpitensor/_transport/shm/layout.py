"""Which ranks of a group share a node."""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["node_layout"]


def node_layout(hosts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The group's ranks (ranks in the group) per node, nodes ordered by their first rank.

    Ranks are on one node when they report the same host. ``MPITENSOR_SHM_NODE_SIZE=k``
    splits each host's ranks into pseudo-nodes of k consecutive ranks, which runs the
    hierarchical scheme on one machine (for tests).

    Args:
        hosts: each group member's host name, in group order.

    Returns:
        One tuple of group ranks per node.
    """
    nodes: dict[str, list[int]] = {}
    for group_rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(group_rank)
    raw = os.environ.get("MPITENSOR_SHM_NODE_SIZE", "").strip()
    split = int(raw) if raw.isdigit() and int(raw) > 0 else 0
    layout: list[tuple[int, ...]] = []
    for ranks in nodes.values():
        if split:
            layout.extend(tuple(ranks[i : i + split]) for i in range(0, len(ranks), split))
        else:
            layout.append(tuple(ranks))
    return tuple(layout)
