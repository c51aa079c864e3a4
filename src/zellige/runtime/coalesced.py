"""Coalesced attention: every segment of a rank in as few kernel launches as possible.

Rows: a row is one (token, head) pair of head_dim values. A segment is `q_len` query tokens x
`num_heads` heads at `q_row_offset` (token-major, [q_len, num_heads, H]) attending to `k_len` key
tokens at `k_row_offset` of the key/value rows. Segments of equal (q_len, k_len, num_heads) form
one dense batch [B, n, L, H] (a strided view when they sit side by side, a gather otherwise), so a
pack of 87 mixed sequences runs in a handful of kernel calls at the dense rate. The grouping itself
is C++ (_core.group_segments, shared with the plan compiler's step programs): one engine for
self-, joint, cross-attention and ring steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zellige import _core
from zellige.runtime.kernels import Kernel, default_scale, kernel_for, lse_dtype

Tensor = torch.Tensor
RowIndex = slice | Tensor  # a contiguous run of rows, or a gather index


@dataclass(frozen=True, slots=True)
class SegmentGroup:
    """`count` segments of one shape; q_index / k_index select their rows in order."""

    count: int
    q_len: int
    k_len: int
    num_heads: int
    q_index: RowIndex
    k_index: RowIndex


def _row_index(offsets: list[int], rows_each: int, device: torch.device) -> RowIndex:
    if all(b == a + rows_each for a, b in zip(offsets, offsets[1:], strict=False)):
        return slice(offsets[0], offsets[0] + rows_each * len(offsets))
    starts = torch.tensor(offsets, dtype=torch.long)
    index = (starts[:, None] + torch.arange(rows_each)[None, :]).reshape(-1)
    return index.to(device)


def _disjoint(spans: list[tuple[int, int]]) -> bool:
    spans = sorted(spans)
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


@dataclass(frozen=True, slots=True)
class SegmentTable:
    """The dense groups of one coalesced call (built once per step, reused by every layer).

    disjoint: no two segments share query rows or key rows, so results can be written instead of
    added; q_rows / k_rows: rows the segments cover (all rows written when they equal the size)."""

    groups: tuple[SegmentGroup, ...]
    disjoint: bool = True
    q_rows: int = 0
    k_rows: int = 0

    @staticmethod
    def from_groups(
        groups: Sequence[_core.SegmentGroup], device: torch.device | str = "cpu"
    ) -> SegmentTable:
        """The table of groups made by the C++ grouping engine (a step program's, or build's)."""
        device = torch.device(device)
        table_groups, q_spans, k_spans = [], [], []
        for g in groups:
            q_offsets, k_offsets = g.q_row_offset.tolist(), g.k_row_offset.tolist()
            q_rows_each, k_rows_each = g.q_len * g.num_heads, g.k_len * g.num_heads
            q_spans += [(o, o + q_rows_each) for o in q_offsets]
            k_spans += [(o, o + k_rows_each) for o in k_offsets]
            table_groups.append(
                SegmentGroup(
                    count=len(q_offsets),
                    q_len=g.q_len,
                    k_len=g.k_len,
                    num_heads=g.num_heads,
                    q_index=_row_index(q_offsets, q_rows_each, device),
                    k_index=_row_index(k_offsets, k_rows_each, device),
                )
            )
        return SegmentTable(
            tuple(table_groups),
            disjoint=_disjoint(q_spans) and _disjoint(k_spans),
            q_rows=sum(b - a for a, b in q_spans),
            k_rows=sum(b - a for a, b in k_spans),
        )

    @staticmethod
    def build(
        q_row_offset: Sequence[int],
        k_row_offset: Sequence[int],
        q_len: Sequence[int],
        k_len: Sequence[int],
        num_heads: Sequence[int],
        device: torch.device | str = "cpu",
    ) -> SegmentTable:
        """Groups segments by shape (the C++ engine, _core.group_segments); empty segments (no
        query, key or head) are dropped."""
        columns = [
            np.asarray(c, dtype=np.int64).reshape(-1).tolist()
            for c in (q_row_offset, k_row_offset, q_len, k_len, num_heads)
        ]
        return SegmentTable.from_groups(_core.group_segments(*columns), device)

    @staticmethod
    def packed(
        cu_seqlens: Sequence[int], num_heads: int, device: torch.device | str = "cpu"
    ) -> SegmentTable:
        """Self-attention of sequences packed as [T, N, H] (rows = T * N), like varlen kernels."""
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        lengths = np.diff(cu)
        offsets = cu[:-1] * num_heads
        heads = np.full_like(lengths, num_heads)
        return SegmentTable.build(offsets, offsets, lengths, lengths, heads, device)

    @property
    def num_calls(self) -> int:
        return len(self.groups)


def _take(rows: Tensor, index: RowIndex) -> Tensor:
    return rows[index] if isinstance(index, slice) else rows.index_select(0, index)


def _put(rows: Tensor, index: RowIndex, values: Tensor) -> None:
    if isinstance(index, slice):
        rows[index].copy_(values)
    else:
        rows.index_copy_(0, index, values.to(rows.dtype))


def _add(rows: Tensor, index: RowIndex, values: Tensor) -> None:
    if isinstance(index, slice):
        rows[index] += values
    else:
        rows.index_add_(0, index, values.to(rows.dtype))


def _dense(rows: Tensor, index: RowIndex, group: SegmentGroup, length: int) -> Tensor:
    """[count * length * n, ...] rows -> [count, n, length, ...] (a view for slices)."""
    taken = _take(rows, index)
    return taken.view(group.count, length, group.num_heads, *rows.shape[1:]).transpose(1, 2)


def _flat(dense: Tensor) -> Tensor:
    """[B, n, L, ...] -> token-major rows [B * L * n, ...]."""
    return dense.transpose(1, 2).reshape(-1, *dense.shape[3:])


_side_streams: dict[tuple[torch.device, int], list] = {}


def _for_each_group(table: SegmentTable, fn, device: torch.device, streams: int) -> None:
    """fn(group) for every group; on CUDA with streams > 1 the groups run round-robin on side
    streams so one call's last wave overlaps the next call (writes must be disjoint)."""
    if streams <= 1 or device.type != "cuda" or len(table.groups) < 2:
        for g in table.groups:
            fn(g)
        return
    key = (device, streams)
    if key not in _side_streams:
        _side_streams[key] = [torch.cuda.Stream(device) for _ in range(streams)]
    side = _side_streams[key]
    main = torch.cuda.current_stream(device)
    for stream in side:
        stream.wait_stream(main)
    for i, g in enumerate(table.groups):
        with torch.cuda.stream(side[i % streams]):
            fn(g)
    for stream in side:
        main.wait_stream(stream)


