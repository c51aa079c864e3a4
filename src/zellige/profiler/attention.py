"""Attention forward/backward per head, by segment length and heads per call."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from zellige.profiler.timing import median_time_s

# Legend: B segments in one call, N heads, L tokens per segment, H head dim.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def sdpa_attention(q_BNLH: torch.Tensor, k_BNLH: torch.Tensor, v_BNLH: torch.Tensor):
    """Dense attention of equal-length segments through torch SDPA (cuDNN first on CUDA)."""
    if q_BNLH.is_cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
        with sdpa_kernel(backends, set_priority=True):
            return F.scaled_dot_product_attention(q_BNLH, k_BNLH, v_BNLH)
    return F.scaled_dot_product_attention(q_BNLH, k_BNLH, v_BNLH)


@dataclass(kw_only=True, slots=True)
class AttentionSample:
    length: int
    heads_per_call: int  # segments x heads folded into one dense call
    forward_s_per_head: float
    backward_s_per_head: float


def segments_per_call(length: int, num_heads: int, pack_tokens: int) -> int:
    """How many length-L segments the engine groups into one call for a rank holding
    `pack_tokens` tokens of such segments (at least one)."""
    return max(1, math.ceil(pack_tokens / length)) if length < pack_tokens else 1


def measure_attention(
    *,
    length: int,
    heads_per_call: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    attention: AttentionFn = sdpa_attention,
    repeats: int = 5,
) -> AttentionSample:
    """Times one dense call over `heads_per_call` (segment, head) pairs of length `length`."""
    shape = (1, heads_per_call, length, head_dim)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
    grad_out = torch.randn(shape, device=device, dtype=dtype)
    forward_s = median_time_s(lambda: attention(q, k, v), device, repeats=repeats)
    out = attention(q, k, v)
    backward_s = median_time_s(
        lambda: torch.autograd.grad(out, (q, k, v), grad_out, retain_graph=True),
        device,
        repeats=repeats,
    )
    return AttentionSample(
        length=length,
        heads_per_call=heads_per_call,
        forward_s_per_head=forward_s / heads_per_call,
        backward_s_per_head=backward_s / heads_per_call,
    )


def attention_flops_per_s(sample: AttentionSample, head_dim: int) -> tuple[float, float]:
    """Forward and backward rates (4 L^2 H forward FLOPs per head; backward 2.5x forward)."""
    forward_flops = 4.0 * sample.length**2 * head_dim
    return forward_flops / sample.forward_s_per_head, 2.5 * forward_flops / (
        sample.backward_s_per_head
    )
