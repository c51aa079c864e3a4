"""Training configurations: typed, thin, built by named functions. A TrainConfig is a few run
fields and one section per concern (model, data, parallelism, optimizer, checkpoint, metrics),
as torchtitan's job config is. A TOML file's tables and then the command line override their
fields (resolve_config); `resolved()` settles the fields whose default depends on the device."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zellige._core import MAX_GPUS
from zellige._json import read_toml
from zellige.global_batch import (
    GlobalBatchSize,
    check_global_batch_source,
    parse_global_batch_size,
)
from zellige.model import DiTConfig, model_preset
from zellige.model.config import with_layers

H200_BF16_DENSE_FLOPS_PER_S = 989e12  # NVIDIA's dense bf16 tensor-core peak for the H200 SXM


@dataclass(kw_only=True, slots=True)
class ModelSection:
    """The model's sizes and how it computes."""

    dit: DiTConfig  # sizes: a zellige.model preset, optionally with fields replaced
    dtype: str = "float32"  # parameters and activations: "float64", "float32" or "bfloat16"
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


@dataclass(kw_only=True, slots=True)
class DataSection:
    """Where each step's batch comes from."""

    recipe: str  # a recipe of shared/workloads/recipes.json, or "tiny" (zellige.data.TINY_RECIPE)
    loader_workers: int = 1  # processes that load data and plan ahead; 0: in the main process
    # loader ranks each step's batch is drawn for; None: the world size of the first run (a
    # resumed run takes the checkpoint's, so the data stream does not change with the world size)
    data_ranks: int | None = None
    # each optimizer step trains a global batch of this size ("1024" samples, "50M" tokens) as
    # the micro-batches the planner (a global-batch planner) cuts it into, with gradient
    # accumulation (docs/global-batch.md); None: one planned batch per step, as drawn
    global_batch: str | None = None
    # a latent dataset directory (zellige encode) the steps' batches and latents come from; None:
    # the recipe's synthetic latents
    data_dir: str | None = None


@dataclass(kw_only=True, slots=True)
class ParallelismSection:
    """How the step is placed on the ranks and what each rank keeps in memory."""

    planner: str = "zellige"  # any name zellige.make_plan accepts
    device: str = "cpu"  # "cpu" or "cuda"
    backend: str = "gloo"  # "gloo" or "nccl"
    gpus_per_node: int = 8  # cluster shape the planner's cost model assumes
    profile: str | None = None  # hardware profile JSON; None: the built-in profile of the GPU
    activation_checkpointing: bool = True
    # with activation_checkpointing: each rank checkpoints, per step, only the first blocks its
    # predicted memory needs (the plan's rank_checkpointed_layers); False: every block
    adaptive_checkpointing: bool = True
    # FSDP2 frees each block's gathered bf16 weights after its forward and gathers them again
    # for its backward; None: only on more than one rank (a lone rank keeps them from its
    # forward to its backward: no second cast and copy of every weight; the cost model prices
    # the kept weights the same way)
    reshard_after_forward: bool | None = None
    # on a world of one: no FSDP (False: fp32 master weights, bf16 copies cast once per step,
    # parallelize.LoneRankWeights; measured faster on one H200), or FSDP2 as on more ranks
    fsdp_on_one_rank: bool = False
    timeout_s: float = 600.0  # a collective that waits longer fails the run (a stuck rank)
    # a cluster file (docs/formats.md: nodes, their devices' profiles, memory and speeds) that
    # the cost model prices each rank with, in place of gpus_per_node alike ranks; None: alike
    cluster: str | None = None
    # plans use per-rank speed factors measured in training (zellige.train.speeds): each rank's
    # moving average of measured over predicted time
    adapt_speeds: bool = False
    # the first step (1-based) whose times are measured: earlier ones compile and warm caches
    adapt_speeds_start_step: int = 3
    # weight of the newest step in each rank's moving average, in (0, 1] (1: the last step only)
    speed_smoothing: float = 0.5