def forward_into(
    table: SegmentTable,
    kernel: Kernel,
    scale: float,
    q_rows: Tensor,
    k_rows: Tensor,
    v_rows: Tensor,
    o_rows: Tensor,
    lse_rows: Tensor,
    streams: int = 1,
) -> None:
    """Writes o and lse of every segment's query rows (other rows are left untouched)."""

    def one(g: SegmentGroup) -> None:
        q = _dense(q_rows, g.q_index, g, g.q_len)
        k = _dense(k_rows, g.k_index, g, g.k_len)
        v = _dense(v_rows, g.k_index, g, g.k_len)
        o, lse = kernel.forward(q, k, v, scale)
        _put(o_rows, g.q_index, _flat(o))
        _put(lse_rows, g.q_index, lse.transpose(1, 2).reshape(-1))

    _for_each_group(table, one, q_rows.device, streams if table.disjoint else 1)


def backward_into(
    table: SegmentTable,
    kernel: Kernel,
    scale: float,
    q_rows: Tensor,
    k_rows: Tensor,
    v_rows: Tensor,
    o_rows: Tensor,
    lse_rows: Tensor,
    do_rows: Tensor,
    dq_rows: Tensor,
    dk_rows: Tensor,
    dv_rows: Tensor,
    accumulate: bool = True,
    streams: int = 1,
) -> None:
    """Adds every segment's gradients into dq / dk / dv rows (rows may be shared by several
    segments or calls, e.g. ring steps), or writes them when accumulate is False."""
    store = _add if accumulate else _put

    def one(g: SegmentGroup) -> None:
        q = _dense(q_rows, g.q_index, g, g.q_len)
        k = _dense(k_rows, g.k_index, g, g.k_len)
        v = _dense(v_rows, g.k_index, g, g.k_len)
        o = _dense(o_rows, g.q_index, g, g.q_len)
        do = _dense(do_rows, g.q_index, g, g.q_len)
        lse = _take(lse_rows, g.q_index).view(g.count, g.q_len, g.num_heads).transpose(1, 2)
        dq, dk, dv = kernel.backward(do, q, k, v, o, lse, scale)
        store(dq_rows, g.q_index, _flat(dq))
        store(dk_rows, g.k_index, _flat(dk))
        store(dv_rows, g.k_index, _flat(dv))

    parallel = table.disjoint and not accumulate
    _for_each_group(table, one, q_rows.device, streams if parallel else 1)


