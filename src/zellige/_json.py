"""Shared helpers for the JSON readers: one-line ValueErrors for bad input."""

from __future__ import annotations

import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

from zellige._files import MAX_TOML_BYTES, read_input

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
MAX_NESTING = 64  # containers inside containers; the formats need 4, the parsers recurse
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def cut(text: str, limit: int = 60) -> str:
    """`text` for an error message: at most `limit` characters and a count of the rest."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def shown(value: Any, limit: int = 60) -> str:
    """A value as JSON for an error message, cut to `limit` characters."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError):  # a non-finite float, a long int, a TOML datetime
        text = repr(value) if not isinstance(value, int) else "a very large integer"
    return cut(printable(text), limit)


def printable(text: str) -> str:
    """`text` with control characters (terminal escapes, newlines) and lone surrogates escaped,
    so a value echoed in a message cannot move the cursor, recolour or split the line."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() and not 0xD800 <= ord(ch) <= 0xDFFF else ascii(ch)[1:-1]
        for ch in text
    )


MAX_OUTPUT_LINE = 1000  # characters of one printed line: a 10 MB name is not echoed whole


def output_line(text: str) -> str:
    """A line for a terminal: control characters escaped (printable) and at most
    MAX_OUTPUT_LINE characters (cut)."""
    return cut(printable(text), MAX_OUTPUT_LINE)


def check_strings(value: Any, source: str) -> None:
    """ValueError for a document deeper than MAX_NESTING or a string that is not text (a lone
    surrogate such as "\\ud800", which JSON escapes allow and UTF-8 cannot hold)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(
                    f"{source}: the string {shown(item)} holds a lone surrogate (not text)"
                ) from None
        elif isinstance(item, dict | list):
            if depth > MAX_NESTING:
                raise ValueError(f"{source}: nested deeper than {MAX_NESTING} levels")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number (only finite numbers are allowed)")


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
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError(f"{source}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}: {e.msg}"
        if e.pos >= len(text.rstrip()) or _ends_open(text):
            raise ValueError(
                f"{source}: truncated JSON (the input ends before the document closes; "
                f"parser stopped at {where})"
            ) from None
        raise ValueError(f"{source}: malformed JSON at {where}") from None
    except ValueError as e:  # NaN/Infinity, or an integer of more than 4300 digits
        raise ValueError(f"{source}: {e}") from None
    if _SURROGATE_ESCAPE.search(text):  # the one way a decoded JSON string is not text
        check_strings(data, source)
    return data


def parse_toml(text: str, source: str) -> dict:
    """tomllib.loads with one-line ValueErrors: malformed, nested deeper than MAX_NESTING, or a
    string that is not text."""
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise ValueError(f"{source}: TOML nested too deeply") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"{source}: not valid TOML ({cut(str(error), 200)})") from None
    check_strings(data, source)
    return data


def read_toml(path: str | Path) -> dict:
    """A TOML input file (at most MAX_TOML_BYTES), parsed; one-line ValueErrors naming it."""
    return parse_toml(read_input(path, MAX_TOML_BYTES, "TOML"), str(path))


def read_text(path: str | Path) -> str:
    """An input file's text (at most zellige._files.MAX_INPUT_BYTES); one-line ValueErrors."""
    return read_input(path)


def require_int(
    obj: dict,
    key: str,
    where: str,
    default: int | None = None,
    low: int = INT64_MIN,
    high: int = INT64_MAX,
) -> int:
    """An integer field in [low, high] (default: the 64-bit range the core takes; bool is not an
    integer); missing -> default, or an error if None."""
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field '{key}'")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}: field '{key}' must be an integer, got {shown(value)}")
    if not low <= value <= high:
        raise ValueError(f"{where}: field '{key}' must be in [{low}, {high}], got {shown(value)}")
    return value


def require_number(obj: dict, key: str, where: str, default: float | None = None) -> float:
    """A finite number field (int or float, not bool); missing -> default, or an error if None."""
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field '{key}'")
        return default
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{where}: field '{key}' must be a number, got {shown(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{where}: field '{key}' must be a finite number, got {shown(value)}")
    return number


def require_str(obj: dict, key: str, where: str, default: str | None = None) -> str:
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field '{key}'")
        return default
    value = obj[key]
    if not isinstance(value, str):
        raise ValueError(f"{where}: field '{key}' must be a string, got {shown(value)}")
    return value


def require_list(obj: dict, key: str, where: str, default: list | None = None) -> list:
    if key not in obj:
        if default is None:
            raise ValueError(f"{where}: missing field '{key}'")
        return default
    value = obj[key]
    if not isinstance(value, list):
        raise ValueError(f"{where}: field '{key}' must be a list, got {shown(value)}")
    return value


def require_object(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{where}: expected a JSON object, got {shown(value)}")
    return value


def reject_unknown(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise ValueError(
            f"{where}: unknown field '{cut(unknown[0])}' (allowed: {', '.join(allowed)})"
        )
