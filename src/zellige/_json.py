"""Shared helpers for the JSON readers: one-line ValueErrors for bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _ends_open(text: str) -> bool:
    """True when the text ends inside a string or with a bracket still open."""
    depth, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
    return in_string or depth > 0


def parse_json(text: str, source: str) -> Any:
    """json.loads with a one-line ValueError that names the source and the position."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}: {e.msg}"
        if e.pos >= len(text.rstrip()) or _ends_open(text):
            raise ValueError(
                f"{source}: truncated JSON (the input ends before the document closes; "
                f"parser stopped at {where})"
            ) from None
        raise ValueError(f"{source}: malformed JSON at {where}") from None


def read_text(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a UTF-8 text file ({e.reason})") from None


def require_int(obj: dict, key: str, where: str, default: int | None = None) -> int:
    """An integer field (bool is not an integer); missing -> default, or an error if None."""
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field '{key}'")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: field '{key}' must be an integer, got {json.dumps(value)}")
    return value


def require_number(obj: dict, key: str, where: str, default: float | None = None) -> float:
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field '{key}'")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: field '{key}' must be a number, got {json.dumps(value)}")
    return float(value)


def require_str(obj: dict, key: str, where: str, default: str | None = None) -> str:
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field '{key}'")
        return default
    value = obj[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field '{key}' must be a string, got {json.dumps(value)}")
    return value


def require_list(obj: dict, key: str, where: str, default: list | None = None) -> list:
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field '{key}'")
        return default
    value = obj[key]
    if not isinstance(value, list):
        raise ValueError(f"{where}: field '{key}' must be a list, got {json.dumps(value)}")
    return value


def require_object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {json.dumps(value)[:60]}")
    return value


def reject_unknown(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ValueError(f"{where}: unknown field '{unknown[0]}' (allowed: {', '.join(allowed)})")