def _whole(table: SegmentTable, num_q_rows: int, num_k_rows: int) -> bool:
    """One dense group over all rows in order: kernel outputs are the results, no copies."""
    if len(table.groups) != 1:
        return False
    g = table.groups[0]
    return g.q_index == slice(0, num_q_rows) and g.k_index == slice(0, num_k_rows)


class _CoalescedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_rows, k_rows, v_rows, table, kernel, scale, streams):
        q_rows, k_rows, v_rows = q_rows.contiguous(), k_rows.contiguous(), v_rows.contiguous()
        num_q, num_k = q_rows.shape[0], k_rows.shape[0]
        lse_type = lse_dtype(q_rows.dtype)
        if _whole(table, num_q, num_k):
            g = table.groups[0]
            o, lse = kernel.forward(
                _dense(q_rows, g.q_index, g, g.q_len),
                _dense(k_rows, g.k_index, g, g.k_len),
                _dense(v_rows, g.k_index, g, g.k_len),
                scale,
            )
            o_rows = _flat(o)
            lse_rows = lse.transpose(1, 2).reshape(-1).to(lse_type)
        else:
            covered = table.disjoint and table.q_rows == num_q
            o_rows = torch.empty_like(q_rows) if covered else torch.zeros_like(q_rows)
            lse_rows = torch.full((num_q,), float("-inf"), dtype=lse_type, device=q_rows.device)
            forward_into(table, kernel, scale, q_rows, k_rows, v_rows, o_rows, lse_rows, streams)
        ctx.save_for_backward(q_rows, k_rows, v_rows, o_rows, lse_rows)
        ctx.table, ctx.kernel, ctx.scale, ctx.streams = table, kernel, scale, streams
        ctx.mark_non_differentiable(lse_rows)
        return o_rows, lse_rows

    @staticmethod
    def backward(ctx, do_rows, _dlse):
        q_rows, k_rows, v_rows, o_rows, lse_rows = ctx.saved_tensors
        table, kernel, scale = ctx.table, ctx.kernel, ctx.scale
        do_rows = do_rows.contiguous()
        num_q, num_k = q_rows.shape[0], k_rows.shape[0]
        if _whole(table, num_q, num_k):
            g = table.groups[0]
            dq, dk, dv = kernel.backward(
                _dense(do_rows, g.q_index, g, g.q_len),
                _dense(q_rows, g.q_index, g, g.q_len),
                _dense(k_rows, g.k_index, g, g.k_len),
                _dense(v_rows, g.k_index, g, g.k_len),
                _dense(o_rows, g.q_index, g, g.q_len),
                lse_rows.view(g.count, g.q_len, g.num_heads).transpose(1, 2),
                scale,
            )
            return _flat(dq), _flat(dk), _flat(dv), None, None, None, None
        q_covered = table.disjoint and table.q_rows == num_q
        k_covered = table.disjoint and table.k_rows == num_k
        dq = torch.empty_like(q_rows) if q_covered else torch.zeros_like(q_rows)
        dk, dv = (torch.empty_like(k_rows) if k_covered else torch.zeros_like(k_rows) for _ in "kv")
        backward_into(
            table, kernel, scale, q_rows, k_rows, v_rows, o_rows, lse_rows, do_rows, dq, dk, dv,
            accumulate=not table.disjoint, streams=ctx.streams,
        )  # fmt: skip
        return dq, dk, dv, None, None, None, None


def coalesced_attention(
    q_rows: Tensor,
    k_rows: Tensor,
    v_rows: Tensor,
    table: SegmentTable,
    *,
    scale: float | None = None,
    backend: str | None = None,
    return_lse: bool = False,
    streams: int = 1,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of every segment of `table` in one call; differentiable in q, k, v.

    q_rows [Rq, H], k_rows / v_rows [Rk, H]; returns o_rows [Rq, H] (zero on rows that no segment
    covers) and, with return_lse, the log-sum-exp per query row (float32; -inf where uncovered).
    backend: a name of KERNELS ("cudnn", "flash", "cpu", ...) or None for the automatic choice.
    streams: on CUDA, run the dense groups round-robin on this many side streams.
    """
    head_dim = q_rows.shape[-1]
    kernel = kernel_for(q_rows.device, q_rows.dtype, head_dim, backend)
    scale = default_scale(head_dim) if scale is None else scale
    o_rows, lse_rows = _CoalescedAttention.apply(
        q_rows, k_rows, v_rows, table, kernel, scale, streams
    )
    return (o_rows, lse_rows) if return_lse else o_rows
