"""Zellige: per-sequence parallel placement for mixed image/video DiT training."""

from zellige import _core  # noqa: F401

__version__ = "0.1.0"
