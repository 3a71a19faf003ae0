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
from .stragglers import check_dump_values, check_dumps, group_table

__all__ = ["FORMAT", "clear_path", "part_path", "part_paths", "read_dumps", "remove_trace", "write_part", "write_trace"]

FORMAT = 1
_PART = re.compile(r"\.rank(\d+)\.json$")


def _write_json(path: str, content: Mapping[str, Any]) -> str:
    """Write `content` to `path` atomically; on any failure leave nothing behind and raise.

    Raises:
        OSError: the file cannot be written (a full disk, no permission, a directory there),
            with the path and what to do; the partial ``PATH.tmp`` is removed.
    """
    # A reader (or a rank dumping at a fault) never sees a half-written file: write beside it, then rename.
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as file:
            json.dump(content, file)
        os.replace(tmp, path)
    except BaseException as exc:
        _remove_quietly(tmp)
        if isinstance(exc, OSError):
            raise _write_error(path, exc) from exc
        raise
    return path


def _write_error(path: str, exc: OSError) -> OSError:
    """`exc` (of its own class) saying which trace file could not be written and what to do."""
    message = (
        f"the trace could not be written to {path} ({exc.strerror or exc}); free space there or trace "
        "to another path (DistributedConfig(trace=...) or MPITENSOR_TRACE)"
    )
    try:
        return type(exc)(exc.errno, message) if exc.errno is not None else type(exc)(message)
    except TypeError:  # a subclass with a constructor of its own
        return OSError(exc.errno, message)


def _remove_quietly(name: str) -> None:
    """Remove `name` if it exists; a failure to remove is not reported (an error is being raised)."""
    try:
        os.remove(name)
    except OSError:
        pass


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


def clear_path(path: str | os.PathLike[str]) -> None:
    """Make `path` ready for a new run's trace: check where it goes, and remove an earlier run's trace and parts.

    Args:
        path: the merged trace's path.

    Raises:
        ValueError: the folder does not exist or is not writable, `path` is a directory, or an
            earlier trace there cannot be removed (each says what to do).
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"trace={path!r}: the folder {folder} does not exist on rank 0; create it or trace elsewhere")
    if os.path.isdir(path):
        raise ValueError(
            f"trace={path!r} is a directory on rank 0; pass the path of the file to write, "
            f"such as {os.path.join(path, 'trace.json')!r}"
        )
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(
            f"trace={path!r}: rank 0 cannot write in the folder {folder}; make it writable or trace elsewhere"
        )
    try:
        remove_trace(path)
    except OSError as exc:
        raise ValueError(
            f"trace={path!r}: rank 0 cannot remove the earlier trace there ({exc}); remove it, or trace elsewhere"
        ) from exc


def _load(path: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as file:
        try:
            content = json.load(file)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not an mpitensor trace: it is not JSON ({exc})") from exc
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not an mpitensor trace: it is not UTF-8 text ({exc})") from exc
        except RecursionError as exc:
            raise ValueError(
                f"{path} is not an mpitensor trace: its JSON nests deeper than a trace does (and than Python's "
                "parser can read)"
            ) from exc
    section = content.get("mpitensor") if isinstance(content, dict) else None
    if not isinstance(section, dict):
        raise ValueError(
            f"{path} is not an mpitensor trace (no 'mpitensor' key): expected a file that write_trace "
            "or write_part wrote"
        )
    if section.get("format") != FORMAT:
        raise ValueError(
            f"{path} is an mpitensor trace of format {section.get('format')!r:.100}, but this version "
            f"reads format {FORMAT}: read it with the mpitensor that wrote it"
        )
    dumps = section.get("dumps")
    if not isinstance(dumps, list) or not all(isinstance(dump, dict) and "rank" in dump for dump in dumps):
        raise ValueError(f"{path}'s 'mpitensor' section has no list of dumps with a 'rank' each: the file is corrupt")
    for dump in dumps:
        try:
            check_dumps([dump])
            check_dump_values(dump)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path} is a damaged mpitensor trace: {exc}") from exc
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
    _list_recorded_groups(dumps)
    return sorted(dumps, key=lambda dump: dump["rank"])


def _list_recorded_groups(dumps: Sequence[dict[str, Any]]) -> None:
    """Give each dump the members of every group its events are on, from the table of all the dumps.

    A merged file lists each group once, in its first member's dump (see `Tracer.dump`); a
    reader of one dump finds its groups there again. The lists are the table's own (shared,
    not copied), so a large run's dumps do not hold P copies of the whole context's members.

    Raises:
        ValueError: two dumps list one group with different members.
    """
    table = {str(group): list(members) for group, members in group_table(dumps).items()}
    for dump in dumps:
        listed = dump["groups"]
        for group in {str(key) for key in dump["events"]["group"]} - listed.keys():
            if group in table:
                listed[group] = table[group]
