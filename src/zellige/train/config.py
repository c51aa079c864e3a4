"""Training configurations: typed, thin, built by named functions. A TOML file and the command
line override their fields (resolve_config), as torchtitan's job files do."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zellige._core import MAX_GPUS
from zellige._json import read_toml
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
    # torch.compile the model's work outside its blocks (RoPE tables, output head, loss);
    # None: as compile_elementwise
    compile_outside: bool | None = None
    # the one-hot GEMMs that expand per-sequence modulation to tokens get a sequence count
    # padded to a multiple of 8 (aligned bf16 rows; conditioning.per_token); False: unpadded
    pad_sequence_rows: bool = True
    # the per-token modulation's pieces (shift, scale, gate) each made by a one-hot GEMM of its
    # own, so the backward stacks no [T, K, D] gradient (conditioning.per_token_pieces)
    split_modulation: bool = False
    # the Wan output head reads each token's shift and scale from its sequence's rows inside its
    # compiled region: no [T, 2, D] tensor in the forward (conditioning.gathered_pieces); False:
    # per_token's one-hot GEMM makes them
    gathered_head: bool = True
    # FSDP2 frees each block's gathered bf16 weights after its forward and gathers them again
    # for its backward; None: only on more than one rank (a lone rank keeps them from its
    # forward to its backward: no second cast and copy of every weight; the cost model prices
    # the kept weights the same way)
    reshard_after_forward: bool | None = None
    # on a world of one: no FSDP (False: fp32 master weights, bf16 copies cast once per step,
    # parallelize.LoneRankWeights; measured faster on one H200), or FSDP2 as on more ranks
    fsdp_on_one_rank: bool = False
    # AdamW as one fused kernel over all parameters; None: on CUDA only
    fused_optimizer: bool | None = None
    # with a fused optimizer: the gradient clipping's scale is applied inside the optimizer's
    # kernel (its grad_scale), not by a pass of its own over the gradients
    clip_in_optimizer: bool = True
    # on a world of one without FSDP: AdamW's update also writes the next forward's bf16 copies
    # of the weights, in the same compiled pass (train.optimizer.CopyingAdamW; no cast at the
    # forward's start); False: torch's AdamW, and the forward casts; None: on CUDA in bf16
    copying_optimizer: bool | None = None
    # with the copying optimizer: the backward's bf16 gradients go to it as they are (no fp32
    # gradients, no cast; their norm taken as each arrives; the cost model prices 2 bytes);
    # None: wherever the copying optimizer runs
    compute_dtype_gradients: bool | None = None
    # with the copying optimizer compiled by inductor: its kernels' launch configurations are
    # chosen by timing candidates on the device at compile time (CopyingAdamW tuned=True)
    tune_optimizer_kernels: bool = False
    sync_debug: bool = False  # CUDA: warn at each host sync from step start to optimizer step
    # a step's metrics (loss, grad norm, times) are read while the next step runs: the host
    # issues step N+1's forward and backward before it waits for step N's values, and checks them
    # before N+1's optimizer step (loop._run_step); False: each step ends with a full sync
    metrics_one_step_late: bool = True
    # Python's objects are collected and frozen at the start and after each step that compiled,
    # so a full garbage collection in a step walks only that step's objects, not torch.compile's
    # (loop.QuietCollector); False: Python's automatic collections as they come
    freeze_gc: bool = True
    learning_rate: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0
    grad_clip_norm: float = 1.0
    checkpoint_every: int = 0  # steps between checkpoints under --out; 0: at the end only
    loader_workers: int = 1  # processes that load data and plan ahead; 0: in the main process
    peak_flops_per_s: float | None = None  # per device, for MFU; None: MFU not reported
    # loader ranks each step's batch is drawn for; None: the world size of the first run (a
    # resumed run takes the checkpoint's, so the data stream does not change with the world size)
    data_ranks: int | None = None
    timeout_s: float = 600.0  # a collective that waits longer fails the run (a stuck rank)
    # --- dataset options ---
    # a latent dataset directory (zellige encode) the steps' batches and latents come from; None:
    # the recipe's synthetic latents
    data_dir: str | None = None


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


def mmdit_tiny_cpu() -> TrainConfig:
    """tiny-cpu's run with the MMDiT (joint text-visual attention) at the same sizes."""
    return dataclasses.replace(
        tiny_cpu(), name="mmdit-tiny-cpu", model=model_preset("mmdit-tiny-cpu")
    )


