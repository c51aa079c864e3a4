"""Local attention: segments packed back to back on one rank, attended on the coalesced engine.

The reference models attend with this when no step's callables are given (a single process, or
the profiler's per-rank work): the same engine and backends (runtime/backends.py) as a step's
tables, with no communication.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

from zellige.runtime.backends import coalesced_attention
from zellige.runtime.coalesced import SegmentTable
from zellige.runtime.engine import EngineConfig

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]


def local_attention(
    q_lengths: Sequence[int],
    kv_lengths: Sequence[int],
    device: torch.device | str,
    engine: EngineConfig | None = None,
) -> AttentionFn:
    """Attention of query segment i (the q_lengths[i] tokens after the previous segments) against
    key/value segment i, for segments packed back to back: self-attention when the lengths are
    the same, cross-attention to each sequence's text otherwise. A segment with no keys outputs
    zeros. Equal shapes share one dense kernel call; the grouping is built on first use (it needs
    the head count) and kept. engine: as coalesced_attention's (default: from the environment).

    The output stays connected to q, k and v even where it cannot depend on them: every
    parameter then gets a gradient, zero or not, on every rank, so FSDP reduces the same set of
    gradients everywhere."""
    q_lengths = np.asarray(list(q_lengths), dtype=np.int64)
    kv_lengths = np.asarray(list(kv_lengths), dtype=np.int64)
    if q_lengths.shape != kv_lengths.shape:
        raise ValueError("local_attention: one key/value length per query segment")
    q_starts = np.cumsum(q_lengths) - q_lengths
    kv_starts = np.cumsum(kv_lengths) - kv_lengths
    tables: dict[int, SegmentTable] = {}

    def attend(q_TNH: Tensor, k_SNH: Tensor, v_SNH: Tensor) -> Tensor:
        num_tokens, num_heads, head_dim = q_TNH.shape
        assert num_tokens == int(q_lengths.sum()) and k_SNH.shape[0] == int(kv_lengths.sum())
        if num_heads not in tables:
            heads = np.full_like(q_lengths, num_heads)
            tables[num_heads] = SegmentTable.build(
                q_starts * num_heads, kv_starts * num_heads, q_lengths, kv_lengths, heads, device
            )
        o_rows = coalesced_attention(
            q_TNH.reshape(-1, head_dim),
            k_SNH.reshape(-1, head_dim),
            v_SNH.reshape(-1, head_dim),
            tables[num_heads],
            engine=engine,
        )
        return o_rows.view(num_tokens, num_heads, head_dim)

    return attend
