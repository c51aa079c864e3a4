"""Argument types shared by the commands: integers refused outside a documented range by argparse
itself, so a bad value gets the usual one-line usage error before anything runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from zellige import _core

SEED_MAX = (1 << 63) - 1
# The documented limits (README, "Limits"); the core refuses beyond them too.
MAX_GPUS = _core.MAX_GPUS
MAX_TOKENS = _core.MAX_BATCH_TOKENS


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high]."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text[:40]!r}") from None
        if not low <= value <= high:
            allowed = f"a positive integer <= {high}" if low == 1 else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text[:40]}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def nonnegative_float(text: str) -> float:
    """An argparse type: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text[:40]!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text[:40]}")
    return value