@dataclass(kw_only=True, slots=True)
class OptimizerSection:
    """AdamW, its schedule and clipping, and which implementation runs it."""

    learning_rate: float = 1e-4  # peak, after the linear warm-up
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    warmup_steps: int = 0  # steps of the learning rate's linear warm-up
    grad_clip_norm: float = 1.0  # the gradients' global 2-norm is clipped to this
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


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    """When the run saves under --out (the directory itself is a command-line flag)."""

    checkpoint_every: int = 0  # steps between checkpoints; 0: at the end only


@dataclass(kw_only=True, slots=True)
class MetricsSection:
    """What each step reports and how the loop waits for it."""

    peak_flops_per_s: float | None = None  # per device, for MFU; None: MFU not reported
    sync_debug: bool = False  # CUDA: warn at each host sync from step start to optimizer step
    # a step's metrics (loss, grad norm, times) are read while the next step runs: the host
    # issues step N+1's forward and backward before it waits for step N's values, and checks them
    # before N+1's optimizer step (loop.train_step); False: each step ends with a full sync
    metrics_one_step_late: bool = True


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    name: str
    model: ModelSection
    data: DataSection
    steps: int = 100
    seed: int = 0  # of the model's initialisation and of every step's data
    # Python's objects are collected and frozen at the start and after each step that compiled,
    # so a full garbage collection in a step walks only that step's objects, not torch.compile's
    # (QuietCollector); False: Python's automatic collections as they come
    freeze_gc: bool = True
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)

    def with_fields(self, **values: Any) -> TrainConfig:
        """A copy with fields replaced by their command-line names (learning_rate=3e-3,
        dtype="float64"), each in its section (SECTION_OF); `model` takes a DiTConfig."""
        tops, sections = {}, {}
        for key, value in values.items():
            if key == "model" and isinstance(value, DiTConfig):
                sections.setdefault("model", {})["dit"] = value
                continue
            section = SECTION_OF.get(key)
            if section is None:
                raise ValueError(f"unknown field {key!r}; allowed: {', '.join(SECTION_OF)}")
            if section:
                sections.setdefault(section, {})[key] = value
            else:
                tops[key] = value
        for section, fields in sections.items():
            tops[section] = dataclasses.replace(getattr(self, section), **fields)
        return dataclasses.replace(self, **tops)

    def resolved(self, num_ranks: int) -> TrainConfig:
        """This config with every `None` choice made for its device and a world of num_ranks,
        so the trainer reads bools: compile where CUDA runs (outside the blocks as inside),
        reshard after the forward on more than one rank, AdamW fused on CUDA and copying on
        CUDA in bf16, bf16 gradients wherever it copies. A resolved config resolves to itself."""
        model, parallelism, optimizer = self.model, self.parallelism, self.optimizer
        cuda = parallelism.device == "cuda"
        elementwise = _chosen(model.compile_elementwise, cuda)
        reshard = _chosen(parallelism.reshard_after_forward, num_ranks > 1)
        copying = _chosen(optimizer.copying_optimizer, cuda and model.dtype == "bfloat16")
        return dataclasses.replace(
            self,
            model=dataclasses.replace(
                model,
                compile_elementwise=elementwise,
                compile_outside=_chosen(model.compile_outside, elementwise),
            ),
            parallelism=dataclasses.replace(parallelism, reshard_after_forward=reshard),
            optimizer=dataclasses.replace(
                optimizer,
                fused_optimizer=_chosen(optimizer.fused_optimizer, cuda),
                copying_optimizer=copying,
                # only the copying optimizer reads the compute dtype's gradients, and not a
                # global batch's by default: its micro-batches' gradients add up in the masters'
                compute_dtype_gradients=copying
                and _chosen(optimizer.compute_dtype_gradients, self.data.global_batch is None),
            ),
        )


def _chosen(value: bool | None, default: bool) -> bool:
    return default if value is None else value


# Each section's class, in the order of the TOML file and --help
SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "parallelism": ParallelismSection,
    "optimizer": OptimizerSection,
    "checkpoint": CheckpointSection,
    "metrics": MetricsSection,
}
RUN_FIELDS = ("steps", "seed", "freeze_gc")  # TrainConfig's own settable fields
# Each settable field's name (its command-line flag, --learning-rate) -> its section ("": none)
SECTION_OF: dict[str, str] = {key: "" for key in RUN_FIELDS} | {
    f.name: section
    for section, kind in SECTIONS.items()
    for f in dataclasses.fields(kind)
    if f.name != "dit"
}


