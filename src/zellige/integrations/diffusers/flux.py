"""FluxTransformer2DModel (joint attention over text and image tokens) on a rank's packed tokens.

Packed, each held token is a batch row of its own ([rows, 1, D]), so that every per-sample
modulation of the model becomes a per-token one by gathering each token's timestep embedding.
The single-stream blocks run unedited on the joint held list (with an empty text part). A
double-stream block takes one `temb` for both streams, which packed tokens cannot share (the two
streams hold different tokens), so its forward is followed step by step on the block's own
submodules (`_double_block`, the same operations in the same order). Positions: visual tokens
take their (t, h, w) as Flux's image ids (t = 0 for an image), text tokens zeros, as the Flux
pipelines build them, through the model's own pos_embed. Attention runs through
_FluxZelligeProcessor, installed with set_attn_processor: FluxAttnProcessor's projections, q/k
norms and RoPE, then Zellige's attention over the joint held list instead of SDPA.

Legend: V held visual tokens, L held text tokens, T = V + L (the joint held list), C held
chunks, N heads, H head dim, D width.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers import transformer_flux
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor
from torch import Tensor

from zellige.integrations.diffusers._common import PackedTransformer, StepSlot, refuse_mask

if TYPE_CHECKING:
    from diffusers import FluxTransformer2DModel

    from zellige.balancer import BalancedStep


class _FluxZelligeProcessor:
    """FluxAttnProcessor with Zellige's attention over each held token's own sequence (its text
    and image tokens). Double-stream layers get the visual rows as hidden_states and the text rows
    as encoder_hidden_states; single-stream layers the joint held list."""

    def __init__(self, slot: StepSlot) -> None:
        self._slot = slot

    def __call__(
        self,
        attn,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ):
        refuse_mask(attention_mask)
        step = self._slot.get()
        query, key, value, encoder_query, encoder_key, encoder_value = (
            transformer_flux._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        )
        heads = (-1, attn.head_dim)
        query = attn.norm_q(query.unflatten(-1, heads))[:, 0]  # rows [., 1, N, H] -> [., N, H]
        key = attn.norm_k(key.unflatten(-1, heads))[:, 0]
        value = value.unflatten(-1, heads)[:, 0]
        joint = encoder_hidden_states is not None
        if joint:
            encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, heads))[:, 0]
            encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, heads))[:, 0]
            encoder_value = encoder_value.unflatten(-1, heads)[:, 0]
            query = step.join(query, encoder_query)
            key = step.join(key, encoder_key)
            value = step.join(value, encoder_value)
        if image_rotary_emb is not None and query.shape[0] > 0:  # (its reshape needs a row)
            query = apply_rotary_emb(query[None], image_rotary_emb, sequence_dim=1)[0]
            key = apply_rotary_emb(key[None], image_rotary_emb, sequence_dim=1)[0]
        out_TND = step.attention(query, key, value)
        out_T1D = out_TND.flatten(1).to(query.dtype)[:, None]
        if not joint:
            return out_T1D
        visual, text = step.split(out_T1D)
        visual = attn.to_out[1](attn.to_out[0](visual.contiguous()))
        return visual, attn.to_add_out(text.contiguous())


def _double_block(block, x_V1D, c_L1D, temb_VD, temb_LD, rotary):
    """FluxTransformerBlock.forward with a timestep embedding per row for each stream."""
    norm_x, gate_msa, shift_mlp, scale_mlp, gate_mlp = block.norm1(x_V1D, emb=temb_VD)
    norm_c, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = block.norm1_context(
        c_L1D, emb=temb_LD
    )
    attn_output, context_attn_output = block.attn(
        hidden_states=norm_x, encoder_hidden_states=norm_c, image_rotary_emb=rotary
    )
    x_V1D = x_V1D + gate_msa.unsqueeze(1) * attn_output
    norm_x = block.norm2(x_V1D) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
    x_V1D = x_V1D + gate_mlp.unsqueeze(1) * block.ff(norm_x)

    c_L1D = c_L1D + c_gate_msa.unsqueeze(1) * context_attn_output
    norm_c = block.norm2_context(c_L1D) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
    c_L1D = c_L1D + c_gate_mlp.unsqueeze(1) * block.ff_context(norm_c)
    if c_L1D.dtype == torch.float16:
        c_L1D = c_L1D.clip(-65504, 65504)
    return c_L1D, x_V1D


class PackedFlux(PackedTransformer):
    """FluxTransformer2DModel on this rank's held tokens.

    packed(step, hidden_states, timestep, encoder_hidden_states, pooled_projections, guidance)
    -> [V, patch_size**2 * out_channels]:
        hidden_states [V, in_channels]: held visual tokens (Flux's packed latent rows);
        encoder_hidden_states [L, joint_attention_dim]: held text tokens;
        timestep [C], pooled_projections [C, pooled_projection_dim], guidance [C] (only with
        guidance_embeds): each held chunk's values, as the model takes them (timestep in 0..1);
    the output of each visual token, as the model's forward returns it for that token."""

    default_processor = FluxAttnProcessor

    def __init__(self, model: FluxTransformer2DModel) -> None:
        super().__init__(model)

    def _processor(self, slot: StepSlot) -> _FluxZelligeProcessor:
        return _FluxZelligeProcessor(slot)

    def forward(
        self,
        step: BalancedStep,
        hidden_states: Tensor,
        timestep: Tensor,
        encoder_hidden_states: Tensor,
        pooled_projections: Tensor,
        guidance: Tensor | None = None,
    ) -> Tensor:
        self._begin(step, joint=True)
        model = self.model
        if (guidance is not None) != model.config.guidance_embeds:
            raise ValueError(
                "FluxTransformer2DModel with guidance_embeds = "
                f"{model.config.guidance_embeds} needs guidance "
                f"{'per held chunk' if model.config.guidance_embeds else '= None'}"
            )
        chunk_V = step.chunk_index.index_select(0, step.visual_index)
        chunk_L = step.chunk_index.index_select(0, step.text_index)

        x_VD = model.x_embedder(hidden_states)
        timestep = timestep.to(x_VD.dtype) * 1000
        if guidance is None:
            temb_CD = model.time_text_embed(timestep, pooled_projections)
        else:
            guidance = guidance.to(x_VD.dtype) * 1000
            temb_CD = model.time_text_embed(timestep, guidance, pooled_projections)
        c_LD = model.context_embedder(encoder_hidden_states)
        temb_VD, temb_LD = temb_CD.index_select(0, chunk_V), temb_CD.index_select(0, chunk_L)

        image_ids = step.position_ids.index_select(0, step.visual_index).to(x_VD.dtype)
        text_ids = image_ids.new_zeros((chunk_L.shape[0], 3))
        rotary = model.pos_embed(step.join(image_ids, text_ids))  # (cos, sin) [T, H]

        checkpointed = torch.is_grad_enabled() and model.gradient_checkpointing
        x_V1D, c_L1D = x_VD[:, None], c_LD[:, None]
        for block in model.transformer_blocks:
            args = (block, x_V1D, c_L1D, temb_VD, temb_LD, rotary)
            if checkpointed:
                c_L1D, x_V1D = model._gradient_checkpointing_func(_double_block, *args)
            else:
                c_L1D, x_V1D = _double_block(*args)

        x_T1D, temb_TD = step.join(x_V1D, c_L1D), step.join(temb_VD, temb_LD)
        empty = x_T1D[:, :0]  # the single blocks' text part: the joint list holds the text
        for block in model.single_transformer_blocks:
            if checkpointed:
                _, x_T1D = model._gradient_checkpointing_func(block, x_T1D, empty, temb_TD, rotary)
            else:
                _, x_T1D = block(x_T1D, empty, temb_TD, rotary)

        x_V1D = step.split(x_T1D)[0]
        return model.proj_out(model.norm_out(x_V1D, temb_VD))[:, 0]