def _mmdit_width_h200(name: str, preset: str) -> TrainConfig:
    """An MMDiT preset's layer shapes with 6 of its blocks (2 double-stream, 4 single-stream:
    the presets' 1:2 share), so one H200 holds weights, optimizer state and the activations of
    Open-Sora 2.0 stage-2 micro-batches (up to 129 frames at 768px): per-layer throughput and
    MFU of the width, next to wan14b-width-h200."""
    return dataclasses.replace(
        wan14b_h200x8(),
        name=name,
        model=model_preset(preset, num_layers=6, num_double_layers=2),
        recipe="opensora2-stage2",
    )


def mmdit11b_width_h200() -> TrainConfig:
    """FLUX / Open-Sora 2.0 width (3072, 24 heads, 512 text tokens) on one H200."""
    return _mmdit_width_h200("mmdit11b-width-h200", "mmdit-11b")


def hunyuan13b_width_h200() -> TrainConfig:
    """HunyuanVideo width (3072, 24 heads, 256 text tokens) on one H200."""
    return _mmdit_width_h200("hunyuan13b-width-h200", "hunyuan-13b")


CONFIGS: dict[str, Callable[[], TrainConfig]] = {
    "tiny-cpu": tiny_cpu,
    "wan1p3b-h200": wan1p3b_h200,
    "wan14b-h200x8": wan14b_h200x8,
    "wan14b-width-h200": wan14b_width_h200,
    "wan1p3b-opensora2-stage2-h200x8": wan1p3b_opensora2_stage2_h200x8,
    "wan1p3b-wan-stage3-h200x8": wan1p3b_wan_stage3_h200x8,
    "wan14b-width-opensora2-stage2-h200x8": wan14b_width_opensora2_stage2_h200x8,
    "wan14b-width-wan-stage3-h200x8": wan14b_width_wan_stage3_h200x8,
    "mmdit-tiny-cpu": mmdit_tiny_cpu,
    "mmdit11b-width-h200": mmdit11b_width_h200,
    "hunyuan13b-width-h200": hunyuan13b_width_h200,
}


def get_config(name: str) -> TrainConfig:
    key = name.replace("_", "-")
    if key not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; allowed: {', '.join(CONFIGS)}")
    return CONFIGS[key]()


# --- TOML files and command-line overrides -----------------------------------------------------

