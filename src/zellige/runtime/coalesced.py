"""Coalesced attention's dense engine: segment tables and their dense kernel calls.

Rows: a row is one (token, head) pair of head_dim values. A segment is `q_len` query tokens x
`num_heads` heads at `q_row_offset` (token-major, [q_len, num_heads, H]) attending to `k_len` key
tokens at `k_row_offset` of the key/value rows. Segments of equal (q_len, k_len, num_heads) form
one dense batch [B, n, L, H] (a strided view when they sit side by side, a gather otherwise), so a
pack of 87 mixed sequences runs in a handful of kernel calls at the dense rate. The grouping itself
is C++ (_core.group_segments, shared with the plan compiler's step programs): one engine for
self-, joint, cross-attention and ring steps.

A pack of many distinct lengths makes many small calls, each below the dense rate, and each
followed by copies of its results into the rows. On CUDA the calls are spread over side streams
(count: the device's measured call table, runtime/merging.py streams_for_device), so one call's
copies and last wave run beside another call's kernel; results are the same calls'. Nearby lengths
may run as one padded call (PaddedGroup, planned by runtime/merging.py). Which way a table runs
(dense groups, padded calls or one ragged call) is decided once by runtime/backends.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from zellige import _core
from zellige.runtime.kernels import Kernel, MathKernel, close_to_math, key_mask

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
    # first row of each segment (host): what a padded merge (PaddedGroup) is built from
    q_offsets: tuple[int, ...] = ()
    k_offsets: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PaddedGroup:
    """Segments of different shapes in ONE dense call of `count` problems of q_len x k_len
    tokens (the largest member's): each member's rows are gathered into its problem's first
    rows, padding rows repeat the member's last real row (finite values; a padded query reads
    its own row's lse, so no probability exceeds 1), padded keys are masked by an additive -inf
    bias and padded queries get a zero output gradient. So the real rows' results are those of
    the members' own calls, forward and every gradient; the padded rows are dropped.

    Index tensors (int64, device): q_src / k_src [count * len * n] the source row of every
    padded row; q_real / q_pos the members' real rows and their positions in the padded rows
    (k_real / k_pos alike); q_keep [count * q_len * n, 1] 1 on real query rows, else 0 (float,
    cast per dtype); key_valid [count, k_len] bool."""

    count: int
    q_len: int
    k_len: int
    num_heads: int
    member_shapes: tuple[tuple[int, int], ...]  # (q_len, k_len) of each member
    q_src: Tensor
    k_src: Tensor
    q_real: Tensor
    q_pos: Tensor
    k_real: Tensor
    k_pos: Tensor
    q_keep: Tensor
    key_valid: Tensor
    # False only for measurements of what the mask costs (bench/attention_engine.py): padded
    # keys then take part in the softmax and results are NOT those of the members' calls
    masked: bool = True
    masks: dict = field(default_factory=dict, compare=False, repr=False)  # per dtype

    def mask(self, dtype: torch.dtype) -> Tensor:
        if dtype not in self.masks:
            self.masks[dtype] = key_mask(self.key_valid, dtype)
        return self.masks[dtype]

    @property
    def keys_padded(self) -> bool:
        """Some member has fewer keys than the call: the call needs the key mask (padding only
        queries needs none: padded queries are dropped and get zero output gradients)."""
        return any(k_len < self.k_len for _, k_len in self.member_shapes)

    def keep(self, dtype: torch.dtype) -> Tensor:
        if ("keep", dtype) not in self.masks:
            self.masks["keep", dtype] = self.q_keep.to(dtype)
        return self.masks["keep", dtype]

    @property
    def padded_flops_factor(self) -> float:
        """Computed over useful attention work (1.0: no padding)."""
        useful = sum(q * k for q, k in self.member_shapes)
        return self.count * self.q_len * self.k_len / useful


def _padded_rows(
    offsets: list[int], lengths: list[int], padded_len: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(source row of every padded row, real rows, their padded positions, keep flags)."""
    heads = np.arange(n, dtype=np.int64)
    tokens = np.arange(padded_len, dtype=np.int64)
    src, real, pos, keep = [], [], [], []
    for b, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        token = np.minimum(tokens, length - 1)
        src.append((offset + token[:, None] * n + heads[None, :]).reshape(-1))
        keep.append(np.repeat(tokens < length, n))
        real.append(offset + np.arange(length * n, dtype=np.int64))
        pos.append(b * padded_len * n + np.arange(length * n, dtype=np.int64))
    return tuple(np.concatenate(parts) for parts in (src, real, pos, keep))


def _mask_of(g: PaddedGroup, kernel: Kernel, dtype: torch.dtype) -> Tensor | None:
    """The call's key mask as `kernel` takes it, made once per kernel and dtype."""
    if not (g.masked and g.keys_padded):
        return None
    key = (kernel.name, getattr(kernel, "bias_layout", None), dtype)
    if key not in g.masks:
        g.masks[key] = kernel.prepare_bias(g.mask(dtype), g.q_len)
    return g.masks[key]


def padded_group(
    groups: Sequence[SegmentGroup], device: torch.device | str, masked: bool = True
) -> PaddedGroup:
    """The groups (one head count, disjoint rows) as one padded call (see PaddedGroup)."""
    device = torch.device(device)
    heads = {g.num_heads for g in groups}
    if len(heads) != 1:
        raise ValueError(f"a padded merge needs one head count, got {sorted(heads)}")
    n = heads.pop()
    q_offsets = [o for g in groups for o in g.q_offsets]
    k_offsets = [o for g in groups for o in g.k_offsets]
    q_lens = [g.q_len for g in groups for _ in range(g.count)]
    k_lens = [g.k_len for g in groups for _ in range(g.count)]
    if len(q_offsets) != len(q_lens) or len(k_offsets) != len(k_lens):
        raise ValueError("a padded merge needs the groups' host offsets (SegmentTable.from_groups)")
    q_len, k_len = max(q_lens), max(k_lens)
    q_src, q_real, q_pos, q_keep = _padded_rows(q_offsets, q_lens, q_len, n)
    k_src, k_real, k_pos, _ = _padded_rows(k_offsets, k_lens, k_len, n)
    key_valid = np.arange(k_len)[None, :] < np.asarray(k_lens)[:, None]

    def dev(array: np.ndarray) -> Tensor:
        return to_device(torch.from_numpy(np.ascontiguousarray(array)), device)

    return PaddedGroup(
        count=len(q_lens),
        q_len=q_len,
        k_len=k_len,
        num_heads=n,
        member_shapes=tuple(zip(q_lens, k_lens, strict=True)),
        q_src=dev(q_src),
        k_src=dev(k_src),
        q_real=dev(q_real),
        q_pos=dev(q_pos),
        k_real=dev(k_real),
        k_pos=dev(k_pos),
        q_keep=dev(q_keep.astype(np.float32)[:, None]),
        key_valid=dev(key_valid),
        masked=masked,
    )


def to_device(host: Tensor, device: torch.device | str) -> Tensor:
    """A host tensor on `device` without a host sync: on CUDA it is copied from pinned memory
    with non_blocking=True (a pageable copy makes the host wait for the GPU; the caching host
    allocator keeps the pinned block until the copy has run). Elsewhere a plain .to()."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def _row_index(offsets: list[int], rows_each: int, device: torch.device) -> RowIndex:
    if all(b == a + rows_each for a, b in zip(offsets, offsets[1:], strict=False)):
        return slice(offsets[0], offsets[0] + rows_each * len(offsets))
    starts = np.asarray(offsets, dtype=np.int64)
    index = (starts[:, None] + np.arange(rows_each, dtype=np.int64)[None, :]).reshape(-1)
    return to_device(torch.from_numpy(index), device)


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
    padded: tuple[PaddedGroup, ...] = ()  # merged calls (merge_padded), run before the groups
    # the ragged layout of the groups (_ragged_layout), built on first use; not part of equality
    merged: dict = field(default_factory=dict, compare=False, repr=False)

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
                    q_offsets=tuple(q_offsets),
                    k_offsets=tuple(k_offsets),
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
    def calls(self) -> tuple[SegmentGroup | PaddedGroup, ...]:
        """Every kernel call, the most work (count x q_len x k_len x heads) first."""
        if "calls" not in self.merged:
            calls = sorted(
                (*self.padded, *self.groups),
                key=lambda g: -call_work(g),
            )
            self.merged["calls"] = tuple(calls)
        return self.merged["calls"]

    @property
    def num_calls(self) -> int:
        return len(self.groups) + len(self.padded)

    def merge_padded(
        self, buckets: Sequence[Sequence[int]], device: torch.device | str, masked: bool = True
    ) -> SegmentTable:
        """This table with each bucket (indices into self.groups, two or more) run as one
        padded call. Only for disjoint tables (a padded call writes its rows)."""
        if not self.disjoint:
            raise ValueError("padded merges need a table whose segments share no rows")
        merged = {i for bucket in buckets for i in bucket}
        if any(len(b) < 2 for b in buckets) or len(merged) != sum(len(b) for b in buckets):
            raise ValueError(f"buckets must be disjoint lists of two or more groups: {buckets}")
        padded = tuple(padded_group([self.groups[i] for i in b], device, masked) for b in buckets)
        rest = tuple(g for i, g in enumerate(self.groups) if i not in merged)
        return SegmentTable(
            rest, disjoint=True, q_rows=self.q_rows, k_rows=self.k_rows,
            padded=self.padded + padded,
        )  # fmt: skip


def _take(rows: Tensor, index: RowIndex) -> Tensor:
    return rows[index] if isinstance(index, slice) else rows.index_select(0, index)


def _put(rows: Tensor, index: RowIndex, values: Tensor) -> None:
    if isinstance(index, slice):
        rows[index].copy_(values)
    else:
        rows.index_copy_(0, index, values.to(rows.dtype))


def _store_dense(rows: Tensor, index: RowIndex, dense: Tensor, add: bool = False) -> None:
    """Writes (or adds) a kernel's [B, n, L, H] result into its token-major rows: for a run of
    rows one strided copy straight from the kernel's layout (no token-major temporary whatever
    layout the kernel allocated), else a gather-index write."""
    if isinstance(index, slice):
        count, heads, length = dense.shape[:3]
        target = rows[index].view(count, length, heads, *rows.shape[1:])
        values = dense.transpose(1, 2)
        target.add_(values) if add else target.copy_(values)
    else:
        (_add if add else _put)(rows, index, _flat(dense))


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


def call_work(g: SegmentGroup | PaddedGroup) -> int:
    """The work of one kernel call (problems x query x key tokens x heads): the order and the
    stream assignment of a table's calls."""
    return g.count * g.q_len * g.k_len * g.num_heads


