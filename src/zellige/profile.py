"""Hardware profiles as JSON: load, validate, save.

A profile file mirrors zellige._core.HardwareProfile field by field; each table is an object
{"source": "measured" | "seeded" | "analytic", "x": [...], "y": [...]} (lists of tables for the
attention call tables and the exchange tables). The built-in profile (profiles/h200.json) was
measured on one H200 by `zellige profile` (bench/results/profile_h200_202611.md).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from zellige._core import HardwareProfile, Table
from zellige._files import write_output
from zellige._json import parse_json, read_text

BUILTIN_PROFILE = "h200"
# Built-in profiles by name, each with the GPU name it was measured on (what a device's name
# must contain for builtin_profile_for_device to pick it).
BUILTIN_PROFILES = {"h200": "H200", "h100": "H100"}

_TABLE_FIELDS = (
    "attention_forward_s_per_head",
    "attention_backward_s_per_head",
    "matmul_forward_flops_per_s",
    "matmul_backward_flops_per_s",
)
_REQUIRED_NUMBERS = ("matmul_flops_per_s", "attention_flops_per_s", "memory_bytes_per_s")
_OPTIONAL_NUMBERS = (
    "exchange_overlap",
    "ulysses_layout_s_per_byte",
    "ring_layout_s_per_byte",
    "attention_stream_overlap",
)
# Rows of numbers, one per model in memory_models (the optional ones may be empty).
MODEL_ROWS = (
    "activation_bytes_per_token_layer",
    "checkpoint_bytes_per_token_layer",
    "backward_bytes_per_token_layer",
    "text_bytes_per_token_layer",
    "step_fixed_bytes",
    "reduce_fixed_bytes",
    "reduce_bytes_per_token",
    "ulysses_bytes_per_token",
    "ulysses_exchanged_bytes_per_token",
    "ring_bytes_per_token",
    "attention_phase_bytes_per_token",
    "launch_s_per_layer",
    "launch_s_per_attention_call",
)
# Tables per model in memory_models (empty, or one each; an empty table: the shared one).
MODEL_TABLES = (
    "model_matmul_forward_flops_per_s",
    "model_matmul_backward_flops_per_s",
    "backward_peak_bytes",
)
_TABLE_LISTS = (
    "exchange_intra_node_s",
    "attention_call_forward_s",
    "attention_call_backward_s",
    *MODEL_TABLES,
)
_INTEGERS = (
    "attention_head_dim",
    "runtime_reserved_bytes",
    "device_memory_bytes",
    "attention_streams",
)
_STRINGS = ("device_name", "created")
_BOOLEANS = ("attention_ragged",)
_FIELDS = (
    "device_name",
    "created",
    *_REQUIRED_NUMBERS,
    "attention_head_dim",
    *_TABLE_FIELDS,
    "attention_call_lengths",
    "attention_call_forward_s",
    "attention_call_backward_s",
    "attention_streams",
    "attention_stream_overlap",
    "attention_ragged",
    "exchange_group_sizes",
    "exchange_intra_node_s",
    "exchange_overlap",
    "ulysses_layout_s_per_byte",
    "ring_layout_s_per_byte",
    "memory_models",
    *MODEL_ROWS,
    *MODEL_TABLES,
    "runtime_reserved_bytes",
    "device_memory_bytes",
)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def _integer(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where} must be an integer, got {value!r}")
    return value


def _list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list, got {type(value).__name__}")
    return value


def _table(value: Any, where: str) -> Table:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object with source, x and y")
    unknown = set(value) - {"source", "x", "y"}
    if unknown:
        raise ValueError(f"{where} has unknown keys {sorted(unknown)} (allowed: source, x, y)")
    table = Table()
    table.x = [
        _number(v, f"{where}.x[{i}]") for i, v in enumerate(_list(value.get("x", []), where))
    ]
    table.y = [
        _number(v, f"{where}.y[{i}]") for i, v in enumerate(_list(value.get("y", []), where))
    ]
    source = value.get("source", "analytic")
    if not isinstance(source, str):
        raise ValueError(f"{where}.source must be a string")
    table.source = source
    return table


def profile_from_dict(data: Any) -> HardwareProfile:
    """Builds and validates a profile from its JSON object; raises ValueError (one line)."""
    if not isinstance(data, dict):
        raise ValueError("a profile must be a JSON object")
    unknown = set(data) - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown profile keys {sorted(unknown)}")
    missing = [key for key in ("device_name", *_REQUIRED_NUMBERS) if key not in data]
    if missing:
        raise ValueError(f"profile is missing {', '.join(missing)}")
    profile = HardwareProfile()
    for key in _STRINGS:
        if key in data:
            if not isinstance(data[key], str):
                raise ValueError(f"{key} must be a string")
            setattr(profile, key, data[key])
    for key in (*_REQUIRED_NUMBERS, *_OPTIONAL_NUMBERS):
        if key in data:
            setattr(profile, key, _number(data[key], key))
    for key in _INTEGERS:
        if key in data:
            setattr(profile, key, _integer(data[key], key))
    for key in _BOOLEANS:
        if key in data:
            if not isinstance(data[key], bool):
                raise ValueError(f"{key} must be true or false, got {data[key]!r}")
            setattr(profile, key, data[key])
    for key in _TABLE_FIELDS:
        if key in data:
            setattr(profile, key, _table(data[key], key))
    profile.exchange_group_sizes = [
        _integer(v, f"exchange_group_sizes[{i}]")
        for i, v in enumerate(_list(data.get("exchange_group_sizes", []), "exchange_group_sizes"))
    ]
    for key in _TABLE_LISTS:
        tables = _list(data.get(key, []), key)
        setattr(profile, key, [_table(v, f"{key}[{i}]") for i, v in enumerate(tables)])
    lengths = _list(data.get("attention_call_lengths", []), "attention_call_lengths")
    profile.attention_call_lengths = [
        _number(v, f"attention_call_lengths[{i}]") for i, v in enumerate(lengths)
    ]
    models = _list(data.get("memory_models", []), "memory_models")
    if not all(isinstance(name, str) for name in models):
        raise ValueError("memory_models must be a list of model names")
    profile.memory_models = models
    for key in MODEL_ROWS:
        values = _list(data.get(key, []), key)
        setattr(profile, key, [_number(v, f"{key}[{i}]") for i, v in enumerate(values)])
    profile.validate()  # std::invalid_argument -> ValueError
    return profile


def builtin_profile_for_device(device_name: str) -> tuple[str, str | None]:
    """The built-in profile for a GPU of this name (torch.cuda.get_device_name), and a one-line
    note where none was measured on such a GPU (the H200's is used; its times are not this
    device's, and `zellige profile` measures it). The memory capacity still comes from the
    device the run is on (costs.device_memory_bytes)."""
    for name, gpu in BUILTIN_PROFILES.items():
        if gpu.lower() in device_name.lower():
            return name, None
    return BUILTIN_PROFILE, (
        f"no built-in profile was measured on a {device_name}: planning with the H200's times "
        "(zellige profile measures this GPU; --profile FILE uses it)"
    )


def _table_to_dict(table: Table) -> dict[str, Any]:
    return {"source": table.source, "x": list(table.x), "y": list(table.y)}


def profile_to_dict(profile: HardwareProfile) -> dict[str, Any]:
    """The JSON object of a profile (inverse of profile_from_dict)."""
    data: dict[str, Any] = {}
    for key in _FIELDS:
        value = getattr(profile, key)
        if key in _TABLE_FIELDS:
            value = _table_to_dict(value)
        elif key in _TABLE_LISTS:
            value = [_table_to_dict(table) for table in value]
        elif isinstance(value, list):
            value = list(value)
        data[key] = value
    return data


def _dumps(data: dict[str, Any]) -> str:
    # One key per line, lists of numbers kept on one line so tables stay readable.
    lines = []
    for key, value in data.items():
        lines.append(f"  {json.dumps(key)}: {json.dumps(value, allow_nan=False)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def save_profile(profile: HardwareProfile, path: str | Path) -> None:
    """Writes the profile as JSON (validated first), atomically: a temporary file renamed over
    `path`."""
    profile.validate()
    write_output(path, _dumps(profile_to_dict(profile)))


def priced_as_engine_runs(
    profile: HardwareProfile, attention_ragged: bool, say: Callable[[str], None] | None = None
) -> HardwareProfile:
    """`profile` as the cost model must read it for a run whose attention engine runs ragged
    calls or not (`attention_ragged`: zellige.runtime.coalesced.engine_runs_ragged on the run's
    device): a copy with that value, and one line to `say` where it differs from the file's. The
    profile's tables stay: the per-head tables price a ragged call (docs/formats.md)."""
    if profile.attention_ragged == attention_ragged:
        return profile
    matched = profile_from_dict(profile_to_dict(profile))
    matched.attention_ragged = attention_ragged
    if say is not None:
        say(
            "cost model: the attention engine here runs "
            + (
                "a table of several short sequences as one ragged call (cuDNN frontend), so "
                "the profile's attention is priced that way (attention_ragged: true; the "
                "profile says false)"
                if attention_ragged
                else "dense calls only, so the profile's attention is priced as dense calls "
                "(attention_ragged: false; the profile says true)"
            )
        )
    return matched


def load_profile(path: str | Path | None = None) -> HardwareProfile:
    """Reads a profile JSON file; a built-in profile's name ("h200", "h100"; where no file of
    that name exists) or None (the H200's) gives a built-in profile. Raises ValueError with a
    one-line message for a missing, malformed or invalid file."""
    name = BUILTIN_PROFILE if path is None else str(path)
    if name in BUILTIN_PROFILES and (path is None or not Path(path).exists()):
        source = resources.files("zellige") / "profiles" / f"{name}.json"
        text = source.read_text()
        where = f"built-in profile {name}"
    else:
        where = f"profile {path}"
        text = read_text(path)  # size-capped; its errors name the path
    data = parse_json(text, where)  # deep nesting, NaN and Infinity are refused too
    try:
        return profile_from_dict(data)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
