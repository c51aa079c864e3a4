"""Training configurations: typed, thin, built by named functions. The CLI maps flags onto them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from zellige.model import DiTConfig, model_preset

H200_BF16_DENSE_FLOPS_PER_S = 989e12  # NVIDIA's dense bf16 tensor-core peak for the H200 SXM


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    name: str
    model: DiTConfig
    recipe: str  # a recipe of shared/workloads/recipes.json, or "tiny" (zellige.data.TINY_RECIPE)
    planner: str = "zellige"  # any name zellige.make_plan accepts
    steps: int = 100
    seed: int = 0
    device: str = "cpu"  # "cpu" or "cuda"
    backend: str = "gloo"  # "gloo" or "nccl"
    dtype: str = "float32"  # parameters and activations: "float64", "float32" or "bfloat16"
    gpus_per_node: int = 8  # cluster shape the planner's cost model assumes
    profile: str | None = None  # hardware profile JSON; None: the built-in H200 profile
    activation_checkpointing: bool = True
    # with activation_checkpointing: each rank checkpoints, per step, only the first blocks its
    # predicted memory needs (the plan's rank_checkpointed_layers); False: every block
    adaptive_checkpointing: bool = True
    # torch.compile the blocks' per-token layers (norms, modulation, RoPE, projections, FFN);
    # None: on CUDA only
    compile_elementwise: bool | None = None
    sync_debug: bool = False  # CUDA: warn at each host sync from step start to optimizer step
    learning_rate: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip_norm: float = 1.0
    checkpoint_every: int = 0  # steps between checkpoints under --out; 0: at the end only
    loader_workers: int = 1  # processes that load data and plan ahead; 0: in the main process
    peak_flops_per_s: float | None = None  # per device, for MFU; None: MFU not reported


def tiny_cpu() -> TrainConfig:
    """Seconds per step on two CPU cores with gloo: CI and the README's first command."""
    return TrainConfig(
        name="tiny-cpu",
        model=model_preset("tiny-cpu"),
        recipe="tiny",
        steps=50,
        learning_rate=3e-3,
        warmup_steps=5,
        gpus_per_node=2,
        activation_checkpointing=False,
    )


def wan1p3b_h200() -> TrainConfig:
    """Wan 1.3B on H200s with 480p images and 5 s 480p clips (wan-stage2), bf16, NCCL."""
    return TrainConfig(
        name="wan1p3b-h200",
        model=model_preset("wan-1.3b"),
        recipe="wan-stage2",
        device="cuda",
        backend="nccl",
        dtype="bfloat16",
        peak_flops_per_s=H200_BF16_DENSE_FLOPS_PER_S,
        warmup_steps=100,
    )


def wan14b_h200x8() -> TrainConfig:
    """Wan 14B on one node of 8 H200s with 720p images and 5 s 720p clips (wan-stage3)."""
    return TrainConfig(
        name="wan14b-h200x8",
        model=model_preset("wan-14b"),
        recipe="wan-stage3",
        device="cuda",
        backend="nccl",
        dtype="bfloat16",
        peak_flops_per_s=H200_BF16_DENSE_FLOPS_PER_S,
        warmup_steps=100,
    )


def wan14b_width_h200() -> TrainConfig:
    """Wan 14B's layer shapes with 4 of its 40 layers, so one H200 holds weights, optimizer state
    and activations of the wan-stage2 mix: per-layer throughput and MFU of the 14B width."""
    return dataclasses.replace(
        wan14b_h200x8(),
        name="wan14b-width-h200",
        model=model_preset("wan-14b", num_layers=4),
        recipe="wan-stage2",
    )


def _e2e_h200x8(name: str, model: DiTConfig, recipe: str) -> TrainConfig:
    """The planner comparison of bench/e2e_compare.py on one node of 8 H200s: the whole step's
    batch of the recipe (lengths spread about 300x), so placement decides the step time."""
    return dataclasses.replace(wan14b_h200x8(), name=name, model=model, recipe=recipe)


def wan1p3b_opensora2_stage2_h200x8() -> TrainConfig:
    """Wan 1.3B on Open-Sora 2.0 stage-2 buckets (256px and 768px, 1-129 frames)."""
    return _e2e_h200x8(
        "wan1p3b-opensora2-stage2-h200x8", model_preset("wan-1.3b"), "opensora2-stage2"
    )


def wan1p3b_wan_stage3_h200x8() -> TrainConfig:
    """Wan 1.3B on Wan stage-3 batches (720p images with 5 s 720p clips)."""
    return _e2e_h200x8("wan1p3b-wan-stage3-h200x8", model_preset("wan-1.3b"), "wan-stage3")


def wan14b_width_opensora2_stage2_h200x8() -> TrainConfig:
    """Wan 14B's layer shapes with 4 of its 40 layers (as wan14b-width-h200), so each planner's
    run of 23 steps takes minutes, on Open-Sora 2.0 stage-2 buckets."""
    return _e2e_h200x8(
        "wan14b-width-opensora2-stage2-h200x8",
        model_preset("wan-14b", num_layers=4),
        "opensora2-stage2",
    )


def wan14b_width_wan_stage3_h200x8() -> TrainConfig:
    """Wan 14B's layer shapes with 4 layers on Wan stage-3 batches."""
    return _e2e_h200x8(
        "wan14b-width-wan-stage3-h200x8", model_preset("wan-14b", num_layers=4), "wan-stage3"
    )


CONFIGS: dict[str, Callable[[], TrainConfig]] = {
    "tiny-cpu": tiny_cpu,
    "wan1p3b-h200": wan1p3b_h200,
    "wan14b-h200x8": wan14b_h200x8,
    "wan14b-width-h200": wan14b_width_h200,
    "wan1p3b-opensora2-stage2-h200x8": wan1p3b_opensora2_stage2_h200x8,
    "wan1p3b-wan-stage3-h200x8": wan1p3b_wan_stage3_h200x8,
    "wan14b-width-opensora2-stage2-h200x8": wan14b_width_opensora2_stage2_h200x8,
    "wan14b-width-wan-stage3-h200x8": wan14b_width_wan_stage3_h200x8,
}


def get_config(name: str) -> TrainConfig:
    key = name.replace("_", "-")
    if key not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; allowed: {', '.join(CONFIGS)}")
    return CONFIGS[key]()
