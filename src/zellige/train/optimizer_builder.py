"""The optimizer and the choices around it: which AdamW (torch's fused one, or CopyingAdamW
where one rank's update also writes the next forward's weight copies), what its gradients and
copies cost in memory (the run's cost options: the cost model prices them), and the clipped
step."""

from __future__ import annotations

import torch

from zellige._core import CostOptions
from zellige.costs import set_gradient_bytes
from zellige.train.config import TrainConfig
from zellige.train.optimizer import CopyingAdamW

# CopyingAdamW updates this many blocks' weights per compiled call: fewer calls (each checks
# its guards on every tensor it takes) where a model has many blocks; the last chunk may be
# shorter (a graph of its own)
OPTIMIZER_BLOCKS_PER_CHUNK = 8


def copies_in_optimizer(config: TrainConfig, model) -> bool:
    """Whether AdamW writes the weights' compute copies (one rank without FSDP, the update at
    the step's end); `config` resolved (TrainConfig.resolved)."""
    lone = getattr(model, "lone_weights", None) is not None
    return lone and config.optimizer.copying_optimizer


def make_optimizer(config: TrainConfig, model, device: torch.device) -> torch.optim.Optimizer:
    """torch's AdamW (fused on CUDA: one kernel over all parameters), or CopyingAdamW where it
    writes the weights' copies (copies_in_optimizer; compiled where the blocks are); `config`
    resolved (TrainConfig.resolved)."""
    chosen = config.optimizer
    options = dict(lr=chosen.learning_rate, betas=chosen.betas, weight_decay=chosen.weight_decay)
    if copies_in_optimizer(config, model):
        return CopyingAdamW(
            model.parameters(),
            chunks=model.lone_weights.chunks(OPTIMIZER_BLOCKS_PER_CHUNK),
            compiled=config.model.compile_elementwise,
            tuned=chosen.tune_optimizer_kernels,
            **options,
        )
    return torch.optim.AdamW(model.parameters(), fused=chosen.fused_optimizer, **options)


def cost_options(config: TrainConfig, num_ranks: int) -> CostOptions:
    """The cost model's options for this run: what training holds and recomputes, priced as
    the trainer runs it on num_ranks ranks (`config` resolved for them first, as the run
    does): the activation checkpointing (adaptive only where checkpointing is on), the
    gathered weights kept from forward to backward, the gradients' bytes and the optimizer's
    copies. The loader's workers receive it whole (it pickles)."""
    config = config.resolved(num_ranks)
    parallelism = config.parallelism
    options = CostOptions()
    options.activation_checkpointing = parallelism.activation_checkpointing
    options.adaptive_checkpointing = (
        parallelism.activation_checkpointing and parallelism.adaptive_checkpointing
    )
    options.weights_kept_to_backward = _weights_kept_to_backward(config, num_ranks)
    set_gradient_bytes(options, _gradient_bytes_per_param(config, num_ranks))
    options.optimizer_copy_bytes_per_param = _optimizer_copy_bytes_per_param(config, num_ranks)
    return options


# What training holds, for a config resolved for num_ranks (TrainConfig.resolved)


def _gradient_bytes_per_param(config: TrainConfig, num_ranks: int) -> float:
    """Bytes a parameter's gradient holds in training: fp32, or bf16 where the copying
    optimizer reads the backward's bf16 gradients (one rank)."""
    lone = num_ranks == 1 and not config.parallelism.fsdp_on_one_rank
    kept = lone and config.optimizer.compute_dtype_gradients
    return 2.0 if kept and config.model.dtype == "bfloat16" else 4.0


def _optimizer_copy_bytes_per_param(config: TrainConfig, num_ranks: int) -> float:
    """Bytes a parameter's copy takes that the optimizer step writes beside the state: the
    copying optimizer's next-forward weights, one rank without FSDP."""
    lone = num_ranks == 1 and not config.parallelism.fsdp_on_one_rank
    copying = config.optimizer.copying_optimizer
    return 2.0 if lone and copying and config.model.dtype == "bfloat16" else 0.0


def _weights_kept_to_backward(config: TrainConfig, num_ranks: int) -> bool:
    """Whether the blocks' gathered weights live from their forward to their backward: no FSDP
    on one rank, or FSDP2 without resharding after the forward."""
    if num_ranks == 1 and not config.parallelism.fsdp_on_one_rank:
        return True
    return not config.parallelism.reshard_after_forward


def clip_and_step(model, optimizer, max_norm: float, in_optimizer: bool = True) -> torch.Tensor:
    """Clips the gradients' global 2-norm to max_norm and steps the optimizer, then frees the
    gradients; returns the norm before clipping (a device tensor: no host sync). A fused AdamW
    applies the clipping's scale itself (its grad_scale divides each gradient as it reads it),
    which saves a pass that reads and writes every gradient; otherwise torch's clip_grad_norm_
    scales them first. The scale is the reciprocal of clip_grad_norm_'s coefficient
    min(1, max_norm / (norm + 1e-6)), computed on the device; the optimizer takes it in float32.
    A CopyingAdamW (one rank) also writes the next forward's weight copies, which it offers to
    the LoneRankWeights; where those keep the backward's gradients, it reads them, and the norm
    is the one taken as they arrived."""
    copying = isinstance(optimizer, CopyingAdamW)
    lone = getattr(model, "lone_weights", None) if copying else None
    if lone is not None and lone.keeps_gradients:
        gradients, norm = lone.take_gradients()
        if norm is None:
            norm = torch.zeros((), device=next(model.parameters()).device)
        optimizer.gradients_in = gradients
        scaled_in_optimizer = True
    else:
        parameters = [p for p in model.parameters() if p.grad is not None]
        fused = copying or any(group.get("fused") for group in optimizer.param_groups)
        scaled_in_optimizer = fused and in_optimizer
        if scaled_in_optimizer:
            norm = full_tensor(torch.nn.utils.get_total_norm([p.grad for p in parameters]))
        else:
            norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0).float() if scaled_in_optimizer else None
    if lone is not None:
        optimizer.copies_out = copies = lone.new_copies()  # the next forward's weights
    _step_scaled(optimizer, scale)
    if lone is not None:
        lone.offer_copies(copies)
    optimizer.zero_grad(set_to_none=True)
    return norm


def _step_scaled(optimizer, grad_scale) -> None:
    """optimizer.step(), its gradients divided by grad_scale (a fused optimizer's own scaling)
    where it is not None."""
    optimizer.grad_scale = grad_scale
    try:
        optimizer.step()
    finally:
        optimizer.grad_scale = None


def full_tensor(value):
    return value.full_tensor() if hasattr(value, "full_tensor") else value
