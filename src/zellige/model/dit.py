"""The reference video DiT (Wan-style, cross-attention to text) over one rank's packed tokens.

The model sees a flat buffer of tokens grouped by sequence and per-sequence tables (timesteps,
text); it never learns how the tokens got there. Parallelism enters only through the
self-attention callable (see attention.py). Legend in config.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from zellige.model import fused
from zellige.model.attention import AttentionFn, local_attention
from zellige.model.blocks import DiTBlock, FloatLayerNorm
from zellige.model.conditioning import (
    DEFAULT_NUMERICS,
    TextEmbedding,
    TimestepEmbedding,
    padded_rows,
    per_token,
)
from zellige.model.config import DiTConfig, ModelNumerics
from zellige.runtime.coalesced import to_device


@dataclass(kw_only=True, slots=True)
class PackedTokens:
    """One rank's share of a step. Tokens are grouped by sequence, in the order of the sequence
    table: the first tokens_per_sequence[0] tokens belong to local sequence 0, and so on (a
    sequence sharded over ranks appears on each with only its share)."""

    latents_TC: Tensor  # noisy latents x_t
    positions_T3: Tensor  # int64 (t, h, w) of each token in its sequence's latent grid
    timesteps_S: Tensor  # flow time t in [0, 1] of each local sequence
    text_XE: Tensor  # text-encoder features of the local sequences, concatenated
    tokens_per_sequence: Sequence[int]  # host ints, len S
    text_tokens_per_sequence: Sequence[int]  # host ints, len S
    # [T] long, the local sequence of each token, on the tokens' device (the training step
    # builds it with its other tables); None: sequence_index() builds it from the host ints
    sequence_index_T: Tensor | None = None

    def sequence_index(self) -> Tensor:
        """Made on the host from host ints and copied without a host sync."""
        if self.sequence_index_T is not None:
            return self.sequence_index_T
        counts = np.asarray(list(self.tokens_per_sequence), dtype=np.int64)
        indices = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
        return to_device(torch.from_numpy(indices), self.latents_TC.device)


class OutputHead(nn.Module):
    def __init__(
        self, width: int, out_channels: int, eps: float, numerics: ModelNumerics = DEFAULT_NUMERICS
    ) -> None:
        super().__init__()
        self.numerics = numerics
        self.norm = FloatLayerNorm(width, eps=eps, elementwise_affine=False)
        self.linear = nn.Linear(width, out_channels)
        self.modulation = nn.Parameter(torch.empty(2, width))  # see VideoDiT.reset_parameters

    def forward(self, x_TD: Tensor, e_SD: Tensor, sequence_index_T: Tensor) -> Tensor:
        rows_S2D = e_SD[:, None, :] + self.modulation
        weights = (self.linear.weight, self.linear.bias)
        numerics = self.numerics
        if numerics.gathered_head:
            # each token's shift and scale read from the sequence's rows inside the region
            multiple = numerics.row_multiple
            return fused.kernels["output_head_gathered"](
                x_TD, padded_rows(rows_S2D, multiple), sequence_index_T, self.norm.eps, weights,
                multiple,
            )  # fmt: skip
        modulation_T2D = per_token(rows_S2D, sequence_index_T, numerics)
        return fused.kernels["output_head"](x_TD, modulation_T2D, self.norm.eps, weights)


class VideoDiT(nn.Module):
    """Predicts the rectified-flow velocity of every token it is given."""

    def __init__(self, config: DiTConfig, numerics: ModelNumerics = DEFAULT_NUMERICS) -> None:
        super().__init__()
        if config.joint_attention:
            raise ValueError(f"{config.name} is a joint-attention model: build it with MMDiT")
        self.config, self.numerics = config, numerics
        width = config.width
        # The 1x2x2 patch embedding is a linear map of each token's flattened patch.
        self.patch_embedding = nn.Linear(config.token_channels, width)
        self.text_embedding = TextEmbedding(config.text_dim, width)
        self.time_embedding = TimestepEmbedding(config.freq_dim, width)
        self.blocks = nn.ModuleList(
            DiTBlock(width, config.num_heads, config.ffn_width, config.eps, numerics)
            for _ in range(config.num_layers)
        )
        self.head = OutputHead(width, config.token_channels, config.eps, numerics)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Wan's initialisation: Xavier-uniform linears with zero bias, N(0, 0.02) for the
        conditioning embeddings, unit-RMS modulation offsets, unit norm weights, and a zero
        output layer so training starts from v = 0. Works on sharded (DTensor) parameters too,
        so a model built on the meta device is initialised after sharding."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm | nn.RMSNorm) and module.weight is not None:
                nn.init.ones_(module.weight)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        for embedding in (self.text_embedding, self.time_embedding):
            for module in embedding.modules():
                if isinstance(module, nn.Linear):
                    nn.init.normal_(module.weight, std=0.02)
        for module in self.modules():  # (blocks may be wrapped by parallelize())
            if isinstance(module, DiTBlock | OutputHead):
                nn.init.normal_(module.modulation, std=self.config.width**-0.5)
        nn.init.zeros_(self.head.linear.weight)

    def forward(
        self,
        tokens: PackedTokens,
        self_attention: AttentionFn | None = None,
        cross_attention: AttentionFn | None = None,
    ) -> Tensor:
        """Velocity [T, C]. Without `self_attention`, every local sequence attends whole; without
        `cross_attention`, each sequence's tokens attend to its text (local_attention)."""
        device = tokens.latents_TC.device
        if self_attention is None:
            lengths = list(tokens.tokens_per_sequence)
            self_attention = local_attention(lengths, lengths, device)
        if cross_attention is None:
            cross_attention = local_attention(
                tokens.tokens_per_sequence, tokens.text_tokens_per_sequence, device
            )
        dtype = self.patch_embedding.weight.dtype
        # the text embedding's GEMMs first: the device has milliseconds of work while the host
        # issues the small kernels that follow (at a step's start it would wait for them)
        text_XD = self.text_embedding(tokens.text_XE.to(dtype))
        sequence_index_T = tokens.sequence_index()
        # RoPE in float32 at least: bf16 angles would smear neighbouring positions
        rope_dtype = torch.promote_types(dtype, torch.float32)
        rope_cos, rope_sin = fused.kernels["rope_tables"](
            tokens.positions_T3, self.config.head_dim, self.config.rope_theta, rope_dtype
        )
        x_TD = self.patch_embedding(tokens.latents_TC.to(dtype))
        e_SD, e_S6D = self.time_embedding(tokens.timesteps_S)
        for block in self.blocks:
            x_TD = block(
                x_TD,
                text_XD,
                e_S6D,
                sequence_index_T,
                rope_cos,
                rope_sin,
                self_attention,
                cross_attention,
            )
        return self.head(x_TD, e_SD, sequence_index_T)
