"""Synthetic latents and text features with learnable structure, deterministic by seed.

No VAE or text encoder: each sequence draws a class; its text features are that class's vector
plus a position pattern, and its clean latents are the class's mean plus smooth functions of the
token's (t, h, w) whose coefficients depend on the class. So a model can only denoise well by
using its text, timestep and RoPE positions, and the rectified-flow loss falls when training
works (quickly for the class mean, slowly for the waves).

Everything about a sequence (class, clean latents, noise, flow time) comes from a generator
seeded by (seed, step, sequence id): the same numbers whichever rank loads it or holds it.

A rank's tensors for one step (`source_tensors`) are written into one buffer per kind: a step of
45 sequences carries 23,040 text rows of 4,096 features (377 MB in float32), so each sequence's
text is a copy of its class's rows (made once per class) into its place, with no per-sequence
tensors to concatenate, and in the model's compute dtype where the model casts text to it first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

NUM_CLASSES = 16
NUM_WAVES = 4  # sinusoidal components of the clean latents
NOISE_STD = 0.1  # per-token detail that no model can predict
CLASS_SHARE = 0.8  # variance of the clean latents explained by the class mean (the rest: waves)
MAX_TEXT_TOKENS = 1024


@dataclass(kw_only=True, slots=True)
class SequenceSample:
    """One rectified-flow example: x_t = (1 - t) x0 + t eps, velocity v = eps - x0."""

    noisy_LC: Tensor
    velocity_LC: Tensor
    positions_L3: Tensor  # int64 (t, h, w)
    timestep: float
    text_XE: Tensor


def grid_positions(grid_t: int, grid_h: int, grid_w: int) -> Tensor:
    """(t, h, w) of every token of a latent grid in raster order, [t*h*w, 3] int64."""
    index = torch.arange(grid_t * grid_h * grid_w, dtype=torch.int64)
    return torch.stack((index // (grid_h * grid_w), (index // grid_w) % grid_h, index % grid_w), 1)


@dataclass(kw_only=True, slots=True)
class SourceTensors:
    """One rank's loaded sequences for a step, concatenated in the order given."""

    noisy_TC: Tensor
    velocity_TC: Tensor
    timestep_T: Tensor  # each sequence's flow time, repeated per token (float32)
    text_XE: Tensor
    text_timestep_X: Tensor  # each sequence's flow time, repeated per text row (float32)
    text_tokens: list[int] = field(default_factory=list)  # per sequence