def stream_assignment(works: Sequence[int], streams: int) -> list[int]:
    """The stream of each call (calls in the order given, most work first): the one with the
    least work queued so far, the lowest index on ties. Decided in C++ (cost_model.h
    stream_assignment), where the cost model prices the same assignment."""
    return list(_core.stream_assignment([int(w) for w in works], int(streams)))


def _for_each_group(table: SegmentTable, fn, device: torch.device, streams: int) -> None:
    """fn(call) for every padded call and group, the most work first (the host queues the small
    calls while the GPU runs the large ones). On CUDA with streams > 1 each call goes to the side
    stream with the least work queued so far (longest first, least loaded: the streams finish
    together), so calls run concurrently: one call's result copies (memory-bound) and last,
    partly filled wave of thread blocks run beside another call's kernel (on an H200, 2 streams
    took 4-6% off a pack of 24-30 calls of 0.5-9k tokens). Writes must be disjoint."""
    calls = table.calls
    if streams <= 1 or device.type != "cuda" or len(calls) < 2:
        for g in calls:
            fn(g)
        return
    streams = min(streams, len(calls))
    key = (device, streams)
    if key not in _side_streams:
        _side_streams[key] = [torch.cuda.Stream(device) for _ in range(streams)]
    side = _side_streams[key]
    main = torch.cuda.current_stream(device)
    for stream in side:
        stream.wait_stream(main)
    for g, i in zip(calls, stream_assignment([call_work(g) for g in calls], streams), strict=True):
        with torch.cuda.stream(side[i]):
            fn(g)
    for stream in side:
        main.wait_stream(stream)