# A named config composes a model of the registry (zellige.model.MODELS, by model_preset), a
# recipe and a cluster: H200 nodes (_on_h200s) or two CPU cores (tiny_cpu).


def _on_h200s(name: str, dit: DiTConfig, recipe: str) -> TrainConfig:
    """A run on H200s: bf16 with NCCL, MFU against the H200's peak, 100 warm-up steps."""
    return TrainConfig(
        name=name,
        model=ModelSection(dit=dit, dtype="bfloat16"),
        data=DataSection(recipe=recipe),
        parallelism=ParallelismSection(device="cuda", backend="nccl"),
        optimizer=OptimizerSection(warmup_steps=100),
        metrics=MetricsSection(peak_flops_per_s=H200_BF16_DENSE_FLOPS_PER_S),
    )


def tiny_cpu() -> TrainConfig:
    """Seconds per step on two CPU cores with gloo: CI and the README's first command."""
    return TrainConfig(
        name="tiny-cpu",
        model=ModelSection(dit=model_preset("tiny-cpu")),
        data=DataSection(recipe="tiny"),
        steps=50,
        parallelism=ParallelismSection(gpus_per_node=2, activation_checkpointing=False),
        optimizer=OptimizerSection(learning_rate=3e-3, warmup_steps=5),
    )


def wan1p3b_h200() -> TrainConfig:
    """Wan 1.3B on H200s with 480p images and 5 s 480p clips (wan-stage2), bf16, NCCL."""
    return _on_h200s("wan1p3b-h200", model_preset("wan-1.3b"), "wan-stage2")


def wan14b_h200x8() -> TrainConfig:
    """Wan 14B on one node of 8 H200s with 720p images and 5 s 720p clips (wan-stage3)."""
    return _on_h200s("wan14b-h200x8", model_preset("wan-14b"), "wan-stage3")


def wan14b_width_h200() -> TrainConfig:
    """Wan 14B's layer shapes with 4 of its 40 layers, so one H200 holds weights, optimizer state
    and activations of the wan-stage2 mix: per-layer throughput and MFU of the 14B width."""
    return _on_h200s("wan14b-width-h200", model_preset("wan-14b", num_layers=4), "wan-stage2")


# The planner comparison of bench/e2e_compare.py on one node of 8 H200s: the whole step's batch
# of the recipe (lengths spread about 300x), so placement decides the step time.


def wan1p3b_opensora2_stage2_h200x8() -> TrainConfig:
    """Wan 1.3B on Open-Sora 2.0 stage-2 buckets (256px and 768px, 1-129 frames)."""
    return _on_h200s(
        "wan1p3b-opensora2-stage2-h200x8", model_preset("wan-1.3b"), "opensora2-stage2"
    )


def wan1p3b_wan_stage3_h200x8() -> TrainConfig:
    """Wan 1.3B on Wan stage-3 batches (720p images with 5 s 720p clips)."""
    return _on_h200s("wan1p3b-wan-stage3-h200x8", model_preset("wan-1.3b"), "wan-stage3")


def wan14b_width_opensora2_stage2_h200x8() -> TrainConfig:
    """Wan 14B's layer shapes with 4 of its 40 layers (as wan14b-width-h200), so each planner's
    run of 23 steps takes minutes, on Open-Sora 2.0 stage-2 buckets."""
    return _on_h200s(
        "wan14b-width-opensora2-stage2-h200x8",
        model_preset("wan-14b", num_layers=4),
        "opensora2-stage2",
    )


def wan14b_width_wan_stage3_h200x8() -> TrainConfig:
    """Wan 14B's layer shapes with 4 layers on Wan stage-3 batches."""
    return _on_h200s(
        "wan14b-width-wan-stage3-h200x8", model_preset("wan-14b", num_layers=4), "wan-stage3"
    )


def mmdit_tiny_cpu() -> TrainConfig:
    """tiny-cpu's run with the MMDiT (joint text-visual attention) at the same sizes."""
    config = tiny_cpu().with_fields(model=model_preset("mmdit-tiny-cpu"))
    return dataclasses.replace(config, name="mmdit-tiny-cpu")