class SyntheticLatents:
    def __init__(self, *, token_channels: int, text_dim: int, seed: int) -> None:
        self.token_channels = token_channels
        self.seed = seed
        tables = torch.Generator().manual_seed(_mix(seed, 0x7E47))
        self.class_text_KE = torch.randn(NUM_CLASSES, text_dim, generator=tables)
        self.text_position_XE = 0.5 * torch.randn(MAX_TEXT_TOKENS, text_dim, generator=tables)
        # per class: wave frequencies over (t, h, w), phases and channel amplitudes
        self.frequency_KW3 = 0.05 + 0.6 * torch.rand(NUM_CLASSES, NUM_WAVES, 3, generator=tables)
        self.phase_KW = 2 * torch.pi * torch.rand(NUM_CLASSES, NUM_WAVES, generator=tables)
        self.class_mean_KC = CLASS_SHARE**0.5 * torch.randn(
            NUM_CLASSES, token_channels, generator=tables
        )
        amplitude_scale = (2.0 * (1 - CLASS_SHARE) / NUM_WAVES) ** 0.5  # unit variance in all
        self.amplitude_KWC = amplitude_scale * torch.randn(
            NUM_CLASSES, NUM_WAVES, token_channels, generator=tables
        )
        # per (class, dtype): the class's text rows, as many as asked for so far
        self._text_rows: dict[tuple[int, torch.dtype], Tensor] = {}

    def sample(
        self, *, step: int, sequence_id: int, grid_thw: tuple[int, int, int], text_tokens: int
    ) -> SequenceSample:
        _check_text_tokens(text_tokens)
        label, sample = self._latents(step, sequence_id, grid_thw)
        sample.text_XE = self.class_text_KE[label] + self.text_position_XE[:text_tokens]
        return sample

    def source_tensors(
        self,
        *,
        step: int,
        sequences: Sequence,
        text_dtype: torch.dtype = torch.float32,
    ) -> SourceTensors:
        """The samples of `sequences` (each with id, num_tokens, text_tokens, grid_t/h/w) at
        `step`, concatenated: what sample() gives each, the text rows in `text_dtype` (its
        rounding of the float32 rows: pass the model's compute dtype only where the model
        casts text to it before using it)."""
        for sequence in sequences:
            _check_text_tokens(sequence.text_tokens)
        num_tokens = [s.num_tokens for s in sequences]
        text_tokens = [s.text_tokens for s in sequences]
        channels, text_dim = self.token_channels, self.class_text_KE.shape[1]
        noisy_TC = torch.empty(sum(num_tokens), channels)
        velocity_TC = torch.empty(sum(num_tokens), channels)
        text_XE = torch.empty(sum(text_tokens), text_dim, dtype=text_dtype)
        timesteps = []
        token, row = 0, 0
        for sequence in sequences:
            grid_thw = (sequence.grid_t, sequence.grid_h, sequence.grid_w)
            label, sample = self._latents(step, sequence.id, grid_thw)
            end = token + sequence.num_tokens
            noisy_TC[token:end] = sample.noisy_LC
            velocity_TC[token:end] = sample.velocity_LC
            token = end
            text_XE[row : row + sequence.text_tokens] = self._class_text(
                label, sequence.text_tokens, text_dtype
            )
            row += sequence.text_tokens
            timesteps.append(sample.timestep)
        timesteps_S = torch.tensor(timesteps, dtype=torch.float32)

        def repeated(counts: list[int]) -> Tensor:
            return torch.repeat_interleave(timesteps_S, torch.tensor(counts, dtype=torch.int64))

        return SourceTensors(
            noisy_TC=noisy_TC,
            velocity_TC=velocity_TC,
            timestep_T=repeated(num_tokens),
            text_XE=text_XE,
            text_timestep_X=repeated(text_tokens),
            text_tokens=text_tokens,
        )

    def _class_text(self, label: int, text_tokens: int, dtype: torch.dtype) -> Tensor:
        """The first text_tokens text rows of class `label` in `dtype` (sample()'s values)."""
        rows = self._text_rows.get((label, dtype))
        if rows is None or rows.shape[0] < text_tokens:
            rows = self.class_text_KE[label] + self.text_position_XE[:text_tokens]
            self._text_rows[label, dtype] = rows = rows.to(dtype)
        return rows[:text_tokens]

    def _latents(
        self, step: int, sequence_id: int, grid_thw: tuple[int, int, int]
    ) -> tuple[int, SequenceSample]:
        """The sequence's class and its sample without text (text_XE left empty)."""
        generator = torch.Generator().manual_seed(_mix(self.seed, step, sequence_id))
        label = int(torch.randint(NUM_CLASSES, (1,), generator=generator))
        # logit-normal flow time, as in SD3-style rectified-flow training
        timestep = float(torch.sigmoid(torch.randn((), generator=generator)))
        positions_L3 = grid_positions(*grid_thw)
        num_tokens = positions_L3.shape[0]
        waves_LW = torch.sin(
            positions_L3.float() @ self.frequency_KW3[label].T + self.phase_KW[label]
        )
        clean_LC = self.class_mean_KC[label] + waves_LW @ self.amplitude_KWC[label]
        clean_LC += NOISE_STD * torch.randn(num_tokens, self.token_channels, generator=generator)
        noise_LC = torch.randn(num_tokens, self.token_channels, generator=generator)
        return label, SequenceSample(
            noisy_LC=(1 - timestep) * clean_LC + timestep * noise_LC,
            velocity_LC=noise_LC - clean_LC,
            positions_L3=positions_L3,
            timestep=timestep,
            text_XE=self.class_text_KE[:0, :0],
        )


def _check_text_tokens(text_tokens: int) -> None:
    if text_tokens > MAX_TEXT_TOKENS:
        raise ValueError(f"text_tokens {text_tokens} above the supported {MAX_TEXT_TOKENS}")


def _mix(*values: int) -> int:
    """A 63-bit seed from several integers (numpy's SeedSequence hashing)."""
    return int(np.random.SeedSequence(list(values)).generate_state(1, np.uint64)[0] >> np.uint64(1))
