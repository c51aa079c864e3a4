"""WanTransformer3DModel (text by cross-attention) on a rank's packed tokens.

The model's forward takes one latent video per batch row; packed, the rank's held tokens are one
row of T tokens from several sequences. Everything per token runs through the model's own modules:
the patch embedding (its Conv3d on each token's patch), the condition embedder (per held chunk,
then gathered per token), every block unedited (it accepts a timestep projection per token, the
form Wan 2.2's per-token timesteps use), norm_out and proj_out. The RoPE of each token is read from
the model's rope tables at its (t, h, w) position in its own sequence. Attention runs through
_WanZelligeProcessor, installed with set_attn_processor: the projections, q/k norms and RoPE of
WanAttnProcessor, then Zellige's attention (self) or cross-attention (text) instead of SDPA.

Legend: T held visual tokens, X held text rows (each held chunk's whole text), C held chunks,
N heads, H head dim, D width, P patch features (in_channels * p_t * p_h * p_w).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers.models.transformers import transformer_wan
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch import Tensor

from zellige.integrations.diffusers._common import PackedTransformer, StepSlot, refuse_mask

if TYPE_CHECKING:
    from diffusers import WanTransformer3DModel

    from zellige.balancer import BalancedStep


def _rotate(x: Tensor, freqs_cos: Tensor, freqs_sin: Tensor) -> Tensor:
    """WanAttnProcessor's RoPE (a function local to its __call__ there), on [1, T, N, H]."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


class _WanZelligeProcessor:
    """WanAttnProcessor with Zellige's attention: self-attention (no encoder_hidden_states) over
    each held token's own sequence, cross-attention to its own sequence's text."""

    def __init__(self, slot: StepSlot) -> None:
        self._slot = slot

    def __call__(
        self,
        attn,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        refuse_mask(attention_mask)
        step = self._slot.get()
        # the model's own projection helper (fused or not), as WanAttnProcessor calls it
        query, key, value = transformer_wan._get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query = _rotate(query, *rotary_emb)
            key = _rotate(key, *rotary_emb)
        attend = step.attention if encoder_hidden_states is None else step.cross_attention
        out_1TD = attend(query[0], key[0], value[0])[None].flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out_1TD))


class PackedWan(PackedTransformer):
    """WanTransformer3DModel (text-to-video) on this rank's held tokens.

    packed(step, hidden_states, timestep, encoder_hidden_states) -> [T, p_t*p_h*p_w*out_channels]:
        hidden_states [T, P]: held patches (samples' tokens from `patchify(latents, patch_size)`);
        timestep [C]: each held chunk's timestep, as the model takes it (0..1000);
        encoder_hidden_states [X, text_dim]: held text rows (step.inputs().text / route_text);
    the output of each token in the model's layout (`unpatchify` turns a sample's rows back into
    [out_channels, F, H, W], as the model's forward returns it)."""

    default_processor = WanAttnProcessor

    def __init__(self, model: WanTransformer3DModel) -> None:
        config = model.config
        for key in ("image_dim", "added_kv_proj_dim", "pos_embed_seq_len"):
            if config.get(key) is not None:
                raise ValueError(
                    f"WanTransformer3DModel with {key} = {config[key]} (image conditioning, I2V) "
                    "is not supported: Zellige runs the text-to-video configuration (image_dim, "
                    "added_kv_proj_dim and pos_embed_seq_len unset)"
                )
        super().__init__(model)

    def _processor(self, slot: StepSlot) -> _WanZelligeProcessor:
        return _WanZelligeProcessor(slot)

    def forward(
        self,
        step: BalancedStep,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
    ) -> Tensor:
        self._begin(step, joint=False)
        model = self.model
        p_t, p_h, p_w = model.config.patch_size
        position_T3 = step.position_ids.index_select(0, step.visual_index)
        chunk_T = step.chunk_index.index_select(0, step.visual_index)

        # each token's patch through the model's Conv3d (kernel = stride = patch): one output
        patches = hidden_states.unflatten(1, (-1, p_t, p_h, p_w))
        x_1TD = model.patch_embedding(patches).flatten(1)[None]

        temb_CD, proj_CE, text_1XD, _ = model.condition_embedder(
            timestep, encoder_hidden_states[None]
        )
        temb_1TD = temb_CD.index_select(0, chunk_T)[None]
        # [1, T, 6, D]: the blocks' per-token form of the timestep projection
        proj_1T6D = proj_CE.unflatten(1, (6, -1)).index_select(0, chunk_T)[None]
        rotary = _rope(model.rope, position_T3)

        for block in model.blocks:
            if torch.is_grad_enabled() and model.gradient_checkpointing:
                x_1TD = model._gradient_checkpointing_func(
                    block, x_1TD, text_1XD, proj_1T6D, rotary
                )
            else:
                x_1TD = block(x_1TD, text_1XD, proj_1T6D, rotary)

        # the model's output modulation for per-token timestep embeddings
        table = model.scale_shift_table.unsqueeze(0)
        shift, scale = (table + temb_1TD.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
        x_1TD = (model.norm_out(x_1TD.float()) * (1 + scale) + shift).type_as(x_1TD)
        return model.proj_out(x_1TD)[0]


def _rope(rope, position_T3: Tensor) -> tuple[Tensor, Tensor]:
    """(cos, sin) [1, T, 1, H] of each token at its (t, h, w): WanRotaryPosEmbed's tables, read
    per position rather than for one whole grid."""
    sizes = [rope.t_dim, rope.h_dim, rope.w_dim]

    def gather(table: Tensor) -> Tensor:
        parts = table.split(sizes, dim=1)
        rows = [part.index_select(0, position_T3[:, axis]) for axis, part in enumerate(parts)]
        return torch.cat(rows, dim=-1)[None, :, None, :]

    return gather(rope.freqs_cos), gather(rope.freqs_sin)


def patchify(latents: Tensor, patch_size: tuple[int, int, int], *, channels_last: bool = False):
    """One sample's latents [C, F, H, W] -> its tokens [t*h*w, C*p_t*p_h*p_w] in (t, h, w) raster
    order (t = F / p_t, ...): each row in the layout the patch embedding reads (C, p_t, p_h,
    p_w), or with channels_last the layout the model outputs (p_t, p_h, p_w, C), e.g. a target."""
    p_t, p_h, p_w = patch_size
    channels, frames, height, width = latents.shape
    if frames % p_t or height % p_h or width % p_w:
        raise ValueError(
            f"latents of {frames}x{height}x{width} (F x H x W) do not divide into patches of "
            f"{p_t}x{p_h}x{p_w}"
        )
    x = latents.reshape(channels, frames // p_t, p_t, height // p_h, p_h, width // p_w, p_w)
    order = (1, 3, 5, 2, 4, 6, 0) if channels_last else (1, 3, 5, 0, 2, 4, 6)
    return x.permute(*order).reshape((frames // p_t) * (height // p_h) * (width // p_w), -1)


def unpatchify(
    tokens: Tensor, grid_thw: tuple[int, int, int], patch_size: tuple[int, int, int]
) -> Tensor:
    """One sample's output rows [t*h*w, p_t*p_h*p_w*C] -> [C, F, H, W], as the model's forward
    returns it."""
    t, h, w = grid_thw
    p_t, p_h, p_w = patch_size
    x = tokens.reshape(t, h, w, p_t, p_h, p_w, -1).permute(6, 0, 3, 1, 4, 2, 5)
    return x.reshape(-1, t * p_t, h * p_h, w * p_w)