_store_streams: dict[torch.device, torch.cuda.Stream] = {}


class _Stores:
    """Where a call's results are written into the rows: right after the call on the current
    stream, or (overlap, CUDA only) on a side stream, so the copies (memory-bound) run beside
    the next call's kernel (compute-bound). The side stream takes each store after everything
    queued before it; its tensors are marked as used there (record_stream) so the allocator does
    not hand them out before the copy ran; finish() makes the current stream wait for it."""

    def __init__(self, device: torch.device, overlap: bool) -> None:
        self.side = None
        if overlap and device.type == "cuda":
            if device not in _store_streams:
                _store_streams[device] = torch.cuda.Stream(device)
            self.side = _store_streams[device]
            self.main = torch.cuda.current_stream(device)

    def run(self, store, *tensors: Tensor) -> None:
        if self.side is None:
            store()
            return
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            store()
        for tensor in tensors:
            tensor.record_stream(self.side)

    def finish(self) -> None:
        if self.side is not None:
            self.main.wait_stream(self.side)


KEY_TILE = 128  # key tokens of a cuDNN forward tile: a key count off a multiple runs slower


def _key_split(g: SegmentGroup, min_keys: int) -> int:
    """The key count of the aligned part of a split forward call (forward_into), or 0: none."""
    if min_keys <= 0 or g.k_len < max(min_keys, KEY_TILE) or g.k_len % KEY_TILE == 0:
        return 0
    return g.k_len // KEY_TILE * KEY_TILE


