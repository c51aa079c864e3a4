"""The reference video DiTs over one rank's packed tokens, attention pluggable: Wan-style
(cross-attention to text, dit.py) and MMDiT (joint text-visual attention, mmdit.py)."""

from zellige.model.attention import AttentionFn, local_attention
from zellige.model.blocks import DiTBlock
from zellige.model.config import DiTConfig, ModelNumerics, model_preset, model_preset_names
from zellige.model.dit import PackedTokens, VideoDiT
from zellige.model.mmdit import JointTokens, MMDiT

__all__ = [
    "AttentionFn",
    "DiTBlock",
    "DiTConfig",
    "JointTokens",
    "MMDiT",
    "ModelNumerics",
    "PackedTokens",
    "VideoDiT",
    "build_model",
    "local_attention",
    "model_preset",
    "model_preset_names",
]


def build_model(config: DiTConfig, numerics: ModelNumerics | None = None) -> VideoDiT | MMDiT:
    """The reference model a config describes: MMDiT for joint attention, else VideoDiT;
    numerics: how it makes its per-token conditioning rows (default: ModelNumerics())."""
    numerics = ModelNumerics() if numerics is None else numerics
    return MMDiT(config, numerics) if config.joint_attention else VideoDiT(config, numerics)
