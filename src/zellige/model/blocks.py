"""One Wan-style DiT block: AdaLN-modulated self-attention with QK norm and 3D RoPE, cross-attention
to the sequence's own text, and an AdaLN-gated GELU feed-forward. See config.py for the legend.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from zellige.model import fused
from zellige.model.attention import AttentionFn
from zellige.model.conditioning import (
    DEFAULT_NUMERICS,
    NUM_BLOCK_MODULATIONS,
    modulation_per_token,
)
from zellige.model.config import ModelNumerics


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
    def __init__(
        self,
        width: int,
        num_heads: int,
        ffn_width: int,
        eps: float,
        numerics: ModelNumerics = DEFAULT_NUMERICS,
    ) -> None:
        super().__init__()
        self.numerics = numerics
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
        """The per-token layers run as fused.kernels' regions between the two attention calls
        (the same arithmetic as the submodules' own forwards, fusable by torch.compile)."""
        kernels = fused.kernels
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = modulation_per_token(
            modulation_S6D, self.modulation, sequence_index_T, self.numerics
        )
        eps = self.norm_attention.eps
        sa, ca, ffn = self.self_attention, self.cross_attention, self.ffn
        qk_eps, heads = sa.norm_q.eps, sa.num_heads
        q_TNH, k_TNH, v_TNH = kernels["self_attention_in"](
            x_TD,
            shift_a,
            scale_a,
            eps,
            (sa.q.weight, sa.q.bias, sa.k.weight, sa.k.bias, sa.v.weight, sa.v.bias,
             sa.norm_q.weight, sa.norm_k.weight),
            qk_eps,
            heads,
            rope_cos,
            rope_sin,
        )  # fmt: skip
        norm = self.norm_cross
        x_TD, q_TNH = kernels["self_attention_out_cross_in"](
            x_TD,
            self_attention(q_TNH, k_TNH, v_TNH),
            gate_a,
            norm.eps,
            (sa.o.weight, sa.o.bias, norm.weight, norm.bias, ca.q.weight, ca.q.bias,
             ca.norm_q.weight),
            ca.norm_q.eps,
            ca.num_heads,
        )  # fmt: skip
        k_XNH, v_XNH = kernels["cross_attention_kv"](
            text_XD,
            (ca.k.weight, ca.k.bias, ca.v.weight, ca.v.bias, ca.norm_k.weight),
            ca.norm_k.eps,
            ca.num_heads,
        )
        return kernels["cross_attention_out_ffn"](
            x_TD,
            cross_attention(q_TNH, k_XNH, v_XNH),
            shift_f,
            scale_f,
            gate_f,
            eps,
            (ca.o.weight, ca.o.bias, ffn.up.weight, ffn.up.bias, ffn.down.weight, ffn.down.bias),
        )
