"""Per-sequence conditioning: timestep and text embeddings, and AdaLN modulation looked up by
each token's sequence index, so a token gets its own sequence's modulation wherever it was routed.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from zellige.model.config import ModelNumerics

NUM_BLOCK_MODULATIONS = 6  # shift, scale, gate for attention; shift, scale, gate for the FFN
TIMESTEP_SCALE = 1000.0  # flow time t in [0, 1] is embedded as t * 1000, as diffusion models do
DEFAULT_NUMERICS = ModelNumerics()


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


def _one_hot(
    sequence_index_T: Tensor, num_sequences: int, dtype: torch.dtype, row_multiple: int
) -> Tensor:
    """[T, S'] one-hot of each token's sequence, S' = num_sequences padded to `row_multiple`
    (the columns past the S sequences are zero: no token selects them)."""
    padded = -(-num_sequences // row_multiple) * row_multiple
    sequences_S = torch.arange(padded, device=sequence_index_T.device)
    return (sequence_index_T[:, None] == sequences_S).to(dtype)


def per_token(
    rows_SKD: Tensor, sequence_index_T: Tensor, numerics: ModelNumerics = DEFAULT_NUMERICS
) -> Tensor:
    """rows_SKD[sequence_index_T] ([T, K, D]) as a one-hot matmul. Indexing's backward
    scatter-adds every token's gradient into its sequence's row with atomics, which serialises
    when one long video's tokens all hit one row (3x slower per-token layers on an H200); the
    matmul's backward is a GEMM that sums each sequence's tokens. The forward is exact, and so is
    the padding (numerics.row_multiple): the rows past the S sequences are zero and no token's
    one-hot selects them."""
    num_sequences = rows_SKD.shape[0]
    one_hot_TS = _one_hot(sequence_index_T, num_sequences, rows_SKD.dtype, numerics.row_multiple)
    rows_SF = rows_SKD.flatten(1)
    padded = one_hot_TS.shape[1]
    if padded != num_sequences:
        rows_SF = torch.nn.functional.pad(rows_SF, (0, 0, 0, padded - num_sequences))
    return (one_hot_TS @ rows_SF).unflatten(1, rows_SKD.shape[1:])


def per_token_pieces(
    rows_SKD: Tensor, sequence_index_T: Tensor, numerics: ModelNumerics = DEFAULT_NUMERICS
) -> tuple[Tensor, ...]:
    """The K pieces [T, D] of per_token(rows_SKD, sequence_index_T). Unbinding per_token's
    [T, K, D] costs a stack of the K gradients in the backward (a [T, K, D] copy: about 1 ms a
    Wan-14B block on an H200 at 32,760 tokens); with numerics.split_pieces each piece is a GEMM
    of its own over the same one-hot, whose backward takes its piece's gradient as it comes."""
    if not numerics.split_pieces:
        return per_token(rows_SKD, sequence_index_T, numerics).unbind(dim=1)
    num_sequences = rows_SKD.shape[0]
    one_hot_TS = _one_hot(sequence_index_T, num_sequences, rows_SKD.dtype, numerics.row_multiple)
    padded = one_hot_TS.shape[1]
    if padded != num_sequences:
        rows_SKD = torch.nn.functional.pad(rows_SKD, (0, 0, 0, 0, 0, padded - num_sequences))
    return tuple(one_hot_TS @ rows_SD for rows_SD in rows_SKD.unbind(dim=1))


class _GatheredPieces(torch.autograd.Function):
    """The K pieces [T, D] of rows_SKD[sequence_index_T] by indexing (compiled, a consumer reads
    the rows in place: no [T, K, D] tensor is written); the backward is per_token's one-hot GEMM,
    one a piece, which sums each sequence's tokens without atomics and takes each piece's
    gradient as it comes (no [T, K, D] stack of them)."""

    @staticmethod
    def forward(
        ctx, rows_SKD: Tensor, sequence_index_T: Tensor, row_multiple: int
    ) -> tuple[Tensor, ...]:
        ctx.save_for_backward(sequence_index_T)
        ctx.num_sequences, ctx.row_multiple = rows_SKD.shape[0], row_multiple
        ctx.set_materialize_grads(False)
        return tuple(rows_SD[sequence_index_T] for rows_SD in rows_SKD.unbind(dim=1))

    @staticmethod
    def backward(ctx, *grads_TD: Tensor | None):
        (sequence_index_T,) = ctx.saved_tensors
        num_sequences = ctx.num_sequences
        given = next(g for g in grads_TD if g is not None)
        one_hot_ST = _one_hot(
            sequence_index_T, num_sequences, given.dtype, ctx.row_multiple
        ).transpose(0, 1)
        rows = [
            given.new_zeros(one_hot_ST.shape[0], given.shape[1]) if g is None else one_hot_ST @ g
            for g in grads_TD
        ]
        return torch.stack(rows, dim=1)[:num_sequences], None, None


def gathered_pieces(
    rows_SKD: Tensor, sequence_index_T: Tensor, row_multiple: int = DEFAULT_NUMERICS.row_multiple
) -> tuple[Tensor, ...]:
    """per_token_pieces' values by indexing, its GEMMs (sequences padded to `row_multiple`) in
    the backward: for a compiled region that reads each token's rows (the output head), where
    the gathers fuse into the kernel that uses them and no [T, K, D] tensor is written or
    read."""
    return _GatheredPieces.apply(rows_SKD, sequence_index_T, row_multiple)


def padded_rows(rows_SKD: Tensor, row_multiple: int = DEFAULT_NUMERICS.row_multiple) -> Tensor:
    """rows_SKD with zero rows up to the row multiple: for gathered_pieces in a compiled
    region, whose graphs then never see a count of 1 sequence (torch.compile specialises sizes
    0 and 1: a one-clip step would compile the region again), and whose backward GEMM gets
    aligned rows."""
    num_sequences = rows_SKD.shape[0]
    padded = -(-num_sequences // row_multiple) * row_multiple
    if padded == num_sequences:
        return rows_SKD
    return torch.nn.functional.pad(rows_SKD, (0, 0, 0, 0, 0, padded - num_sequences))


def modulation_per_token(
    table_SKD: Tensor,
    offset_KD: Tensor,
    sequence_index_T: Tensor,
    numerics: ModelNumerics = DEFAULT_NUMERICS,
) -> tuple[Tensor, ...]:
    """The K modulation vectors [T, D] of each token: (learned offset + its sequence's row).

    The sum is formed per sequence (S rows) and only then expanded to tokens.
    """
    return per_token_pieces(table_SKD + offset_KD, sequence_index_T, numerics)
