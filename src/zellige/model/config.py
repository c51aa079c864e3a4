"""Model sizes: the registry of models (MODELS: each pairs the planning core's preset, the one
table of sizes, with what the runnable model adds), the DiTConfig of a runnable model, and the
numerics its layers use.

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


@dataclass(kw_only=True, frozen=True, slots=True)
class ModelEntry:
    """One model of the registry: its planning shape, the planning core's preset `preset`
    (cpp/src/model_spec.cc, the one table of sizes), and what building it runnable adds. Its
    DiTConfig takes every size from that ModelSpec, so the two cannot disagree; block_kind
    follows the spec's attention (cross-attention: VideoDiT blocks, joint: MMDiT blocks)."""

    name: str  # the runnable model's name (zellige.model, zellige.train): "tiny-cpu"
    preset: str  # the planning core's preset of its shape (--model of the CLI): "tiny"
    # what only the runnable model reads: the text encoder's width E, the VAE's latent
    # channels and the timestep embedding's width
    text_dim: int = 4096  # umT5-XXL's width in Wan
    latent_channels: int = 16
    freq_dim: int = 256

    @property
    def spec(self):  # -> _core.ModelSpec
        from zellige import _core  # the compiled core, loaded where an entry is first read

        return _core.model_preset(self.preset)

    @property
    def block_kind(self) -> str:
        """ "mmdit" (model/mmdit.py: text joins attention) or "video" (model/dit.py)."""
        return "mmdit" if self.spec.joint_attention else "video"

    def dit_config(self) -> DiTConfig:
        """The runnable model at the preset's sizes, with this entry's extras."""
        extras = dict(
            text_dim=self.text_dim, latent_channels=self.latent_channels, freq_dim=self.freq_dim
        )
        return dit_from_spec(self.spec, name=self.name, **extras)


def dit_from_spec(spec, *, name: str | None = None, **extras: int) -> DiTConfig:
    """A runnable model with every size of the planning core's ModelSpec `spec` (a preset's or
    a user's spec file's), named `name` (default: the spec's), and DiTConfig's runnable-only
    fields (`extras`: text_dim, latent_channels, freq_dim, ...) as given or by default."""
    return DiTConfig(
        name=spec.name if name is None else name,
        width=spec.width,
        num_layers=spec.num_layers,
        num_heads=spec.num_heads,
        ffn_width=spec.ffn_width,
        text_tokens=spec.text_tokens,
        joint_attention=spec.joint_attention,
        num_double_layers=spec.num_double_layers,
        **extras,
    )


# The registry: one entry per planning-core preset. Wan 2.1's cross-attention DiTs (1.3B, 14B)
# and a CPU test size of them, seconds per step on two cores (head_dim 16 keeps all three RoPE
# axes non-trivial); FLUX.1 / Open-Sora 2.0 and HunyuanVideo MMDiTs (16-channel latents with
# 1x2x2 patches) and the CPU size as an MMDiT (two double-stream blocks, then one single).
MODELS: tuple[ModelEntry, ...] = (
    ModelEntry(name="wan-1.3b", preset="wan-1.3b"),
    ModelEntry(name="wan-14b", preset="wan-14b"),
    ModelEntry(name="tiny-cpu", preset="tiny", text_dim=32, latent_channels=4, freq_dim=32),
    ModelEntry(name="mmdit-11b", preset="mmdit-11b"),
    ModelEntry(name="hunyuan-13b", preset="hunyuan-13b"),
    ModelEntry(
        name="mmdit-tiny-cpu", preset="mmdit-tiny", text_dim=32, latent_channels=4, freq_dim=32
    ),
)


def model_entry(name: str) -> ModelEntry:
    """The registry's entry of a model by its runnable name ("tiny-cpu") or its planning
    core's preset name ("tiny"); ValueError listing both kinds of name."""
    for entry in MODELS:
        if name in (entry.name, entry.preset):
            return entry
    names = [entry.name for entry in MODELS]
    presets = [entry.preset for entry in MODELS if entry.preset != entry.name]
    raise ValueError(
        f"unknown model preset {name!r}; allowed: {', '.join(names)} (or the planning core's "
        f"names {', '.join(presets)})"
    )


def model_preset(name: str, **overrides: int) -> DiTConfig:
    """A preset by name, optionally with fields replaced (e.g. num_layers=4 for a width probe; an
    MMDiT then keeps its share of double-stream blocks (with_layers) unless num_double_layers is
    given too)."""
    if name not in model_preset_names():
        allowed = ", ".join(model_preset_names())
        raise ValueError(f"unknown model preset {name!r}; allowed: {allowed}")
    preset = model_entry(name).dit_config()
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
    """The runnable models' names (model_preset's), one per registry entry."""
    return [entry.name for entry in MODELS]
