"""One step's inputs for a joint-attention model (MMDiT) on this rank, and its loss.

The runtime compiles the rank's step with joint_attention: each sequence's attended tokens are
its text then its visual tokens, and the plan cuts that joint list, so the rank holds a flat mix
of text and visual tokens of whole or partial sequences. Visual features (noisy latents, target
velocity, flow time) and text features (with their sequence's flow time) are routed per
modality; the model reads each held token's modality, sequence and position from the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

import zellige
from zellige import runtime
from zellige.data import StepData
from zellige.model import AttentionFn, JointTokens, MMDiT


@dataclass(kw_only=True, slots=True)
class JointStepInput:
    tokens: JointTokens
    velocity_VC: Tensor  # the rectified-flow target of each held visual token
    attention: AttentionFn  # joint attention over the held tokens, bound to this step's layout
    layout: object  # the runtime's step (num_held_tokens counts text too)


def assemble_joint_step(data: StepData, num_heads: int, device: torch.device) -> JointStepInput:
    batch = zellige.batch_from_dict(data.batch)
    plan = zellige.plan_from_dict(data.plan)
    step = _InterimJointStep(batch, plan, num_heads, device, data.rank)

    # This rank's source sequences (batch order): one flow time per sequence, repeated per row.
    sources = [s for s in data.batch["sequences"] if s["source_rank"] == data.rank]
    visual_counts = torch.tensor([s["num_tokens"] for s in sources], dtype=torch.int64)
    first_visual = torch.cumsum(visual_counts, 0) - visual_counts
    timestep_of_source = data.source_timestep_T[first_visual]
    text_counts = torch.tensor(data.source_text_tokens, dtype=torch.int64)
    text_timestep_X = torch.repeat_interleave(timestep_of_source, text_counts)

    channels = data.source_noisy_TC.shape[1]
    visual_SF = torch.cat(
        (data.source_noisy_TC, data.source_velocity_TC, data.source_timestep_T[:, None]), dim=1
    )
    text_SF = torch.cat((data.source_text_XE, text_timestep_X[:, None]), dim=1)
    held_visual = step.route(visual_SF.to(device, non_blocking=True), tokens="visual")
    held_text = step.route(text_SF.to(device, non_blocking=True), tokens="text")

    # local sequence s = the s-th distinct batch index held here; its flow time from any token
    sequences_S, local_index_T = torch.unique(step.sequence_index, return_inverse=True)
    timestep_T = held_visual.new_empty(step.num_held_tokens)
    timestep_T[step.visual_index] = held_visual[:, 2 * channels]
    timestep_T[step.text_index] = held_text[:, -1]
    timesteps_S = timestep_T.new_zeros(sequences_S.numel()).index_put_((local_index_T,), timestep_T)
    tokens = JointTokens(
        latents_VC=held_visual[:, :channels],
        text_XE=held_text[:, :-1],
        modality_T=step.modality,
        sequence_index_T=local_index_T,
        positions_T3=step.position_ids,
        timesteps_S=timesteps_S,
    )
    return JointStepInput(
        tokens=tokens,
        velocity_VC=held_visual[:, channels : 2 * channels],
        attention=runtime.attention_fn(step.layout),
        layout=step,
    )


def joint_step_loss(
    model: MMDiT, step_input: JointStepInput, total_tokens: int, timer
) -> torch.Tensor:
    """As loop.step_loss: this rank's sum of per-token mean squared velocity errors over its
    held VISUAL tokens (text has no target), divided by the batch's visual token count."""
    velocity_VC = model(step_input.tokens, timer.wrap("attention", step_input.attention))
    loss_dtype = torch.promote_types(velocity_VC.dtype, torch.float32)
    error_VC = velocity_VC.to(loss_dtype) - step_input.velocity_VC.to(loss_dtype)
    return error_VC.square().mean(dim=1).sum() / total_tokens


class _InterimJointStep:
    """INTERIM, until the runtime's joint_attention step (branch w13, CONTRACT-13) merges: the
    same layout from the visual-only runtime, by handing it each sequence's joint token list
    (text then visual) as one 1 x 1 x L latent grid. The plan cuts the joint list exactly as
    the contract says; held token w of a sequence is its text token w if w < text, else its
    visual token w - text. Per-modality routes go through the joint route with the other
    modality's rows zero (double the bytes: fine for tests, not for production)."""

    def __init__(self, batch, plan, num_heads: int, device: torch.device, rank: int) -> None:
        sequences = batch.sequences
        joint = zellige.batch_from_dict(
            {
                "sequences": [
                    {
                        "id": s.id,
                        "num_tokens": s.text_tokens + s.num_tokens,
                        "grid": [1, 1, s.text_tokens + s.num_tokens],
                        "text_tokens": 0,
                        "source_rank": s.source_rank,
                    }
                    for s in sequences
                ]
            },
            num_ranks=plan.num_ranks,
        )
        self.layout = runtime.prepare_step(joint, plan, num_heads, device)
        self.num_held_tokens = self.layout.num_held_tokens
        self.sequence_index = self.layout.sequence_index
        offset_T = self.layout.position_ids[:, 2]
        table = torch.tensor(
            [[s.text_tokens, s.grid_h, s.grid_w] for s in sequences], dtype=torch.int64
        ).to(device)
        text_T, grid_h_T, grid_w_T = table[self.sequence_index].unbind(1)
        is_text_T = offset_T < text_T
        self.modality = is_text_T.long()
        visual_T = (offset_T - text_T).clamp_min(0)
        thw_T3 = torch.stack(
            (
                visual_T // (grid_h_T * grid_w_T),
                (visual_T // grid_w_T) % grid_h_T,
                visual_T % grid_w_T,
            ),
            dim=1,
        )
        text_T3 = torch.stack((offset_T, 0 * offset_T, 0 * offset_T), dim=1)
        self.position_ids = torch.where(is_text_T[:, None], text_T3, thw_T3)
        self.text_index = torch.nonzero(is_text_T).flatten()
        self.visual_index = torch.nonzero(~is_text_T).flatten()
        text_rows, visual_rows, start = [], [], 0
        for s in sequences:
            if s.source_rank != rank:
                continue
            text_rows.append(np.arange(start, start + s.text_tokens))
            start += s.text_tokens
            visual_rows.append(np.arange(start, start + s.num_tokens))
            start += s.num_tokens
        self.num_source_tokens = start
        self._source_rows = {
            "text": torch.as_tensor(np.concatenate([np.zeros(0, np.int64), *text_rows])),
            "visual": torch.as_tensor(np.concatenate([np.zeros(0, np.int64), *visual_rows])),
        }
        self._held_index = {"text": self.text_index, "visual": self.visual_index}

    def route(self, x_S: Tensor, tokens: str) -> Tensor:
        rows = self._source_rows[tokens].to(x_S.device)
        joint = x_S.new_zeros(self.num_source_tokens, *x_S.shape[1:]).index_copy(0, rows, x_S)
        return runtime.route(joint, self.layout)[self._held_index[tokens]]