def _merge_split(o_main: Tensor, lse_main: Tensor, o_rest: Tensor, lse_rest: Tensor, out=None):
    """Attention over keys A and B from its parts ([B, n, L, H] o, [B, n, L] lse): lse = log(
    e^lse_A + e^lse_B), o = o_A + w (o_B - o_A) with w = e^(lse_B - lse), B's share of the
    softmax (small: B holds < 128 keys). One lerp writes o (into `out`, a [B, L, n, H] view of
    the rows, when given); w is kept in o's dtype, exact in float64, about w x 2^-9 relative in
    bf16."""
    lse = torch.logaddexp(lse_main, lse_rest)
    weight = torch.exp(lse_rest - lse).to(o_main.dtype).unsqueeze(-1)
    if out is None:
        return torch.lerp(o_main, o_rest, weight), lse
    torch.lerp(o_main.transpose(1, 2), o_rest.transpose(1, 2), weight.transpose(1, 2), out=out)
    return None, lse


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
    overlap_copies: bool = False,
    key_split: int = 0,
) -> None:
    """Writes o and lse of every segment's query rows (other rows are left untouched).

    key_split > 0: a group of at least that many keys, not a multiple of KEY_TILE, runs as two
    calls, its queries against the first multiple of KEY_TILE keys (cuDNN 9.19's forward runs
    ~11% faster on such a key count, bench/results/attention_engine_h200_202612.md)
    and against the < KEY_TILE keys left, merged by their lse (_merge_split) as ring steps are.
    The backward is unchanged: it needs only the final o and lse."""
    stores = _Stores(q_rows.device, overlap_copies and streams <= 1)

    def store_padded(g: PaddedGroup, o: Tensor, lse: Tensor) -> None:
        o_rows.index_copy_(0, g.q_real, _flat(o).index_select(0, g.q_pos))
        lse_flat = lse.transpose(1, 2).reshape(-1).to(lse_rows.dtype)
        lse_rows.index_copy_(0, g.q_real, lse_flat.index_select(0, g.q_pos))

    def store(g: SegmentGroup, o: Tensor, lse: Tensor) -> None:
        _store_dense(o_rows, g.q_index, o)
        store_lse(g, lse)

    def store_lse(g: SegmentGroup, lse: Tensor) -> None:
        if isinstance(g.q_index, slice):  # one strided copy, no token-major temporary
            lse_rows[g.q_index].view(g.count, g.q_len, g.num_heads).copy_(lse.transpose(1, 2))
        else:
            _put(lse_rows, g.q_index, lse.transpose(1, 2).reshape(-1))

    def store_split(g: SegmentGroup, o: Tensor, lse: Tensor, o_rest: Tensor, lse_rest: Tensor):
        if isinstance(g.q_index, slice):
            rows = o_rows[g.q_index].view(g.count, g.q_len, g.num_heads, *o_rows.shape[1:])
            _, lse = _merge_split(o, lse, o_rest, lse_rest, out=rows)
        else:
            merged, lse = _merge_split(o, lse, o_rest, lse_rest)
            _put(o_rows, g.q_index, _flat(merged))
        store_lse(g, lse)

    def one(g: SegmentGroup | PaddedGroup) -> None:
        if isinstance(g, PaddedGroup):
            q = _dense(q_rows, g.q_src, g, g.q_len)
            k = _dense(k_rows, g.k_src, g, g.k_len)
            v = _dense(v_rows, g.k_src, g, g.k_len)
            o, lse = kernel.forward(q, k, v, scale, _mask_of(g, kernel, q.dtype))
            stores.run(lambda: store_padded(g, o, lse), o, lse)
            return
        q = _dense(q_rows, g.q_index, g, g.q_len)
        k = _dense(k_rows, g.k_index, g, g.k_len)
        v = _dense(v_rows, g.k_index, g, g.k_len)
        aligned = _key_split(g, key_split)
        if aligned:
            o, lse = kernel.forward(q, k[:, :, :aligned], v[:, :, :aligned], scale)
            o_rest, lse_rest = kernel.forward(q, k[:, :, aligned:], v[:, :, aligned:], scale)
            parts = (o, lse, o_rest, lse_rest)
            stores.run(lambda: store_split(g, *parts), *parts)
            return
        o, lse = kernel.forward(q, k, v, scale)
        stores.run(lambda: store(g, o, lse), o, lse)

    _for_each_group(table, one, q_rows.device, streams if table.disjoint else 1)
    stores.finish()


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
    overlap_copies: bool = False,
) -> None:
    """Adds every segment's gradients into dq / dk / dv rows (rows may be shared by several
    segments or calls, e.g. ring steps), or writes them when accumulate is False."""
    stores = _Stores(q_rows.device, overlap_copies and streams <= 1)

    def store_padded(g: PaddedGroup, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
        for rows, grad, real, pos in (
            (dq_rows, dq, g.q_real, g.q_pos),
            (dk_rows, dk, g.k_real, g.k_pos),
            (dv_rows, dv, g.k_real, g.k_pos),
        ):
            rows.index_copy_(0, real, _flat(grad).index_select(0, pos).to(rows.dtype))

    def store(g: SegmentGroup, dq: Tensor, dk: Tensor, dv: Tensor) -> None:
        _store_dense(dq_rows, g.q_index, dq, add=accumulate)
        _store_dense(dk_rows, g.k_index, dk, add=accumulate)
        _store_dense(dv_rows, g.k_index, dv, add=accumulate)

    def one(g: SegmentGroup | PaddedGroup) -> None:
        if isinstance(g, PaddedGroup):
            q = _dense(q_rows, g.q_src, g, g.q_len)
            k = _dense(k_rows, g.k_src, g, g.k_len)
            v = _dense(v_rows, g.k_src, g, g.k_len)
            o = _dense(o_rows, g.q_src, g, g.q_len)
            do = _dense(do_rows, g.q_src, g, g.q_len)
            do = do * g.keep(do.dtype).view(g.count, g.q_len, g.num_heads, 1).transpose(1, 2)
            lse = _take(lse_rows, g.q_src).view(g.count, g.q_len, g.num_heads).transpose(1, 2)
            dq, dk, dv = kernel.backward(do, q, k, v, o, lse, scale, _mask_of(g, kernel, q.dtype))
            stores.run(lambda: store_padded(g, dq, dk, dv), dq, dk, dv)
            return
        q = _dense(q_rows, g.q_index, g, g.q_len)
        k = _dense(k_rows, g.k_index, g, g.k_len)
        v = _dense(v_rows, g.k_index, g, g.k_len)
        o = _dense(o_rows, g.q_index, g, g.q_len)
        do = _dense(do_rows, g.q_index, g, g.q_len)
        lse = _take(lse_rows, g.q_index).view(g.count, g.q_len, g.num_heads).transpose(1, 2)
        dq, dk, dv = kernel.backward(do, q, k, v, o, lse, scale)
        stores.run(lambda: store(g, dq, dk, dv), dq, dk, dv)

    if table.padded and accumulate:
        raise ValueError("padded merges write their rows: they need a disjoint table")
    parallel = table.disjoint and not accumulate
    _for_each_group(table, one, q_rows.device, streams if parallel else 1)
    stores.finish()


def _whole(table: SegmentTable, num_q_rows: int, num_k_rows: int) -> bool:
    """One dense group over all rows in order: kernel outputs are the results, no copies."""
    if len(table.groups) != 1 or table.padded:
        return False
    g = table.groups[0]
    return g.q_index == slice(0, num_q_rows) and g.k_index == slice(0, num_k_rows)


_key_split_verified: dict[tuple, bool] = {}


def key_split_ok(kernel: Kernel, device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a split forward with `kernel` (strided key views cut at KEY_TILE, merged by lse:
    two problems of 13 queries x 3 heads over KEY_TILE + 5 keys) gives the math kernel's o and
    lse over all keys; checked once per kernel, device, dtype and head dim."""
    key = (kernel.name, getattr(kernel, "bias_layout", None), device.type, dtype, head_dim)
    if key not in _key_split_verified:
        gen = torch.Generator(device="cpu").manual_seed(6)
        q_len, k_len, n = 13, KEY_TILE + 5, 3
        q, k, v = (
            torch.randn(2, length, n, head_dim, generator=gen).to(device, dtype).transpose(1, 2)
            for length in (q_len, k_len, k_len)
        )  # [B, n, L, H] views of token-major rows, as the engine passes them
        scale = head_dim**-0.5
        ok = False
        try:
            o, lse = kernel.forward(q, k[:, :, :KEY_TILE], v[:, :, :KEY_TILE], scale)
            o_rest, lse_rest = kernel.forward(q, k[:, :, KEY_TILE:], v[:, :, KEY_TILE:], scale)
            o, lse = _merge_split(o, lse, o_rest, lse_rest)
            o_ref, lse_ref = MathKernel().forward(q, k, v, scale)
            ok = all(close_to_math(got, want, dtype) for got, want in ((o, o_ref), (lse, lse_ref)))
        except (RuntimeError, TypeError, NotImplementedError, ValueError):
            ok = False
        _key_split_verified[key] = ok
    return _key_split_verified[key]
