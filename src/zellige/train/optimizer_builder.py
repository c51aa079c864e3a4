"""The optimizer and the choices around it: which AdamW (torch's fused one, or CopyingAdamW
where one rank's update also writes the next forward's weight copies), what its gradients and
copies cost in memory (the cost model prices them), and the clipped step."""

from __future__ import annotations

import torch

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


# The cost model's prices of what training holds, for a config resolved or not: each resolves
# it for num_ranks first (TrainConfig.resolved), as the run does.


def gradient_bytes_per_param(config: TrainConfig, num_ranks: int) -> float:
    """Bytes a parameter's gradient holds in training (the cost model prices them): fp32, or
    bf16 where the copying optimizer reads the backward's bf16 gradients (one rank)."""
    config = config.resolved(num_ranks)
    lone = num_ranks == 1 and not config.parallelism.fsdp_on_one_rank
    kept = lone and config.optimizer.compute_dtype_gradients
    return 2.0 if kept and config.model.dtype == "bfloat16" else 4.0


def optimizer_copy_bytes_per_param(config: TrainConfig, num_ranks: int) -> float:
    """Bytes a parameter's copy takes that the optimizer step writes beside the state (the cost
    model prices them): the copying optimizer's next-forward weights, one rank without FSDP."""
    config = config.resolved(num_ranks)
    lone = num_ranks == 1 and not config.parallelism.fsdp_on_one_rank
    copying = config.optimizer.copying_optimizer
    return 2.0 if lone and copying and config.model.dtype == "bfloat16" else 0.0


def weights_kept_to_backward(config: TrainConfig, num_ranks: int) -> bool:
    """Whether the blocks' gathered weights live from their forward to their backward (the cost
    model prices them): no FSDP on one rank, or FSDP2 without resharding after the forward."""
    config = config.resolved(num_ranks)
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
