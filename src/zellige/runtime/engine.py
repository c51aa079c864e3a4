"""EngineConfig: how the attention engine runs, chosen once per run and passed at construction.

A run builds one EngineConfig (the trainer from its configuration, a tool from its flags, or
`EngineConfig.from_env()`) and hands it to `load_step` / `prepare_step` (the Step keeps it for
every layer), to `coalesced_attention(engine=...)` and to `local_attention(engine=...)`. Nothing
in the engine reads the environment on its own: `from_env` is the one place the documented
overrides are read.

    ZELLIGE_ATTENTION_MERGE=auto|groups|ragged   merge
    ZELLIGE_ATTENTION_BACKEND=NAME               backend (a name of runtime.KERNELS)
    ZELLIGE_ATTENTION_STREAMS=1..8               streams
    ZELLIGE_ATTENTION_KEY_SPLIT=N                key_split (0: off)
    ZELLIGE_ATTENTION_CALLS=FILE                 call_table
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass

from zellige.runtime.kernels import KERNELS

MERGE_CHOICES = ("auto", "groups", "ragged")
MAX_STREAMS = 8


@dataclass(kw_only=True, frozen=True, slots=True)
class EngineConfig:
    """The attention engine's choices (docs/formats.md, runtime/backends.py).

    merge: "auto" (one ragged call where a trusted ragged kernel runs the table, else padded
        merges where the device's measured call table says they pay, else dense groups),
        "groups" (dense calls only) or "ragged" (one ragged call wherever a checked ragged kernel
        exists).
    backend: a dense kernel of KERNELS, or None for the first that passes its check.
    streams: CUDA streams a table's dense calls spread over; None: the call table's count.
    key_split: least key count of a group whose forward splits at a multiple of 128 keys;
        0 off; None: the call table's value.
    call_table: a measured call table (JSON) for this device; None: the one shipped for the
        device's model, if any (runtime/merging.py).
    contiguous_kernel_inputs: hand the step's dense kernels contiguous copies of their inputs
        (a workaround for kernels that mishandle strided views; one copy per call)."""

    merge: str = "auto"
    backend: str | None = None
    streams: int | None = None
    key_split: int | None = None
    call_table: str | None = None
    contiguous_kernel_inputs: bool = False

    def __post_init__(self) -> None:
        if self.merge not in MERGE_CHOICES:
            raise ValueError(
                f"unknown attention merge '{self.merge}' (allowed: {', '.join(MERGE_CHOICES)})"
            )
        if self.backend is not None and self.backend not in KERNELS:
            raise ValueError(
                f"unknown attention backend '{self.backend}' (allowed: {', '.join(KERNELS)})"
            )
        if self.streams is not None and not (
            isinstance(self.streams, int) and 1 <= self.streams <= MAX_STREAMS
        ):
            raise ValueError(
                f"streams must be an integer from 1 to {MAX_STREAMS}, got {self.streams!r}"
            )
        if self.key_split is not None and not (
            isinstance(self.key_split, int) and self.key_split >= 0
        ):
            raise ValueError(
                f"key_split must be a number of key tokens >= 0, got {self.key_split!r}"
            )

    def replace(self, **changes) -> EngineConfig:
        """A copy with `changes` (validated again)."""
        return dataclasses.replace(self, **changes)

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> EngineConfig:
        """The defaults with the ZELLIGE_ATTENTION_* overrides of `environ` (default: the
        process environment) applied; ValueError naming the variable for a bad value."""
        env = os.environ if environ is None else environ
        merge = env.get("ZELLIGE_ATTENTION_MERGE") or "auto"
        if merge not in MERGE_CHOICES:
            raise ValueError(
                f"ZELLIGE_ATTENTION_MERGE='{merge}' is not a merge policy "
                f"(allowed: {', '.join(MERGE_CHOICES)})"
            )
        streams = env.get("ZELLIGE_ATTENTION_STREAMS") or None
        if streams is not None and not (streams.isdigit() and 1 <= int(streams) <= MAX_STREAMS):
            raise ValueError(
                f"ZELLIGE_ATTENTION_STREAMS must be an integer from 1 to {MAX_STREAMS}, "
                f"got '{streams}'"
            )
        key_split = env.get("ZELLIGE_ATTENTION_KEY_SPLIT") or None
        if key_split is not None and not key_split.isdigit():
            raise ValueError(
                f"ZELLIGE_ATTENTION_KEY_SPLIT must be a key count >= 0 (0: off), got '{key_split}'"
            )
        return EngineConfig(
            merge=merge,
            backend=env.get("ZELLIGE_ATTENTION_BACKEND") or None,
            streams=None if streams is None else int(streams),
            key_split=None if key_split is None else int(key_split),
            call_table=env.get("ZELLIGE_ATTENTION_CALLS") or None,
        )
