"""The bridge between the planning core's model presets and the runnable reference models."""

from __future__ import annotations

import torch

from zellige import _core
from zellige.model.config import DiTConfig, with_layers
from zellige.model.config import model_preset as dit_preset

# Core preset -> zellige.model preset of the same sizes (the core's "tiny" is the CPU test size).
# Wan-style presets run VideoDiT blocks, the MMDiT presets (joint attention) MMDiT blocks.
_RUNNABLE = {
    "wan-1.3b": "wan-1.3b",
    "wan-14b": "wan-14b",
    "mmdit-11b": "mmdit-11b",
    "hunyuan-13b": "hunyuan-13b",
    "tiny": "tiny-cpu",
    "mmdit-tiny": "mmdit-tiny-cpu",
}


def runnable_model_names() -> list[str]:
    return list(_RUNNABLE)


def quick_model(model: str) -> str:
    """The preset a --quick (CPU smoke) run measures for `model`: the tiny preset of the same
    kind ("tiny" for a Wan-style model, "mmdit-tiny" for a joint-attention one), so the run
    goes through the same blocks, runtime and cost model in seconds, with numbers that mean
    nothing (as every quick run's)."""
    return "mmdit-tiny" if _core.model_preset(model).joint_attention else "tiny"


def dit_config(model: str, num_layers: int | None = None) -> DiTConfig:
    """The reference model of core preset `model`, cut to `num_layers` blocks (an MMDiT keeps
    its share of double-stream blocks: model.config.with_layers)."""
    if model not in _RUNNABLE:
        raise ValueError(
            f"model '{model}' has no runnable reference model (allowed: {', '.join(_RUNNABLE)})"
        )
    config = dit_preset(_RUNNABLE[model])
    return config if num_layers is None else with_layers(config, num_layers)


def model_spec(model: str, num_layers: int | None = None) -> _core.ModelSpec:
    """The core's spec of `model`, cut to `num_layers` layers. Parameters scale with the layers
    for Wan-style models; an MMDiT's cut keeps double and single blocks as dit_config does and
    counts its blocks' weight matrices (what the preset counts)."""
    spec = _core.model_preset(model)
    if num_layers is not None:
        if num_layers <= 0 or num_layers > spec.num_layers:
            raise ValueError(f"num_layers must be in 1..{spec.num_layers} for {model}")
        if spec.joint_attention:
            config = dit_config(model, num_layers)
            spec.num_double_layers = config.num_double_layers
            spec.param_count = block_matrix_params(config)
        else:
            spec.param_count = spec.param_count * num_layers // spec.num_layers
        spec.num_layers = num_layers
    return spec


def block_matrix_params(config: DiTConfig) -> int:
    """Weight-matrix parameters of the model's blocks (no biases or norms), as the planning
    core's presets count them (cpp/src/model_spec.cc)."""
    from zellige.model import build_model

    with torch.device("meta"):
        blocks = build_model(config).blocks
    return sum(m.weight.numel() for m in blocks.modules() if isinstance(m, torch.nn.Linear))
