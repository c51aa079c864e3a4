"""One step's inputs on this rank: route the loaders' tokens to where the plan put them.

The plan was made in the loader worker; here the runtime compiles this rank's layout (all ranks
check they agree), one all_to_all routes per-token features (noisy latents, target velocity, flow
time) and another moves each sequence's text to the ranks of its placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

import zellige
from zellige import runtime
from zellige.data import StepData
from zellige.model import AttentionFn, PackedTokens
from zellige.runtime.exchange import all_to_all_rows


@dataclass(kw_only=True, slots=True)
class StepInput:
    tokens: PackedTokens
    velocity_TC: Tensor  # the rectified-flow target of each held token
    self_attention: AttentionFn  # distributed attention bound to this step's layout
    layout: runtime.StepLayout


def assemble_step(data: StepData, num_heads: int, device: torch.device) -> StepInput:
    batch = zellige.batch_from_dict(data.batch)
    plan = zellige.plan_from_dict(data.plan)
    layout = runtime.prepare_step(batch, plan, num_heads, device)
    channels = data.source_noisy_TC.shape[1]
    features_SF = torch.cat(
        [
            t.to(device, non_blocking=True)
            for t in (
                data.source_noisy_TC,
                data.source_velocity_TC,
                data.source_timestep_T[:, None],
            )
        ],
        dim=1,
    )
    held_TF = runtime.route(features_SF, layout)

    compiled = layout.compiled
    # PackedTokens wants tokens grouped by sequence in table order: held order does that, chunk by
    # chunk. A chunk may be empty (a 1-token sequence split 2 ways): it has no row in the table.
    assert (
        compiled.chunk_held_offset.tolist()
        == np.cumsum([0, *compiled.chunk_num_tokens.tolist()])[:-1].tolist()
    )
    nonempty = compiled.chunk_num_tokens > 0
    chunk_tokens = compiled.chunk_num_tokens[nonempty].tolist()
    chunk_sequences = compiled.chunk_sequence_index[nonempty].tolist()
    chunk_offsets = torch.as_tensor(compiled.chunk_held_offset[nonempty], device=device)
    text_tokens = [data.batch["sequences"][index]["text_tokens"] for index in chunk_sequences]

    route = data.text_route
    send_index = torch.as_tensor(route.send_index, dtype=torch.int64, device=device)
    received_XE, _ = all_to_all_rows(
        data.source_text_XE.to(device, non_blocking=True)[send_index],
        route.send_splits,
        route.recv_splits,
        layout.group,
    )
    recv_rows = [
        np.arange(route.recv_offset[index], route.recv_offset[index] + count)
        for index, count in zip(chunk_sequences, text_tokens, strict=True)
    ]
    recv_index = np.concatenate(recv_rows) if recv_rows else np.zeros(0, np.int64)
    text_XE = received_XE[torch.as_tensor(recv_index, device=device)]

    tokens = PackedTokens(
        latents_TC=held_TF[:, :channels],
        positions_T3=layout.position_ids,
        timesteps_S=held_TF[chunk_offsets, 2 * channels],
        text_XE=text_XE,
        tokens_per_sequence=chunk_tokens,
        text_tokens_per_sequence=text_tokens,
    )
    return StepInput(
        tokens=tokens,
        velocity_TC=held_TF[:, channels : 2 * channels],
        self_attention=runtime.attention_fn(layout),
        layout=layout,
    )