# Each overridable field: (kind, help). The model is a preset name or a [model] table.
FIELD_HELP = {
    "recipe": "workload recipe of the batches (a recipes.json name, or tiny)",
    "planner": "zellige, dp-tokens, dp-cost, static-cp:C, knapformer:SPEC[:GAMMA], megatron-dcp",
    "steps": "total steps, resumed ones included (>= 1)",
    "seed": "seed of the model's initialisation and of every step's data (>= 0)",
    "device": "cpu or cuda",
    "backend": "gloo or nccl",
    "dtype": "float64, float32 or bfloat16",
    "gpus_per_node": "cluster shape the planner's cost model assumes",
    "profile": "hardware profile JSON for the cost model (default: the built-in H200 profile)",
    "activation_checkpointing": "recompute each block in backward",
    "adaptive_checkpointing": "checkpoint only the blocks each rank's predicted memory needs",
    "compile_elementwise": "torch.compile the blocks' per-token layers (default: on CUDA only)",
    "reshard_after_forward": "free gathered weights after the forward (default: on >1 rank)",
    "fsdp_on_one_rank": "FSDP2 also on one rank (default: fp32 masters, bf16 copies per step)",
    "compile_outside": "torch.compile RoPE tables, output head and loss (default: as the blocks)",
    "pad_sequence_rows": "pad the per-token modulation's one-hot GEMM to 8 sequences (aligned)",
    "split_modulation": "one one-hot GEMM per modulation piece (no stack in the backward)",
    "gathered_head": "the Wan output head gathers its shift and scale rows in its region",
    "fused_optimizer": "AdamW as one fused kernel (default: on CUDA only)",
    "clip_in_optimizer": "a fused optimizer applies the gradient clipping's scale itself",
    "copying_optimizer": "one rank: AdamW writes the bf16 weight copies (default: CUDA bf16)",
    "compute_dtype_gradients": "with the copying optimizer: it reads the bf16 gradients",
    "tune_optimizer_kernels": "time launch configurations of the copying optimizer's kernels",
    "sync_debug": "CUDA: warn at each host sync from step start to the optimizer step",
    "metrics_one_step_late": "read a step's metrics during the next step (no sync between steps)",
    "freeze_gc": "freeze Python's objects after compiling steps (full GCs in steps stay short)",
    "learning_rate": "AdamW peak learning rate",
    "betas": "AdamW betas (TOML only: a list of two numbers)",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear warm-up steps of the learning rate",
    "grad_clip_norm": "clip the gradient norm to this",
    "checkpoint_every": "steps between checkpoints under --out (0: at the end only)",
    "loader_workers": "processes that generate and plan the next steps (0: none)",
    "peak_flops_per_s": "a device's peak FLOP/s, for MFU",
    "data_ranks": "loader ranks each step's batch is drawn for (default: the world size)",
    "timeout_s": "seconds a collective may wait for the other ranks before the run fails",
    # --- dataset options ---
    "data_dir": "latent dataset directory (zellige encode; default: the recipe's synthetic data)",
}
_DTYPES = ("float64", "float32", "bfloat16")

# Limits of a run's values (docs/formats.md, "Limits", lists them with the core's): counts stay
# far inside int64 and float32, and a model that cannot be built in seconds is refused up front.
MAX_STEPS = 1 << 30
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MIN_TIMEOUT_S = 1.0  # the process group's rendezvous itself needs about this long
MAX_LOADER_WORKERS = 64
# a step's batch is drawn for data_ranks loader ranks and spread over the run's ranks: a resumed
# run may hold a few saving ranks' data each, not thousands (16,384 on one rank: out of memory)
MAX_DATA_RANKS_PER_RANK = 8
MAX_LEARNING_RATE = 1e30
# AdamW's first step moves a weight by up to learning_rate / (1 - beta1): a float32 scalar
MAX_FIRST_STEP_SIZE = 1e37
MAX_GRAD_CLIP_NORM = 1e30
MAX_WEIGHT_DECAY = 1e3
MAX_PEAK_FLOPS_PER_S = 1e18  # the profile's ceiling on rates
# [model] table: field -> (low, high), inclusive
MODEL_INT_LIMITS: dict[str, tuple[int, int]] = {
    "width": (1, 1 << 16),
    "num_layers": (1, 1 << 10),
    "num_heads": (1, 1 << 10),
    "ffn_width": (1, 1 << 18),
    "text_tokens": (0, 1 << 20),
    "text_dim": (1, 1 << 16),
    "latent_channels": (1, 1 << 10),
    "patch_t": (1, 64),
    "patch_hw": (1, 64),
    "freq_dim": (2, 1 << 16),
    "num_double_layers": (0, 1 << 10),
}
MODEL_FLOAT_LIMITS: dict[str, tuple[float, float]] = {
    "eps": (1e-30, 1.0),  # > 0: the norms divide by sqrt(mean + eps)
    "rope_theta": (2.0, 1e12),  # > 1: frequencies theta^(-k/n) must differ between channels
}
# parameters, gradients and AdamW's two moments in float32
TRAIN_BYTES_PER_PARAM = 16


