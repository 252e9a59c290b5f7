"""Checks of a long run's command-line inputs, made before the run starts (`opport conformance`, `opport bench`).

A typo in a CI gate's path must not disable the gate, and a report path that cannot be written must not
cost a whole run: each check returns None when the input is usable, else one line naming the flag and the
file. The commands print that line on stderr and exit with status 2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def positive(flag: str, value, allow_zero: bool = False) -> str | None:
    """None if `value` is None (not given) or a number > 0 (>= 0 with `allow_zero`)."""
    if value is None or value > 0 or (allow_zero and value == 0):
        return None
    return f"{flag} {value:g}: expected a number {'>= 0' if allow_zero else '> 0'}"


def writable(flag: str, path: str | None) -> str | None:
    """None if `path` can be written (created or replaced); the file is not left behind if it did not exist."""
    if path is None:
        return None
    if not path or os.path.isdir(path):
        return f"{flag} {path!r}: is a directory, not a file"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"{flag} {path!r}: cannot be written: {e.strerror or e}"
    if not existed:
        os.unlink(path)
    return None


def read_text(flag: str, path: str) -> tuple[str | None, str | None]:
    """(text, None), or (None, why the file is missing, unreadable or empty)."""
    if os.path.isdir(path):
        return None, f"{flag} {path!r}: is a directory, not a file"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None, f"{flag} {path!r}: no such file"
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{flag} {path!r}: cannot be read: {getattr(e, 'strerror', None) or e}"
    if not text.strip():
        return None, f"{flag} {path!r}: the file is empty"
    return text, None


def json_file(flag: str, path: str, shape: Callable[[object], str | None]) -> str | None:
    """None if `path` holds JSON that `shape` accepts (`shape` returns what is wrong with it, or None)."""
    text, why = read_text(flag, path)
    if why:
        return why
    try:
        data = json.loads(text)
    except ValueError as e:
        return f"{flag} {path!r}: not valid JSON ({e})"
    wrong = shape(data)
    return f"{flag} {path!r}: {wrong}" if wrong else None


def first(*problems) -> str | None:
    """The first problem found, or None."""
    return next((p for p in problems if p), None)
