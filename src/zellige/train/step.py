"""One step's inputs on this rank: load the step program and route the loaders' tensors.

The loader worker made the plan and compiled this rank's StepProgram; here the runtime loads it
(every rank agrees on it, or all raise the same error), one all_to_all routes the per-token
features (noisy latents, target velocity, flow time) and another moves the text: for a
cross-attention model each held chunk receives its sequence's text (route_text); for a joint
model the text tokens are held tokens of their own (route tokens="text").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from zellige import runtime
from zellige.data import StepData
from zellige.model import AttentionFn, PackedTokens


@dataclass(kw_only=True, slots=True)
class StepInput:
    """tokens: the visual tokens the rank holds, grouped by held chunk (nonempty chunks, held
    order); tokens.text_XE: cross: each chunk's sequence text; joint: the held text tokens in the
    order of step.text_index (chunk by chunk)."""

    tokens: PackedTokens
    velocity_TC: Tensor  # the rectified-flow target of each held visual token
    self_attention: AttentionFn  # distributed self- or joint attention bound to this step
    cross_attention: AttentionFn  # cross-attention of each chunk to its text (cross models)
    step: runtime.Step


def _source_error(data: StepData) -> str | None:
    """A loader whose tensors do not match its program (a plan for another batch, say)."""
    program = data.program
    if program is None:
        return None
    text_route = program.text_route if program.joint_attention else program.cross_text_route
    checks = [
        ("latent tokens", data.source_noisy_TC.shape[0], program.visual_route.num_source),
        ("text rows", data.source_text_XE.shape[0], text_route.num_source),
    ]
    for what, got, want in checks:
        if got != want:
            return (
                f"rank {data.rank}: the loader produced {got} {what} but the step program "
                f"expects {want} (the plan was compiled for another batch)"
            )
    return None


_copy_streams: dict[torch.device, torch.cuda.Stream] = {}


def _loader_tensors(tensors: tuple[Tensor, ...], device: torch.device) -> list[Tensor]:
    """The loader's tensors on `device`. On CUDA they are copied from pinned memory on a stream
    of their own: the training loop makes a step's inputs while the previous step's optimizer
    runs (loop.StepsAhead), and the copies (the text features are the largest: 176 MB of
    float32 for 21 sequences of 512 tokens) then overlap its kernels instead of queueing behind
    them. The current stream waits for them before it uses them."""
    if device.type != "cuda":
        return [t.to(device) for t in tensors]
    current = torch.cuda.current_stream(device)
    copies = _copy_streams.setdefault(device, torch.cuda.Stream(device))
    with torch.cuda.stream(copies):
        moved = [t.to(device, non_blocking=True) for t in tensors]
    current.wait_stream(copies)
    for t in moved:
        # allocated on the copy stream, used on the current one: the allocator must not hand
        # their memory to the next step's copies before the current stream is done with them
        t.record_stream(current)
    return moved


def assemble_step(
    data: StepData,
    num_heads: int,
    device: torch.device,
    engine: runtime.EngineConfig | None = None,
) -> StepInput:
    error = data.error or _source_error(data)
    step = runtime.load_step(data.program, device, error=error, engine=engine)
    if step.num_heads != num_heads:
        raise ValueError(
            f"the step program is for {step.num_heads} heads, the model has {num_heads}"
        )
    channels = data.source_noisy_TC.shape[1]
    noisy_TC, velocity_TC, timestep_T1, text_source_XE, text_timestep_X = _loader_tensors(
        (
            data.source_noisy_TC,
            data.source_velocity_TC,
            data.source_timestep_T[:, None],
            data.source_text_XE,
            data.source_text_timestep_X,
        ),
        device,
    )
    features_SF = torch.cat([noisy_TC, velocity_TC, timestep_T1], dim=1)
    held_VF = runtime.route(features_SF, step, tokens="visual")  # [T_visual, 2C + 1]
    timestep_T = held_VF.new_empty(step.num_held_tokens)
    timestep_T[step.visual_index] = held_VF[:, 2 * channels]
    if step.joint_attention:
        text_features = torch.cat([text_source_XE, text_timestep_X[:, None]], dim=1)
        held_text_XF = runtime.route(text_features, step, tokens="text")
        text_XE = held_text_XF[:, :-1]
        timestep_T[step.text_index] = held_text_XF[:, -1].to(timestep_T.dtype)
    else:
        text_XE = runtime.route_text(text_source_XE, step)

    # PackedTokens groups tokens by chunk in held order; a chunk may be empty (a 1-token sequence
    # split 2 ways): it has no row in the table. Its tables come from the program's host arrays
    # and reach the device by non-blocking copies (no host sync; see runtime.to_device).
    program = step.program
    nonempty = program.chunk_num_tokens > 0
    text_held = program.chunk_num_text_tokens[nonempty]
    visual_held = program.chunk_num_tokens[nonempty] - text_held
    chunk_offsets = runtime.to_device(torch.from_numpy(program.chunk_held_offset[nonempty]), device)
    chunk_of_visual = np.repeat(np.arange(visual_held.size, dtype=np.int64), visual_held)
    text_per_chunk = (
        text_held if step.joint_attention else program.chunk_cross_text_tokens[nonempty]
    )
    tokens = PackedTokens(
        latents_TC=held_VF[:, :channels],
        positions_T3=step.position_ids.index_select(0, step.visual_index),
        timesteps_S=timestep_T[chunk_offsets],
        text_XE=text_XE,
        tokens_per_sequence=visual_held.tolist(),
        text_tokens_per_sequence=text_per_chunk.tolist(),
        sequence_index_T=runtime.to_device(torch.from_numpy(chunk_of_visual), device),
    )
    return StepInput(
        tokens=tokens,
        velocity_TC=held_VF[:, channels : 2 * channels],
        self_attention=runtime.attention_fn(step),
        cross_attention=runtime.cross_attention_fn(step),
        step=step,
    )
