"""One Wan-style DiT block: AdaLN-modulated self-attention with QK norm and 3D RoPE, cross-attention
to the sequence's own text, and an AdaLN-gated GELU feed-forward. See config.py for the legend.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from zellige.model import fused
from zellige.model.attention import AttentionFn
from zellige.model.conditioning import NUM_BLOCK_MODULATIONS, modulation_per_token


class FloatLayerNorm(nn.LayerNorm):
    """LayerNorm computed in float32 (or wider) whatever the activation dtype."""

    def forward(self, x: Tensor) -> Tensor:
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        weight = None if self.weight is None else self.weight.to(compute_dtype)
        bias = None if self.bias is None else self.bias.to(compute_dtype)
        y = nn.functional.layer_norm(
            x.to(compute_dtype), self.normalized_shape, weight, bias, self.eps
        )
        return y.to(x.dtype)


class FloatRMSNorm(nn.RMSNorm):
    """RMSNorm computed in float32 (or wider) whatever the activation dtype."""

    def forward(self, x: Tensor) -> Tensor:
        compute_dtype = torch.promote_types(x.dtype, torch.float32)
        weight = self.weight.to(compute_dtype)
        y = nn.functional.rms_norm(x.to(compute_dtype), self.normalized_shape, weight, self.eps)
        return y.to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)
        # QK norm over the whole width (before the head split), as in Wan
        self.norm_q = FloatRMSNorm(width, eps=eps)
        self.norm_k = FloatRMSNorm(width, eps=eps)

    def forward(
        self, x_TD: Tensor, rope_cos: Tensor, rope_sin: Tensor, attention: AttentionFn
    ) -> Tensor:
        norm_rope = fused.kernels["rms_norm_rope"]
        q_TNH = norm_rope(
            self.q(x_TD), self.norm_q.weight, self.norm_q.eps, self.num_heads, rope_cos, rope_sin
        )
        k_TNH = norm_rope(
            self.k(x_TD), self.norm_k.weight, self.norm_k.eps, self.num_heads, rope_cos, rope_sin
        )
        v_TNH = self.v(x_TD).unflatten(1, (self.num_heads, -1))
        return self.o(attention(q_TNH, k_TNH, v_TNH).flatten(1))


class CrossAttention(nn.Module):
    def __init__(self, width: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(width, width)
        self.k = nn.Linear(width, width)
        self.v = nn.Linear(width, width)
        self.o = nn.Linear(width, width)
        self.norm_q = FloatRMSNorm(width, eps=eps)
        self.norm_k = FloatRMSNorm(width, eps=eps)

    def forward(self, x_TD: Tensor, text_XD: Tensor, attention: AttentionFn) -> Tensor:
        norm_heads = fused.kernels["rms_norm_heads"]
        q_TNH = norm_heads(self.q(x_TD), self.norm_q.weight, self.norm_q.eps, self.num_heads)
        k_XNH = norm_heads(self.k(text_XD), self.norm_k.weight, self.norm_k.eps, self.num_heads)
        v_XNH = self.v(text_XD).unflatten(1, (self.num_heads, -1))
        return self.o(attention(q_TNH, k_XNH, v_XNH).flatten(1))


class FeedForward(nn.Module):
    def __init__(self, width: int, ffn_width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, ffn_width)
        self.act = nn.GELU(approximate="tanh")
        self.down = nn.Linear(ffn_width, width)

    def forward(self, x_TD: Tensor) -> Tensor:
        return self.down(self.act(self.up(x_TD)))


class DiTBlock(nn.Module):
    def __init__(self, width: int, num_heads: int, ffn_width: int, eps: float) -> None:
        super().__init__()
        self.norm_attention = FloatLayerNorm(width, eps=eps, elementwise_affine=False)
        self.self_attention = SelfAttention(width, num_heads, eps)
        self.norm_cross = FloatLayerNorm(width, eps=eps, elementwise_affine=True)
        self.cross_attention = CrossAttention(width, num_heads, eps)
        self.norm_ffn = FloatLayerNorm(width, eps=eps, elementwise_affine=False)
        self.ffn = FeedForward(width, ffn_width)
        # learned offset added to the shared timestep modulation (Wan's per-block modulation);
        # initialised by VideoDiT.reset_parameters
        self.modulation = nn.Parameter(torch.empty(NUM_BLOCK_MODULATIONS, width))

    def forward(
        self,
        x_TD: Tensor,
        text_XD: Tensor,
        modulation_S6D: Tensor,
        sequence_index_T: Tensor,
        rope_cos: Tensor,
        rope_sin: Tensor,
        self_attention: AttentionFn,
        cross_attention: AttentionFn,
    ) -> Tensor:
        modulate, gated = fused.kernels["modulated_layer_norm"], fused.kernels["gated_residual"]
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = modulation_per_token(
            modulation_S6D, self.modulation, sequence_index_T
        )
        eps = self.norm_attention.eps
        h_TD = modulate(x_TD, shift_a, scale_a, eps)
        y_TD = self.self_attention(h_TD, rope_cos, rope_sin, self_attention)
        x_TD = gated(x_TD, y_TD, gate_a)
        x_TD = x_TD + self.cross_attention(self.norm_cross(x_TD), text_XD, cross_attention)
        h_TD = modulate(x_TD, shift_f, scale_f, eps)
        return gated(x_TD, self.ffn(h_TD), gate_f)
