"""Building a cost model from names: model preset, GPU count, profile file, link class."""

from __future__ import annotations

from pathlib import Path

from zellige._core import (
    CostModel,
    CostOptions,
    HardwareProfile,
    ModelSpec,
    make_cluster,
)
from zellige.model_spec import resolve_model
from zellige.profile import load_profile


def default_gpus_per_node(gpus: int) -> int:
    """8 GPUs per node (an H200 node), or all of them when there are fewer."""
    return min(8, gpus) if gpus > 0 else 8


def make_cost_model(
    model: str | Path | ModelSpec = "mmdit-11b",
    gpus: int = 8,
    gpus_per_node: int | None = None,
    profile: str | Path | HardwareProfile | None = None,
    links: str = "nvlink",
    activation_checkpointing: bool = True,
    adaptive_checkpointing: bool = False,
    weights_kept_to_backward: bool = False,
    gradient_bytes_per_param: float = 4.0,
    optimizer_copy_bytes_per_param: float = 0.0,
) -> CostModel:
    """A CostModel for `gpus` GPUs of `gpus_per_node` each (default: 8, or `gpus` when fewer).
    `profile` is a profile JSON path, a HardwareProfile, or None for the built-in H200 profile.
    `model` is a preset name, a model spec file or a ModelSpec (zellige.resolve_model).
    adaptive_checkpointing: each rank checkpoints only the layers its memory needs (the plan's
    predicted rank_checkpointed_layers). weights_kept_to_backward: training keeps each block's
    gathered weights from its forward to its backward (zellige.train on one rank).
    gradient_bytes_per_param: what a parameter's gradient holds (4: fp32; 2: training that
    keeps the backward's bf16 gradients), part of the 16 bytes of state a parameter.
    optimizer_copy_bytes_per_param: what the optimizer step writes beside the state (2: one
    rank's copying AdamW makes the next forward's bf16 weights while the gradients are held).
    Raises ValueError for an unknown model or link class, a bad cluster shape or profile."""
    spec = resolve_model(model)
    if gpus_per_node is None:
        gpus_per_node = default_gpus_per_node(gpus)
    cluster = make_cluster(gpus, gpus_per_node, links)
    hardware = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    options = CostOptions()
    options.activation_checkpointing = activation_checkpointing
    options.adaptive_checkpointing = adaptive_checkpointing
    options.weights_kept_to_backward = weights_kept_to_backward
    options.state_bytes_per_param += gradient_bytes_per_param - options.gradient_bytes_per_param
    options.gradient_bytes_per_param = gradient_bytes_per_param
    options.optimizer_copy_bytes_per_param = optimizer_copy_bytes_per_param
    return CostModel(spec, hardware, cluster, options)
