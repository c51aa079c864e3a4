"""One step's inputs for a joint-attention model (MMDiT) on this rank, and its loss.

The loader compiled the rank's step program with joint_attention (the plan cuts each sequence's
joint token list, text then visual), so the rank holds a flat mix of text and visual tokens of
whole or partial sequences. train/step.py's assemble_step loads the program and routes the
visual features and the text tokens (with their flow time); this file only reshapes that into
the MMDiT's input: per-token modality, local sequence and position tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from zellige import runtime
from zellige.data import StepData
from zellige.model import AttentionFn, JointTokens, MMDiT, fused
from zellige.model.mmdit import StreamOrder
from zellige.train.step import assemble_step


@dataclass(kw_only=True, slots=True)
class JointStepInput:
    tokens: JointTokens
    velocity_VC: Tensor  # the rectified-flow target of each held visual token
    attention: AttentionFn  # joint attention over the held tokens, bound to this step
    step: runtime.Step  # num_held_tokens counts text too


def assemble_joint_step(
    data: StepData,
    num_heads: int,
    device: torch.device,
    engine: runtime.EngineConfig | None = None,
) -> JointStepInput:
    routed = assemble_step(data, num_heads, device, engine)
    step = routed.step
    if not step.joint_attention:
        raise ValueError("the step program is not for a joint-attention model (an MMDiT's)")
    # A rank holds at most one chunk of a sequence, so nonempty chunks are the local sequences,
    # in held order, as routed.tokens.timesteps_S lists them (one per nonempty chunk). Built from
    # the program's host arrays and copied (pinned, non-blocking): no read back from the device.
    program = step.program
    local_sequence_of_chunk = np.cumsum(program.chunk_num_tokens > 0) - 1
    local_sequence_T = local_sequence_of_chunk[program.token_chunk_index].astype(np.int64)
    streams = StreamOrder.from_host(
        program.held_text_index, program.held_visual_index, local_sequence_T, device
    )
    tokens = JointTokens(
        latents_VC=routed.tokens.latents_TC,
        text_XE=routed.tokens.text_XE,
        modality_T=step.modality,
        sequence_index_T=runtime.to_device(torch.from_numpy(local_sequence_T), device),
        positions_T3=step.position_ids,
        timesteps_S=routed.tokens.timesteps_S,
        streams=streams,
    )
    return JointStepInput(
        tokens=tokens,
        velocity_VC=routed.velocity_TC,
        attention=routed.self_attention,
        step=step,
    )


def joint_step_loss(
    model: MMDiT, step_input: JointStepInput, total_tokens: int, timer
) -> torch.Tensor:
    """As loop.step_loss: this rank's sum of per-token mean squared velocity errors over its
    held VISUAL tokens (text has no target), divided by the batch's visual token count."""
    # a view, not a copy, of the attention output (see StepTimer.wrap), as loop.step_loss does
    attention = timer.wrap("attention", step_input.attention, fresh_output=False)
    velocity_VC = model(step_input.tokens, attention)
    squared_error_sum = fused.kernels["squared_error_sum"]
    return squared_error_sum(velocity_VC, step_input.velocity_VC) / total_tokens