def field_types() -> dict[str, str]:
    """Each overridable field's annotation as written ("int", "float | None", ...)."""
    return {f.name: str(f.type) for f in dataclasses.fields(TrainConfig) if f.name in FIELD_HELP}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The keys of a TOML run file: `config` (the named config it starts from), `model` (a preset
    name, or a table with `preset` and DiTConfig fields to replace) and any TrainConfig field.
    Raises ValueError with one line for a missing or malformed file or an unknown key."""
    values = read_toml(path)  # size-capped, depth-limited; one-line errors
    allowed = ["config", "model", *FIELD_HELP]
    for key in values:
        if key not in allowed:
            raise ValueError(f"{path}: unknown key {key!r}; allowed: {', '.join(allowed)}")
    return values


def resolve_config(
    name: str | None, file_values: dict[str, Any], overrides: dict[str, Any], source: str
) -> TrainConfig:
    """The named config (command line first, then the file's `config`), with the file's values
    and then the command line's replacing its fields; validated. `source` names the file in
    errors."""
    name = name or file_values.get("config")
    if name is None:
        raise ValueError("no config: pass --config NAME or set config = NAME in --config-file")
    if not isinstance(name, str):
        raise ValueError(f"{source}: config must be a string (a config name)")
    config = get_config(name)
    if "model" in file_values:
        config = dataclasses.replace(config, model=_model_from(file_values["model"], source))
    values = {k: v for k, v in file_values.items() if k not in ("config", "model")}
    replaced = {key: _checked(key, value, source) for key, value in values.items()}
    replaced |= {key: _checked(key, value, "command line") for key, value in overrides.items()}
    config = dataclasses.replace(config, **replaced)
    validate_config(config)
    return config


def validate_config(config: TrainConfig) -> None:
    """Raises ValueError naming the first field whose value cannot train."""
    if not isinstance(config.model, DiTConfig):
        raise ValueError("model must be a model preset or a [model] table")
    validate_model(config.model)
    checks = [
        ("steps", config.steps >= 1, "at least 1"),
        ("steps", config.steps <= MAX_STEPS, f"at most {MAX_STEPS:,}"),
        ("seed", 0 <= config.seed < 2**32, "in [0, 2**32)"),
        ("device", config.device in ("cpu", "cuda"), "cpu or cuda"),
        ("backend", config.backend in ("gloo", "nccl"), "gloo or nccl"),
        ("backend", config.backend != "nccl" or config.device == "cuda", "gloo on device cpu"),
        ("dtype", config.dtype in _DTYPES, " or ".join(_DTYPES)),
        ("gpus_per_node", config.gpus_per_node >= 1, "at least 1"),
        ("gpus_per_node", config.gpus_per_node <= MAX_GPUS, f"at most {MAX_GPUS:,}"),
        ("learning_rate", _finite(config.learning_rate) and config.learning_rate > 0, "> 0"),
        (
            "learning_rate",
            config.learning_rate <= MAX_LEARNING_RATE,
            f"at most {MAX_LEARNING_RATE:g}",
        ),
        ("betas", all(_finite(b) and 0 <= b < 1 for b in config.betas), "two numbers in [0, 1)"),
        (
            "learning_rate",
            config.learning_rate / (1 - config.betas[0]) <= MAX_FIRST_STEP_SIZE,
            f"such that learning_rate / (1 - betas[0]) is at most {MAX_FIRST_STEP_SIZE:g} (AdamW's "
            "first step size, a float32)",
        ),
        ("weight_decay", _finite(config.weight_decay) and config.weight_decay >= 0, ">= 0"),
        ("weight_decay", config.weight_decay <= MAX_WEIGHT_DECAY, f"at most {MAX_WEIGHT_DECAY:g}"),
        ("warmup_steps", config.warmup_steps >= 0, ">= 0"),
        ("warmup_steps", config.warmup_steps <= MAX_STEPS, f"at most {MAX_STEPS:,}"),
        ("grad_clip_norm", _finite(config.grad_clip_norm) and config.grad_clip_norm > 0, "> 0"),
        (
            "grad_clip_norm",
            config.grad_clip_norm <= MAX_GRAD_CLIP_NORM,
            f"at most {MAX_GRAD_CLIP_NORM:g}",
        ),
        ("checkpoint_every", config.checkpoint_every >= 0, ">= 0"),
        ("checkpoint_every", config.checkpoint_every <= MAX_STEPS, f"at most {MAX_STEPS:,}"),
        ("loader_workers", config.loader_workers >= 0, ">= 0"),
        (
            "loader_workers",
            config.loader_workers <= MAX_LOADER_WORKERS,
            f"at most {MAX_LOADER_WORKERS}",
        ),
        ("peak_flops_per_s", config.peak_flops_per_s is None or config.peak_flops_per_s > 0, "> 0"),
        (
            "peak_flops_per_s",
            config.peak_flops_per_s is None or config.peak_flops_per_s <= MAX_PEAK_FLOPS_PER_S,
            f"at most {MAX_PEAK_FLOPS_PER_S:g}",
        ),
        ("data_ranks", config.data_ranks is None or config.data_ranks >= 1, "at least 1"),
        (
            "data_ranks",
            config.data_ranks is None or config.data_ranks <= MAX_GPUS,
            f"at most {MAX_GPUS:,} (the GPU limit)",
        ),
        ("timeout_s", _finite(config.timeout_s) and config.timeout_s > 0, "> 0 seconds"),
        (
            "timeout_s",
            MIN_TIMEOUT_S <= config.timeout_s <= MAX_TIMEOUT_S,
            f"in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] seconds",
        ),
    ]
    for key, ok, allowed in checks:
        if not ok:
            raise ValueError(f"{key} must be {allowed}, got {_short(getattr(config, key))}")
    if config.device == "cpu":
        _check_fits_host_memory(config)


def check_world(config: TrainConfig, num_ranks: int) -> None:
    """The world size (torchrun's ranks) suits the config: the cost model's nodes hold
    gpus_per_node ranks each (fewer ranks than that: one node)."""
    if num_ranks > MAX_GPUS:
        raise ValueError(f"{num_ranks:,} ranks: at most {MAX_GPUS:,} (the GPU limit)")
    check_data_ranks(config.data_ranks, num_ranks, "data_ranks")
    per_node = min(config.gpus_per_node, num_ranks)
    if num_ranks % per_node:
        raise ValueError(
            f"gpus_per_node {config.gpus_per_node} does not divide the {num_ranks} ranks of this "
            "run (torchrun --nproc-per-node x nodes): pass --gpus-per-node with a divisor of "
            f"{num_ranks}"
        )


def check_data_ranks(data_ranks: int | None, num_ranks: int, what: str) -> None:
    """ValueError when each of the run's ranks would hold more than MAX_DATA_RANKS_PER_RANK
    loader ranks' data per step."""
    if data_ranks is not None and data_ranks > MAX_DATA_RANKS_PER_RANK * num_ranks:
        raise ValueError(
            f"{what} {data_ranks:,}: each step's batch is drawn for that many loader ranks, at "
            f"most {MAX_DATA_RANKS_PER_RANK} per rank of this run's {num_ranks}; run on at least "
            f"{-(-data_ranks // MAX_DATA_RANKS_PER_RANK):,} ranks"
        )


def validate_model(model: DiTConfig) -> None:
    """Raises ValueError naming the first model field outside MODEL_*_LIMITS or inconsistent
    with another (the model's own checks follow in DiTConfig)."""
    for key in (*MODEL_INT_LIMITS, *MODEL_FLOAT_LIMITS):
        _check_model_value(key, getattr(model, key))
    if model.freq_dim % 2:
        raise ValueError(
            f"model.freq_dim must be even (sine and cosine halves), got {model.freq_dim}"
        )
    if model.width % model.num_heads:
        raise ValueError(
            f"model.width {model.width} is not a multiple of model.num_heads {model.num_heads}"
        )
    if not 0 <= model.num_double_layers <= model.num_layers:
        raise ValueError(
            f"model.num_double_layers {model.num_double_layers} must be in [0, num_layers "
            f"{model.num_layers}]"
        )


def _check_model_value(key: str, value: Any) -> None:
    if key in MODEL_INT_LIMITS:
        low, high = MODEL_INT_LIMITS[key]
        if type(value) is not int or not low <= value <= high:
            raise ValueError(
                f"model.{key} must be an integer in [{low}, {high:,}], got {_short(value)}"
            )
    elif key in MODEL_FLOAT_LIMITS:
        low, high = MODEL_FLOAT_LIMITS[key]
        if not (isinstance(value, int | float) and _finite(value) and low <= value <= high):
            raise ValueError(
                f"model.{key} must be a number in [{low:g}, {high:g}], got {_short(value)}"
            )


def _check_fits_host_memory(config: TrainConfig) -> None:
    """On CPU every rank builds the whole model: refuse one whose training state cannot fit the
    machine's memory, before memory grows for minutes."""
    try:
        host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    from zellige.data.loader import param_count  # torch and the model: only where needed

    params = param_count(config.model)
    need_bytes = params * TRAIN_BYTES_PER_PARAM
    if need_bytes > host_bytes:
        raise ValueError(
            f"model {config.model.name}: {params:,} parameters need about "
            f"{need_bytes / 2**30:,.0f} GiB to train, more than this machine's "
            f"{host_bytes / 2**30:,.0f} GiB"
        )


def _short(value: Any) -> str:
    """repr for an error message: bounded, so a huge value does not flood the terminal."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _model_from(value: Any, source: str) -> DiTConfig:
    if isinstance(value, str):
        return model_preset(value)
    if not isinstance(value, dict) or not isinstance(value.get("preset"), str):
        raise ValueError(f"{source}: model must be a preset name or a table with preset = NAME")
    fields = {f.name: str(f.type) for f in dataclasses.fields(DiTConfig) if f.name != "name"}
    overrides = {}
    for key, item in value.items():
        if key == "preset":
            continue
        if key not in fields:
            raise ValueError(
                f"{source}: unknown key model.{key}; allowed: preset, {', '.join(fields)}"
            )
        overrides[key] = _typed(f"model.{key}", fields[key], item, source)
    try:
        for key, item in overrides.items():  # before DiTConfig's own checks divide by them
            _check_model_value(key, item)
        model = model_preset(value["preset"], **overrides)
        validate_model(model)
        return model
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: model: {error}") from None


def _checked(key: str, value: Any, source: str) -> Any:
    return _typed(key, field_types()[key], value, source)


def _typed(key: str, kind: str, value: Any, source: str) -> Any:
    """value as the field's type; ValueError naming key and source if it is not one."""
    optional = kind.endswith(" | None")
    base = kind.removesuffix(" | None")
    if value is None and optional:
        return None
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "bool": isinstance(value, bool),
        "tuple[float, float]": isinstance(value, list | tuple)
        and len(value) == 2
        and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value),
    }.get(base, False)
    if not ok:
        words = {"int": "an integer", "float": "a number", "str": "a string"}
        words["bool"] = "true or false"
        raise ValueError(f"{source}: {key} must be {words.get(base, base)}, got {_short(value)}")
    if base == "float":
        return float(value)
    if base.startswith("tuple"):
        return tuple(float(v) for v in value)
    return value