def _mmdit_width_h200(name: str, preset: str) -> TrainConfig:
    """An MMDiT preset's layer shapes with 6 of its blocks (2 double-stream, 4 single-stream:
    the presets' 1:2 share), so one H200 holds weights, optimizer state and the activations of
    Open-Sora 2.0 stage-2 micro-batches (up to 129 frames at 768px): per-layer throughput and
    MFU of the width, next to wan14b-width-h200."""
    dit = model_preset(preset, num_layers=6, num_double_layers=2)
    return _on_h200s(name, dit, "opensora2-stage2")


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


def flat_fields(config: TrainConfig) -> dict[str, Any]:
    """Every settable field by its command-line name (SECTION_OF), and `model`: the DiTConfig."""
    values = {key: _value_of(config, key) for key in SECTION_OF}
    return values | {"model": config.model.dit}


def _value_of(config: TrainConfig, key: str) -> Any:
    section = SECTION_OF[key]
    return getattr(getattr(config, section) if section else config, key)


# --- TOML files and command-line overrides -----------------------------------------------------

# Each settable field's help, by its command-line name; its TOML key is the same in its section
FIELD_HELP = {
    "steps": "total steps, resumed ones included (>= 1)",
    "seed": "seed of the model's initialisation and of every step's data (>= 0)",
    "freeze_gc": "freeze Python's objects after compiling steps (full GCs in steps stay short)",
    # [model]
    "dtype": "float64, float32 or bfloat16",
    "compile_elementwise": "torch.compile the blocks' per-token layers (default: on CUDA only)",
    "compile_outside": "torch.compile RoPE tables, output head and loss (default: as the blocks)",
    "pad_sequence_rows": "pad the per-token modulation's one-hot GEMM to 8 sequences (aligned)",
    "split_modulation": "one one-hot GEMM per modulation piece (no stack in the backward)",
    "gathered_head": "the Wan output head gathers its shift and scale rows in its region",
    # [data]
    "recipe": "workload recipe of the batches (a recipes.json name, or tiny)",
    "loader_workers": "processes that generate and plan the next steps (0: none)",
    "data_ranks": "loader ranks each step's batch is drawn for (default: the world size)",
    # [parallelism]
    "planner": "zellige, dp-tokens, dp-cost, static-cp:C, knapformer:SPEC[:GAMMA], megatron-dcp",
    "device": "cpu or cuda",
    "backend": "gloo or nccl",
    "gpus_per_node": "cluster shape the planner's cost model assumes",
    "profile": "hardware profile JSON for the cost model (default: the built-in H200 profile)",
    "activation_checkpointing": "recompute each block in backward",
    "adaptive_checkpointing": "checkpoint only the blocks each rank's predicted memory needs",
    "reshard_after_forward": "free gathered weights after the forward (default: on >1 rank)",
    "fsdp_on_one_rank": "FSDP2 also on one rank (default: fp32 masters, bf16 copies per step)",
    "timeout_s": "seconds a collective may wait for the other ranks before the run fails",
    # [optimizer]
    "learning_rate": "AdamW peak learning rate",
    "betas": "AdamW betas (TOML only: a list of two numbers)",
    "weight_decay": "AdamW weight decay",
    "warmup_steps": "linear warm-up steps of the learning rate",
    "grad_clip_norm": "clip the gradient norm to this",
    "fused_optimizer": "AdamW as one fused kernel (default: on CUDA only)",
    "clip_in_optimizer": "a fused optimizer applies the gradient clipping's scale itself",
    "copying_optimizer": "one rank: AdamW writes the bf16 weight copies (default: CUDA bf16)",
    "compute_dtype_gradients": "with the copying optimizer: it reads the bf16 gradients",
    "tune_optimizer_kernels": "time launch configurations of the copying optimizer's kernels",
    # [checkpoint]
    "checkpoint_every": "steps between checkpoints under --out (0: at the end only)",
    # [metrics]
    "peak_flops_per_s": "a device's peak FLOP/s, for MFU",
    "sync_debug": "CUDA: warn at each host sync from step start to the optimizer step",
    "metrics_one_step_late": "read a step's metrics during the next step (no sync between steps)",
    # [parallelism] measured speeds and unlike ranks
    "cluster": "cluster file of unlike nodes (TOML/JSON, docs/formats.md) the plans price",
    "adapt_speeds": "plan with per-rank speed factors measured in training",
    "adapt_speeds_start_step": "first step (1-based) whose times the speed factors measure",
    "speed_smoothing": "weight of the newest step in each rank's measured speed, in (0, 1]",
    # [data] global batch
    "global_batch": "samples (1024) or latent tokens (50M) per optimizer step, run as planned "
    "micro-batches with gradient accumulation",
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
# the [model] table's DiTConfig fields (beside `preset` and ModelSection's own)
_DIT_FIELDS = {f.name: str(f.type) for f in dataclasses.fields(DiTConfig) if f.name != "name"}


def field_types() -> dict[str, str]:
    """Each settable field's annotation as written ("int", "float | None", ...), by its
    command-line name."""
    types = {f.name: str(f.type) for f in dataclasses.fields(TrainConfig)}
    for kind in SECTIONS.values():
        types |= {f.name: str(f.type) for f in dataclasses.fields(kind)}
    return {key: types[key] for key in FIELD_HELP}


def field_label(key: str) -> str:
    """A settable field as its TOML file names it: optimizer.learning_rate, steps."""
    section = SECTION_OF[key]
    return f"{section}.{key}" if section else key


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The keys of a TOML run file: `config` (the named config it starts from), the run's own
    fields (steps, seed, freeze_gc) and a table per section whose keys are that section's
    fields (`[optimizer] learning_rate = 3e-3`). `model` is a preset name or a table of
    `preset` (optional: the named config's model), DiTConfig fields to replace and
    ModelSection's fields. Raises ValueError with one line for a missing or malformed file, an
    unknown key, or a key outside its section (naming the table it belongs in)."""
    values = read_toml(path)  # size-capped, depth-limited; one-line errors
    for key, value in values.items():
        if key in SECTIONS:
            if key == "model" and isinstance(value, str):
                continue
            if not isinstance(value, dict):
                raise ValueError(f"{path}: {key} must be a table ([{key}])")
            allowed = _table_keys(key)
            for inner in value:
                if inner not in allowed:
                    raise ValueError(f"{path}: {_misplaced(inner, key, allowed)}")
        elif key not in ("config", *RUN_FIELDS):
            raise ValueError(f"{path}: {_misplaced(key, '', ['config', *RUN_FIELDS, *SECTIONS])}")
    return values


def _table_keys(section: str) -> list[str]:
    fields = [f.name for f in dataclasses.fields(SECTIONS[section]) if f.name != "dit"]
    return ["preset", *_DIT_FIELDS, *fields] if section == "model" else fields


def _misplaced(key: str, table: str, allowed: list[str]) -> str:
    """The one line for a key a table (or the file's top, table "") does not hold: where the
    key belongs when it is a field of another place, else what this place allows."""
    home = SECTION_OF.get(key)
    where = f"{table}.{key}" if table else key
    if home:
        return f"{where} is not a key there: use [{home}] {key}"
    if home == "":
        return f"{where} is not a key there: set {key} at the top, before any table"
    return f"unknown key {where!r}; allowed: {', '.join(allowed)}"


def resolve_config(
    name: str | None, file_values: dict[str, Any], overrides: dict[str, Any], source: str
) -> TrainConfig:
    """The named config (command line first, then the file's `config`), with the file's values
    and then the command line's (by command-line name) replacing its fields; validated.
    `source` names the file in errors."""
    name = name or file_values.get("config")
    if name is None:
        raise ValueError("no config: pass --config NAME or set config = NAME in --config-file")
    if not isinstance(name, str):
        raise ValueError(f"{source}: config must be a string (a config name)")
    config = get_config(name)
    replaced = {}
    for key, value in file_values.items():
        if key == "model":
            dit, options = _model_from(value, config.model.dit, source)
            config = config.with_fields(model=dit)
            replaced |= {k: _checked(k, v, source) for k, v in options.items()}
        elif key in SECTIONS:
            replaced |= {k: _checked(k, v, source) for k, v in value.items()}
        elif key != "config":
            replaced[key] = _checked(key, value, source)
    replaced |= {key: _checked(key, value, "command line") for key, value in overrides.items()}
    config = config.with_fields(**replaced)
    validate_config(config)
    return config


def validate_config(config: TrainConfig) -> None:
    """Raises ValueError naming the first field whose value cannot train."""
    if not isinstance(config.model.dit, DiTConfig):
        raise ValueError("model must be a model preset or a [model] table")
    validate_model(config.model.dit)
    model, data, parallelism = config.model, config.data, config.parallelism
    optimizer, metrics = config.optimizer, config.metrics
    learning_rate, peak = optimizer.learning_rate, metrics.peak_flops_per_s
    checks = [
        ("steps", config.steps >= 1, "at least 1"),
        ("steps", config.steps <= MAX_STEPS, f"at most {MAX_STEPS:,}"),
        ("seed", 0 <= config.seed < 2**32, "in [0, 2**32)"),
        ("device", parallelism.device in ("cpu", "cuda"), "cpu or cuda"),
        ("backend", parallelism.backend in ("gloo", "nccl"), "gloo or nccl"),
        (
            "backend",
            parallelism.backend != "nccl" or parallelism.device == "cuda",
            "gloo on device cpu",
        ),
        ("dtype", model.dtype in _DTYPES, " or ".join(_DTYPES)),
        ("gpus_per_node", parallelism.gpus_per_node >= 1, "at least 1"),
        ("gpus_per_node", parallelism.gpus_per_node <= MAX_GPUS, f"at most {MAX_GPUS:,}"),
        ("learning_rate", _finite(learning_rate) and learning_rate > 0, "> 0"),
        ("learning_rate", learning_rate <= MAX_LEARNING_RATE, f"at most {MAX_LEARNING_RATE:g}"),
        (
            "betas",
            all(_finite(b) and 0 <= b < 1 for b in optimizer.betas),
            "two numbers in [0, 1)",
        ),
        (
            "learning_rate",
            learning_rate / (1 - optimizer.betas[0]) <= MAX_FIRST_STEP_SIZE,
            f"such that learning_rate / (1 - betas[0]) is at most {MAX_FIRST_STEP_SIZE:g} (AdamW's "
            "first step size, a float32)",
        ),
        ("weight_decay", _finite(optimizer.weight_decay) and optimizer.weight_decay >= 0, ">= 0"),
        (
            "weight_decay",
            optimizer.weight_decay <= MAX_WEIGHT_DECAY,
            f"at most {MAX_WEIGHT_DECAY:g}",
        ),
        ("warmup_steps", optimizer.warmup_steps >= 0, ">= 0"),
        ("warmup_steps", optimizer.warmup_steps <= MAX_STEPS, f"at most {MAX_STEPS:,}"),
        (
            "grad_clip_norm",
            _finite(optimizer.grad_clip_norm) and optimizer.grad_clip_norm > 0,
            "> 0",
        ),
        (
            "grad_clip_norm",
            optimizer.grad_clip_norm <= MAX_GRAD_CLIP_NORM,
            f"at most {MAX_GRAD_CLIP_NORM:g}",
        ),
        ("checkpoint_every", config.checkpoint.checkpoint_every >= 0, ">= 0"),
        (
            "checkpoint_every",
            config.checkpoint.checkpoint_every <= MAX_STEPS,
            f"at most {MAX_STEPS:,}",
        ),
        ("loader_workers", data.loader_workers >= 0, ">= 0"),
        (
            "loader_workers",
            data.loader_workers <= MAX_LOADER_WORKERS,
            f"at most {MAX_LOADER_WORKERS}",
        ),
        ("peak_flops_per_s", peak is None or peak > 0, "> 0"),
        (
            "peak_flops_per_s",
            peak is None or peak <= MAX_PEAK_FLOPS_PER_S,
            f"at most {MAX_PEAK_FLOPS_PER_S:g}",
        ),
        ("data_ranks", data.data_ranks is None or data.data_ranks >= 1, "at least 1"),
        (
            "data_ranks",
            data.data_ranks is None or data.data_ranks <= MAX_GPUS,
            f"at most {MAX_GPUS:,} (the GPU limit)",
        ),
        (
            "timeout_s",
            _finite(parallelism.timeout_s) and parallelism.timeout_s > 0,
            "> 0 seconds",
        ),
        (
            "timeout_s",
            MIN_TIMEOUT_S <= parallelism.timeout_s <= MAX_TIMEOUT_S,
            f"in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}] seconds",
        ),
        ("adapt_speeds_start_step", parallelism.adapt_speeds_start_step >= 1, "at least 1"),
        (
            "adapt_speeds_start_step",
            parallelism.adapt_speeds_start_step <= MAX_STEPS,
            f"at most {MAX_STEPS:,}",
        ),
        (
            "speed_smoothing",
            _finite(parallelism.speed_smoothing) and 0 < parallelism.speed_smoothing <= 1,
            "in (0, 1]",
        ),
    ]
    for key, ok, allowed in checks:
        if not ok:
            value = _short(_value_of(config, key))
            raise ValueError(f"{field_label(key)} must be {allowed}, got {value}")
    global_batch_size(config)
    check_global_batch_source(data.global_batch is not None, data.data_dir)
    if parallelism.device == "cpu":
        _check_fits_host_memory(config)


def global_batch_size(config: TrainConfig) -> GlobalBatchSize | None:
    """config.global_batch parsed (None without one); ValueError naming the field otherwise."""
    if config.data.global_batch is None:
        return None
    try:
        return parse_global_batch_size(config.data.global_batch)
    except ValueError as error:
        raise ValueError(f"global_batch: {error}") from None


def check_world(config: TrainConfig, num_ranks: int) -> None:
    """The world size (torchrun's ranks) suits the config: the cost model's nodes hold
    gpus_per_node ranks each (fewer ranks than that: one node)."""
    if num_ranks > MAX_GPUS:
        raise ValueError(f"{num_ranks:,} ranks: at most {MAX_GPUS:,} (the GPU limit)")
    check_data_ranks(config.data.data_ranks, num_ranks, "data_ranks")
    gpus_per_node = config.parallelism.gpus_per_node
    per_node = min(gpus_per_node, num_ranks)
    if num_ranks % per_node:
        raise ValueError(
            f"gpus_per_node {gpus_per_node} does not divide the {num_ranks} ranks of this "
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

    params = param_count(config.model.dit)
    need_bytes = params * TRAIN_BYTES_PER_PARAM
    if need_bytes > host_bytes:
        raise ValueError(
            f"model {config.model.dit.name}: {params:,} parameters need about "
            f"{need_bytes / 2**30:,.0f} GiB to train, more than this machine's "
            f"{host_bytes / 2**30:,.0f} GiB"
        )


def _short(value: Any) -> str:
    """repr for an error message: bounded, so a huge value does not flood the terminal."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _finite(value: float) -> bool:
    return math.isfinite(value)


def _model_from(value: Any, base: DiTConfig, source: str) -> tuple[DiTConfig, dict[str, Any]]:
    """The [model] table (or preset name) as the model's sizes and its ModelSection fields:
    `preset` (else `base`, the named config's) with the table's DiTConfig fields replaced."""
    if isinstance(value, str):
        return model_preset(value), {}
    if not isinstance(value, dict):
        raise ValueError(f"{source}: model must be a preset name or a [model] table")
    preset = value.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise ValueError(f"{source}: model.preset must be a preset name, got {_short(preset)}")
    sizes = {
        key: _typed(f"model.{key}", _DIT_FIELDS[key], item, source)
        for key, item in value.items()
        if key in _DIT_FIELDS
    }
    options = {key: item for key, item in value.items() if key != "preset" and key not in sizes}
    try:
        for key, item in sizes.items():  # before DiTConfig's own checks divide by them
            _check_model_value(key, item)
        dit = model_preset(preset) if preset is not None else base
        if "num_layers" in sizes and "num_double_layers" not in sizes:
            dit = with_layers(dit, sizes["num_layers"])  # an MMDiT keeps its share of double
        dit = dataclasses.replace(dit, **sizes)
        validate_model(dit)
        return dit, options
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: model: {error}") from None


def _checked(key: str, value: Any, source: str) -> Any:
    return _typed(field_label(key), field_types()[key], value, source)


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
