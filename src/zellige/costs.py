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
    options: CostOptions | None = None,
    gpu_memory_bytes: int | None = None,
) -> CostModel:
    """A CostModel for `gpus` GPUs of `gpus_per_node` each (default: 8, or `gpus` when fewer).
    `profile` is a profile JSON path, a HardwareProfile, or None for the built-in H200 profile.
    `model` is a preset name, a model spec file or a ModelSpec (zellige.resolve_model).
    options: what training holds and recomputes (a CostOptions, used as given; None: its
    defaults, every layer checkpointed and fp32 gradients). Its fields: activation_checkpointing;
    adaptive_checkpointing (each rank checkpoints only the layers its memory needs, the plan's
    predicted rank_checkpointed_layers); weights_kept_to_backward (training keeps each block's
    gathered weights from its forward to its backward, zellige.train on one rank);
    gradient_bytes_per_param (what a parameter's gradient holds, part of state_bytes_per_param:
    set it with zellige.costs.set_gradient_bytes); optimizer_copy_bytes_per_param (what the
    optimizer step writes beside the state: 2 where one rank's copying AdamW makes the next
    forward's bf16 weights while the gradients are held). zellige.train makes its run's options
    with zellige.train.optimizer_builder.cost_options.
    gpu_memory_bytes: each GPU's memory, which the plans' peaks must fit (less the cost
    options' headroom); None: the profile's device_memory_bytes, or 140 GiB where it has none.
    Raises ValueError for an unknown model or link class, a bad cluster shape or profile, or
    options out of range.

    Example:
        >>> options = zellige.CostOptions()
        >>> options.activation_checkpointing = False
        >>> cost_model = zellige.make_cost_model("wan-14b", gpus=16, options=options)
    """
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
    return CostModel(spec, hardware, cluster, CostOptions() if options is None else options)


def set_gradient_bytes(options: CostOptions, gradient_bytes_per_param: float) -> None:
    """Sets what a parameter's gradient holds in `options` (4: fp32; 2: training that keeps the
    backward's bf16 gradients; 0: none priced). The gradient is part of state_bytes_per_param,
    which moves with it, so the rest of the state (fp32 master weights and Adam's moments, 12
    bytes by default) stays as it was.

    Example:
        >>> options = zellige.CostOptions()
        >>> zellige.costs.set_gradient_bytes(options, 2.0)  # state_bytes_per_param 16 -> 14
    """
    options.state_bytes_per_param += gradient_bytes_per_param - options.gradient_bytes_per_param
    options.gradient_bytes_per_param = gradient_bytes_per_param


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
