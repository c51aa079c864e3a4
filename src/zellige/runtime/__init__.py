"""zellige.runtime: executes a Plan in PyTorch. The only package that calls torch.distributed.

Public API (stable; everything else in the package is private):

    step = prepare_step(batch, plan, num_heads, device, group=None)
        Once per step, on every rank of `group` (default: the world). Compiles this rank's layout
        (C++ plan compiler) and moves it to `device`. Raises the same ValueError on every rank if
        the plan does not match the batch, the world size or the head count (never hangs).
        step.num_source_tokens  S: tokens this rank's loader produced (its sequences, batch order)
        step.num_held_tokens    T: tokens this rank holds for the per-token layers (held order)
        step.position_ids       [T, 3] long: (t, h, w) of each held token in its latent grid
        step.sequence_index     [T] long: index into batch.sequences of each held token
        step.compiled           the raw zellige._core.RankLayout (chunks, splits, segments)

    x_TD = route(x_SD, step)              source tokens -> held tokens (one all_to_all)
    x_SD = reverse_route(x_TD, step)      held tokens -> source tokens (its inverse)
        Any dtype and trailing shape; differentiable (backward = the opposite all_to_all).

    o_TNH = distributed_attention(q_TNH, k_TNH, v_TNH, step, *, scale=None, backend=None)
        Bidirectional self-attention of every sequence under the plan, for the held tokens;
        equal to single-process attention. Every rank calls it every layer. Differentiable.
    fn = attention_fn(step, *, backend=None)
        The same as an `AttentionFn` (q_TNH, k_TNH, v_TNH) -> o_TNH for zellige.model.

    o_rows = coalesced_attention(q_rows, k_rows, v_rows, table, *, scale, backend, return_lse)
        Single-device attention of many segments in few kernel calls (e.g. cross-attention of
        each chunk to its sequence's text): table = SegmentTable.build(q_row_offset,
        k_row_offset, q_len, k_len, num_heads, device) or SegmentTable.packed(cu_seqlens, N).
        Rows are [tokens x heads, H], token-major per segment (q_TNH.reshape(-1, H) for packed).

    kernel_for(device, dtype, head_dim, backend=None) / KERNELS: the attention kernels; the
        automatic choice (cuDNN > flash > efficient on CUDA half precision, ATen flash on CPU) can
        be overridden with backend= or $ZELLIGE_ATTENTION_BACKEND.

Legend: S source tokens, T held tokens, N heads, H head dim, D features; rows = tokens x heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from torch import Tensor

from zellige.runtime.attention import distributed_attention
from zellige.runtime.coalesced import SegmentTable, coalesced_attention
from zellige.runtime.exchange import reverse_route, route
from zellige.runtime.kernels import KERNELS, kernel_for
from zellige.runtime.layout import StepLayout, prepare_step


def attention_fn(
    step: StepLayout, *, backend: str | None = None, scale: float | None = None
) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """distributed_attention bound to one step: the model's self-attention callable."""
    return functools.partial(distributed_attention, step=step, backend=backend, scale=scale)


__all__ = [
    "KERNELS",
    "SegmentTable",
    "StepLayout",
    "attention_fn",
    "coalesced_attention",
    "distributed_attention",
    "kernel_for",
    "prepare_step",
    "reverse_route",
    "route",
]
