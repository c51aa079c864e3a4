"""The model's attention contract and its single-process reference.

The model calls attention as `fn(q_TNH, k_SNH, v_SNH) -> o_TNH` and knows nothing of parallelism:
the execution engine hands the model a self-attention callable bound to one step's layout; without
one, self-attention runs over whole local sequences with `SegmentAttention`. Cross-attention is
always local (each token's query against its own sequence's text) and uses `SegmentAttention`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

AttentionFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class SegmentAttention:
    """Attention of contiguous query segments against contiguous key/value segments.

    Segment i attends queries [q_start_i, q_start_i + q_len_i) to keys [k_start_i, ...). Segments
    of equal (q_len, kv_len) run as one dense batched scaled_dot_product_attention call with heads
    folded into the batch (short sequences must never run alone); the index tensors are built once
    per step and reused by every layer. A segment with no keys outputs zeros.

    The output stays connected to q, k and v even when it cannot depend on them (no queries, no
    keys): every parameter then gets a gradient, zero or not, on every rank, so FSDP reduces the
    same set of gradients everywhere instead of mismatching its collectives.
    """

    def __init__(
        self, q_lengths: Sequence[int], kv_lengths: Sequence[int], device: torch.device | str
    ) -> None:
        assert len(q_lengths) == len(kv_lengths)
        self.num_q_tokens = int(sum(q_lengths))
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        q_start = kv_start = 0
        for q_len, kv_len in zip(q_lengths, kv_lengths, strict=True):
            if q_len > 0:
                starts = groups.setdefault((int(q_len), int(kv_len)), ([], []))
                starts[0].append(q_start)
                starts[1].append(kv_start)
            q_start += q_len
            kv_start += kv_len
        # (q_index [c, Lq] or None for "all queries in order", kv_index [c, Lk] or None)
        self._groups: list[tuple[Tensor | None, Tensor | None]] = []
        order = []
        for (q_len, kv_len), (q_starts, kv_starts) in groups.items():
            q_index = _segment_index(q_starts, q_len, device)
            kv_index = _segment_index(kv_starts, kv_len, device) if kv_len > 0 else None
            self._groups.append((q_index, kv_index))
            order.append(q_index.flatten())
        self._uses_keys = any(kv_index is not None for _, kv_index in self._groups)
        self._identity = (
            len(self._groups) == 1
            and self._groups[0][0].shape[0] == 1
            and q_lengths[0] == self.num_q_tokens
        )
        # out[inverse] puts each group's rows back at its tokens' places
        self._inverse = None
        if not self._identity and order:
            permutation = torch.cat(order)
            self._inverse = torch.empty_like(permutation)
            self._inverse[permutation] = torch.arange(permutation.numel(), device=device)

    def __call__(self, q_TNH: Tensor, k_SNH: Tensor, v_SNH: Tensor) -> Tensor:
        assert q_TNH.shape[0] == self.num_q_tokens
        if not self._uses_keys:
            return q_TNH * 0 + (k_SNH.sum() + v_SNH.sum()) * 0
        outputs = []
        for q_index, kv_index in self._groups:
            if kv_index is None:
                outputs.append(q_TNH[q_index.flatten()] * 0)
                continue
            if self._identity and kv_index.shape[1] == k_SNH.shape[0]:
                q, k, v = q_TNH[None], k_SNH[None], v_SNH[None]  # one segment: no gathers
            else:
                q, k, v = q_TNH[q_index], k_SNH[kv_index], v_SNH[kv_index]
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            ).transpose(1, 2)
            outputs.append(o.flatten(0, 1))
        o_TNH = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return o_TNH if self._inverse is None else o_TNH[self._inverse]


def _segment_index(starts: list[int], length: int, device: torch.device | str) -> Tensor:
    starts_t = torch.tensor(starts, dtype=torch.int64, device=device)
    return starts_t[:, None] + torch.arange(length, dtype=torch.int64, device=device)
