"""Trace files: the merged file of a run, one rank's part of it, and reading either back.

The merged file is a Chrome Trace Event object with one more top-level key, ``"mpitensor"``, holding the dumps
(Chrome and Perfetto ignore keys they do not know). A part holds one rank's dump and events, for when the ranks
could not merge (a fault); `read_dumps` reads the parts where the merged file is absent.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .chrome import chrome_trace, earliest_ns, rank_events
from .stragglers import check_dumps

__all__ = ["FORMAT", "part_path", "part_paths", "read_dumps", "remove_trace", "write_part", "write_trace"]

FORMAT = 1
_PART = re.compile(r"\.rank(\d+)\.json$")


def _write_json(path: str, content: Mapping[str, Any]) -> str:
    # A reader (or a rank dumping at a fault) never sees a half-written file: write beside it, then rename.
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as file:
        json.dump(content, file)
    os.replace(tmp, path)
    return path


def write_trace(path: str | os.PathLike[str], dumps: Sequence[Mapping[str, Any]]) -> str:
    """Write the merged trace of a run (atomically).

    Args:
        path: the file to write (``trace.json``).
        dumps: every rank's dump.

    Returns:
        The path written.

    Raises:
        TypeError, ValueError: the dumps are not one run's (as `summarize`).
    """
    content = chrome_trace(dumps)
    content["mpitensor"] = {"format": FORMAT, "dumps": sorted(dumps, key=lambda dump: dump["rank"])}
    return _write_json(os.fspath(path), content)


def part_path(path: str | os.PathLike[str], rank: int) -> str:
    """The file of `rank`'s part of the trace at `path`: ``f"{path}.rank{rank}.json"``."""
    return f"{os.fspath(path)}.rank{rank}.json"


def write_part(path: str | os.PathLike[str], dump: Mapping[str, Any]) -> str:
    """Write one rank's dump alone (atomically), as a trace that also opens by itself in Perfetto.

    Args:
        path: the merged trace's path; the part goes to ``f"{path}.rank{rank}.json"``.
        dump: the rank's dump.

    Returns:
        The part's path.

    Raises:
        TypeError, ValueError: the dump is malformed.
    """
    check_dumps([dump])
    part = {
        "traceEvents": rank_events(dump, earliest_ns([dump])),
        "displayTimeUnit": "ms",
        "mpitensor": {"format": FORMAT, "dumps": [dump]},
    }
    return _write_json(part_path(path, dump["rank"]), part)


def part_paths(path: str | os.PathLike[str]) -> list[str]:
    """The parts of the trace at `path` that exist (``path.rank*.json``), in rank order.

    Args:
        path: the merged trace's path.

    Returns:
        The parts' paths, sorted by rank; empty when there are none.
    """
    found = glob.glob(f"{glob.escape(os.fspath(path))}.rank*.json")
    ranked = [(int(match.group(1)), name) for name in found if (match := _PART.search(name))]
    return [name for _, name in sorted(ranked)]


def remove_trace(path: str | os.PathLike[str]) -> None:
    """Remove an earlier run's trace at `path` and its parts, so that they are not read as this run's.

    Args:
        path: the merged trace's path.
    """
    for name in [os.fspath(path), *part_paths(path)]:
        try:
            os.remove(name)
        except FileNotFoundError:
            pass


def _load(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as file:
        try:
            content = json.load(file)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not an mpitensor trace: it is not JSON ({exc})") from exc
    section = content.get("mpitensor") if isinstance(content, dict) else None
    if not isinstance(section, dict):
        raise ValueError(
            f"{path} is not an mpitensor trace (no 'mpitensor' key): expected a file that write_trace "
            "or write_part wrote"
        )
    if section.get("format") != FORMAT:
        raise ValueError(
            f"{path} is an mpitensor trace of format {section.get('format')!r}, but this version "
            f"reads format {FORMAT}: read it with the mpitensor that wrote it"
        )
    dumps = section.get("dumps")
    if not isinstance(dumps, list) or not all(isinstance(dump, dict) and "rank" in dump for dump in dumps):
        raise ValueError(f"{path}'s 'mpitensor' section has no list of dumps with a 'rank' each: the file is corrupt")
    return dumps


def read_dumps(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The dumps of the trace at `path`: the merged file, or where it does not exist, its parts.

    Args:
        path: the merged trace's path.

    Returns:
        The dumps, in rank order.

    Raises:
        FileNotFoundError: neither the file nor any part exists.
        ValueError: a file is not an mpitensor trace, or of a format this version does not read.
    """
    path = os.fspath(path)
    if os.path.exists(path):
        dumps = _load(path)
    else:
        parts = part_paths(path)
        if not parts:
            raise FileNotFoundError(
                f"no trace at {path}, and no parts of one ({path}.rank*.json): pass the file the run wrote its trace to"
            )
        dumps = [dump for part in parts for dump in _load(part)]
    return sorted(dumps, key=lambda dump: dump["rank"])
