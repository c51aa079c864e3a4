"""Per-sequence conditioning: timestep and text embeddings, and AdaLN modulation looked up by
each token's sequence index, so a token gets its own sequence's modulation wherever it was routed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

NUM_BLOCK_MODULATIONS = 6  # shift, scale, gate for attention; shift, scale, gate for the FFN
TIMESTEP_SCALE = 1000.0  # flow time t in [0, 1] is embedded as t * 1000, as diffusion models do


def sinusoidal_embedding(timesteps_S: Tensor, dim: int) -> Tensor:
    """[S, dim]: cos then sin of t * 10000^(-k / (dim / 2)), computed in float64."""
    half = dim // 2
    exponents = torch.arange(half, dtype=torch.float64, device=timesteps_S.device) / half
    angles = timesteps_S.to(torch.float64)[:, None] * torch.exp(-math.log(10000.0) * exponents)
    return torch.cat((angles.cos(), angles.sin()), dim=1)


class TimestepEmbedding(nn.Module):
    """t -> e_SD (used by the output head) and the shared per-block modulation table e_S6D."""

    def __init__(self, freq_dim: int, width: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.embed = nn.Sequential(nn.Linear(freq_dim, width), nn.SiLU(), nn.Linear(width, width))
        self.project = nn.Sequential(nn.SiLU(), nn.Linear(width, NUM_BLOCK_MODULATIONS * width))

    def forward(self, timesteps_S: Tensor) -> tuple[Tensor, Tensor]:
        weight = self.embed[0].weight
        timesteps_S = timesteps_S.to(torch.float64)  # t * 1000 in float32 would round
        frequencies_SF = sinusoidal_embedding(timesteps_S * TIMESTEP_SCALE, self.freq_dim)
        e_SD = self.embed(frequencies_SF.to(weight.dtype))
        e_S6D = self.project(e_SD).unflatten(1, (NUM_BLOCK_MODULATIONS, -1))
        return e_SD, e_S6D


class TextEmbedding(nn.Module):
    """Text-encoder features [X, E] -> [X, D]."""

    def __init__(self, text_dim: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(text_dim, width), nn.GELU(approximate="tanh"), nn.Linear(width, width)
        )

    def forward(self, text_XE: Tensor) -> Tensor:
        return self.layers(text_XE)


# per_token pads the sequence count to a multiple of this: a bf16 one-hot [T, S] whose rows are
# not 16-byte aligned (S = 21 images, or 1 clip) sends cuBLAS to slow unaligned kernels (an H200
# ran the block's [T, 21] @ [21, 6D] at about 1 TB/s); set_row_multiple(1): no padding
_row_multiple = 8


def set_row_multiple(multiple: int) -> None:
    """per_token pads the sequence count up to a multiple of `multiple` (>= 1)."""
    global _row_multiple
    if multiple < 1:
        raise ValueError(f"the row multiple must be >= 1, got {multiple}")
    _row_multiple = multiple


def per_token(rows_SKD: Tensor, sequence_index_T: Tensor) -> Tensor:
    """rows_SKD[sequence_index_T] ([T, K, D]) as a one-hot matmul. Indexing's backward
    scatter-adds every token's gradient into its sequence's row with atomics, which serialises
    when one long video's tokens all hit one row (3x slower per-token layers on an H200); the
    matmul's backward is a GEMM that sums each sequence's tokens. The forward is exact, and so is
    the padding: the rows past the S sequences are zero and no token's one-hot selects them."""
    num_sequences = rows_SKD.shape[0]
    padded = -(-num_sequences // _row_multiple) * _row_multiple
    rows_SF = rows_SKD.flatten(1)
    if padded != num_sequences:
        rows_SF = torch.nn.functional.pad(rows_SF, (0, 0, 0, padded - num_sequences))
    sequences_S = torch.arange(padded, device=sequence_index_T.device)
    one_hot_TS = (sequence_index_T[:, None] == sequences_S).to(rows_SKD.dtype)
    return (one_hot_TS @ rows_SF).unflatten(1, rows_SKD.shape[1:])


def modulation_per_token(
    table_SKD: Tensor, offset_KD: Tensor, sequence_index_T: Tensor
) -> tuple[Tensor, ...]:
    """The K modulation vectors [T, D] of each token: (learned offset + its sequence's row).

    The sum is formed per sequence (S rows) and only then expanded to tokens.
    """
    return per_token(table_SKD + offset_KD, sequence_index_T).unbind(dim=1)
