"""The reference video DiT: Wan-style blocks over one rank's packed tokens, attention pluggable."""

from zellige.model.attention import AttentionFn, local_attention
from zellige.model.blocks import DiTBlock
from zellige.model.config import DiTConfig, model_preset, model_preset_names
from zellige.model.dit import PackedTokens, VideoDiT

__all__ = [
    "AttentionFn",
    "DiTBlock",
    "DiTConfig",
    "PackedTokens",
    "VideoDiT",
    "local_attention",
    "model_preset",
    "model_preset_names",
]
