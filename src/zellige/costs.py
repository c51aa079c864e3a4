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
from zellige.profile import builtin_profile_for_device, load_profile

MIN_GPU_MEMORY_BYTES = 2**30  # 1 GiB: below it no model of the presets plans
MAX_GPU_MEMORY_BYTES = 2**50  # 1 PiB


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
    gpu_memory_bytes: int | None = None,
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
    gpu_memory_bytes: each GPU's memory, which the plans' peaks must fit (less the cost
    options' headroom); None: the profile's device_memory_bytes, or 140 GiB where it has none.
    Raises ValueError for an unknown model or link class, a bad cluster shape or profile."""
    spec = resolve_model(model)
    if gpus_per_node is None:
        gpus_per_node = default_gpus_per_node(gpus)
    cluster = make_cluster(gpus, gpus_per_node, links)
    hardware = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    if gpu_memory_bytes is None:
        gpu_memory_bytes = hardware.device_memory_bytes or cluster.gpu_memory_bytes
    if isinstance(gpu_memory_bytes, bool) or not isinstance(gpu_memory_bytes, int):
        raise ValueError(f"gpu_memory_bytes must be an integer, got {gpu_memory_bytes!r}")
    if not MIN_GPU_MEMORY_BYTES <= gpu_memory_bytes <= MAX_GPU_MEMORY_BYTES:
        raise ValueError(
            f"GPU memory must be {MIN_GPU_MEMORY_BYTES / 2**30:g} to "
            f"{MAX_GPU_MEMORY_BYTES / 2**30:g} GiB, got {gpu_memory_bytes / 2**30:g} GiB"
        )
    cluster.gpu_memory_bytes = gpu_memory_bytes
    options = CostOptions()
    options.activation_checkpointing = activation_checkpointing
    options.adaptive_checkpointing = adaptive_checkpointing
    options.weights_kept_to_backward = weights_kept_to_backward
    options.state_bytes_per_param += gradient_bytes_per_param - options.gradient_bytes_per_param
    options.gradient_bytes_per_param = gradient_bytes_per_param
    options.optimizer_copy_bytes_per_param = optimizer_copy_bytes_per_param
    return CostModel(spec, hardware, cluster, options)


def device_memory_bytes(device) -> int:
    """The memory this process can plan with on a torch CUDA device: what the device has free
    plus what this process's allocator already holds (its weights and caches are part of what
    the cost model counts), never more than the device's total. Other processes' allocations
    on the same GPU are left out."""
    import torch  # planning alone (the CLI) does not need torch

    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    return min(total_bytes, free_bytes + torch.cuda.memory_reserved(device))


def planning_device(
    profile: str | Path | HardwareProfile | None, device_name: str | None, usable_bytes: int | None
) -> tuple[str | Path | HardwareProfile | None, int | None, list[str]]:
    """The profile a run plans with, each GPU's memory its plans must fit, and the lines that
    say so, for a run on a GPU named `device_name` of which this process can use `usable_bytes`
    (None, None: on CPU, the profile's own device). Without a profile, the built-in one of this
    GPU's kind; the memory is always the running GPU's, so a plan made with a larger GPU's
    profile never runs on a smaller one."""
    if device_name is None:
        return profile, None, []
    notes = []
    if profile is None:
        profile, unknown = builtin_profile_for_device(device_name)
        notes.append(
            unknown or f"cost model: the built-in {profile} profile, for this {device_name}"
        )
    loaded = profile if isinstance(profile, HardwareProfile) else load_profile(profile)
    profile_bytes = loaded.device_memory_bytes
    if profile_bytes and usable_bytes < profile_bytes:
        notes.append(
            f"memory: plans fit the {usable_bytes / 2**30:.1f} GiB this process can use of "
            f"this GPU (the profile's device has {profile_bytes / 2**30:.1f} GiB)"
        )
    return profile, usable_bytes, notes
