"""Model sizes: the public presets of shared/REFERENCE.md and a tiny size for CPU tests.

Legend for tensor names across zellige.model: T tokens on this rank, S sequences on this rank,
X text tokens of those sequences (concatenated), N heads, H head dim, D model width, F FFN width,
C latent channels per token (latent channels x patch volume), E text-encoder width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelNumerics:
    """How the reference models make each token's conditioning rows: the same values either way,
    different speeds (model/conditioning.py). Passed to the model's constructor.

    row_multiple: the one-hot per-token GEMM pads the sequence count to a multiple of this (a
        bf16 one-hot [T, S] whose rows are not 16-byte aligned, S = 21 images or 1 clip, sends
        cuBLAS to slow unaligned kernels: an H200 ran the block's [T, 21] @ [21, 6D] at about
        1 TB/s); 1: no padding.
    split_pieces: one one-hot GEMM per modulation piece, whose backward takes each piece's
        gradient as it comes (no [T, K, D] stack of them).
    gathered_head: the Wan output head gathers each token's shift and scale rows inside its
        compiled region (no [T, 2, D] tensor; on an H200 0.3 ms less of a wan-14b width step's
        18.8 ms outside the blocks, the same loss and peak)."""

    row_multiple: int = 8
    split_pieces: bool = False
    gathered_head: bool = True

    def __post_init__(self) -> None:
        if self.row_multiple < 1:
            raise ValueError(f"the row multiple must be >= 1, got {self.row_multiple}")


@dataclass(kw_only=True, slots=True, frozen=True)
class DiTConfig:
    name: str
    width: int  # D
    num_layers: int  # all blocks (MMDiT: double-stream + single-stream), as ModelSpec counts them
    num_heads: int  # N
    ffn_width: int  # F
    text_tokens: int = 512  # default text length the data produces per sequence
    text_dim: int = 4096  # E: umT5-XXL width in Wan
    latent_channels: int = 16  # VAE latent channels
    patch_t: int = 1
    patch_hw: int = 2
    freq_dim: int = 256  # sinusoidal timestep embedding width
    eps: float = 1e-6
    rope_theta: float = 10000.0
    # MMDiT (model/mmdit.py): text joins self-attention (no cross-attention); the first
    # num_double_layers blocks keep separate text and visual weights, the rest share them
    joint_attention: bool = False
    num_double_layers: int = 0

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    @property
    def token_channels(self) -> int:
        """C: one token's latent values (latent channels x patch volume)."""
        return self.latent_channels * self.patch_t * self.patch_hw * self.patch_hw

    def __post_init__(self) -> None:
        if self.width % self.num_heads != 0:
            raise ValueError(f"width {self.width} is not a multiple of num_heads {self.num_heads}")
        if self.head_dim % 2 != 0 or self.head_dim < 6:
            raise ValueError(f"head_dim {self.head_dim} must be even and >= 6 for 3D RoPE")
        if not 0 <= self.num_double_layers <= self.num_layers:
            raise ValueError(
                f"num_double_layers {self.num_double_layers} must be in [0, num_layers "
                f"{self.num_layers}]"
            )
        if self.num_double_layers and not self.joint_attention:
            raise ValueError("num_double_layers > 0 needs joint_attention (an MMDiT)")

    @property
    def num_single_layers(self) -> int:
        """MMDiT blocks with weights shared by text and visual tokens (0 for Wan-style)."""
        return self.num_layers - self.num_double_layers if self.joint_attention else 0


_PRESETS: dict[str, DiTConfig] = {
    "wan-1.3b": DiTConfig(name="wan-1.3b", width=1536, num_layers=30, num_heads=12, ffn_width=8960),
    "wan-14b": DiTConfig(name="wan-14b", width=5120, num_layers=40, num_heads=40, ffn_width=13824),
    # Seconds per step on two CPU cores; head_dim 16 keeps all three RoPE axes non-trivial.
    "tiny-cpu": DiTConfig(
        name="tiny-cpu",
        width=64,
        num_layers=2,
        num_heads=4,
        ffn_width=128,
        text_tokens=8,
        text_dim=32,
        latent_channels=4,
        freq_dim=32,
    ),
    # MMDiT presets (model/mmdit.py), the shapes of the planning core's presets: FLUX.1 / Open-Sora
    # 2.0 (19 double + 38 single blocks, T5-XXL text) and HunyuanVideo (20 + 40, 256 text tokens
    # of a 4096-wide LLM encoder); 16-channel latents with 1x2x2 patches in both.
    "mmdit-11b": DiTConfig(
        name="mmdit-11b",
        width=3072,
        num_layers=57,
        num_double_layers=19,
        num_heads=24,
        ffn_width=4 * 3072,
        text_tokens=512,
        joint_attention=True,
    ),
    "hunyuan-13b": DiTConfig(
        name="hunyuan-13b",
        width=3072,
        num_layers=60,
        num_double_layers=20,
        num_heads=24,
        ffn_width=4 * 3072,
        text_tokens=256,
        joint_attention=True,
    ),
    # tiny-cpu's sizes as an MMDiT: two double-stream blocks then one single-stream block
    "mmdit-tiny-cpu": DiTConfig(
        name="mmdit-tiny-cpu",
        width=64,
        num_layers=3,
        num_double_layers=2,
        num_heads=4,
        ffn_width=128,
        text_tokens=8,
        text_dim=32,
        latent_channels=4,
        freq_dim=32,
        joint_attention=True,
    ),
}


def model_preset(name: str, **overrides: int) -> DiTConfig:
    """A preset by name, optionally with fields replaced (e.g. num_layers=4 for a width probe; an
    MMDiT then keeps its share of double-stream blocks (with_layers) unless num_double_layers is
    given too)."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(_PRESETS)}")
    preset = _PRESETS[name]
    if "num_layers" in overrides and "num_double_layers" not in overrides:
        preset = with_layers(preset, overrides["num_layers"])
    return dataclasses.replace(preset, **overrides)


def with_layers(config: DiTConfig, num_layers: int) -> DiTConfig:
    """`config` cut (or grown) to num_layers blocks; an MMDiT keeps its share of double-stream
    blocks, at least one (2 of mmdit-11b's blocks: 1 double + 1 single)."""
    double = 0
    if config.num_double_layers:
        share = config.num_double_layers / config.num_layers
        double = min(max(1, round(share * num_layers)), num_layers)
    return dataclasses.replace(config, num_layers=num_layers, num_double_layers=double)


def model_preset_names() -> list[str]:
    return list(_PRESETS)
