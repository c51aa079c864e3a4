"""The bridge between the planning core's model presets and the runnable reference DiT."""

from __future__ import annotations

import dataclasses

from zellige import _core
from zellige.model.config import DiTConfig
from zellige.model.config import model_preset as dit_preset

# Core preset -> zellige.model preset of the same sizes (the core's "tiny" is the CPU test size).
_RUNNABLE = {"wan-1.3b": "wan-1.3b", "wan-14b": "wan-14b", "tiny": "tiny-cpu"}


def runnable_model_names() -> list[str]:
    return list(_RUNNABLE)


def dit_config(model: str, num_layers: int | None = None) -> DiTConfig:
    """The reference DiT of core preset `model` (Wan-style models only: the MMDiT presets have
    no runnable model in zellige.model)."""
    if model not in _RUNNABLE:
        raise ValueError(
            f"model '{model}' has no runnable reference DiT (allowed: {', '.join(_RUNNABLE)})"
        )
    config = dit_preset(_RUNNABLE[model])
    return config if num_layers is None else dataclasses.replace(config, num_layers=num_layers)


def model_spec(model: str, num_layers: int | None = None) -> _core.ModelSpec:
    """The core's spec of `model`, cut to `num_layers` layers (parameters scaled alike)."""
    spec = _core.model_preset(model)
    if num_layers is not None:
        if num_layers <= 0 or num_layers > spec.num_layers:
            raise ValueError(f"num_layers must be in 1..{spec.num_layers} for {model}")
        spec.param_count = spec.param_count * num_layers // spec.num_layers
        spec.num_layers = num_layers
    return spec
