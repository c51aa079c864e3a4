"""StepLayout: one rank's compiled plan as device tensors and dense attention groups.

Built once per step by `prepare_step` (every layer reuses it). The integer bookkeeping comes from
the C++ plan compiler (`zellige._core.compile_rank_layout`); this file only moves it to the device
and derives the per-call groups.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from zellige import _core
from zellige.runtime.coalesced import SegmentTable

Tensor = torch.Tensor


def _long(array: np.ndarray, device: torch.device) -> Tensor:
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(device)


def _inverse(index: np.ndarray) -> np.ndarray:
    inverse = np.empty_like(index)
    inverse[index] = np.arange(index.size, dtype=index.dtype)
    return inverse


@dataclass(slots=True)
class RingStep:
    """Ring step s >= 1 for all ring/hybrid segments of the rank: one message per peer each way.

    sends: (peer, compact rows of the rank's own blocks going to it, in sequence order);
    recvs: (peer, rows in the step's receive buffer); table: attention of the rank's query rows
    (compact) against the received blocks."""

    sends: list[tuple[int, list[slice]]]
    recvs: list[tuple[int, slice]]
    num_recv_rows: int
    table: SegmentTable


@dataclass(slots=True)
class RingPlan:
    """Ring and hybrid segments gathered into compact rows (own blocks first, then hybrid)."""

    num_rows: int
    own_index: Tensor  # own rows -> compact rows [0, len)
    exchange_index: Tensor  # exchange rows -> compact rows [len(own_index), num_rows)
    step0: SegmentTable
    steps: list[RingStep]


@dataclass(slots=True)
class StepLayout:
    """Everything one rank needs for one step under one plan (see zellige.runtime)."""

    rank: int
    num_ranks: int
    num_heads: int
    device: torch.device
    group: dist.ProcessGroup | None
    compiled: _core.RankLayout
    num_held_tokens: int
    num_source_tokens: int
    position_ids: Tensor  # [T, 3] (t, h, w) long
    sequence_index: Tensor  # [T] long, index into batch.sequences
    # route
    route_send_index: Tensor
    route_recv_index: Tensor
    route_recv_inverse: Tensor
    route_send_splits: list[int]
    route_recv_splits: list[int]
    # Ulysses exchange
    world_has_exchange: bool
    num_exchange_rows: int
    exchange_send_index: Tensor
    exchange_recv_index: Tensor
    exchange_recv_inverse: Tensor
    exchange_send_splits: list[int]
    exchange_recv_splits: list[int]
    # attention
    local_table: SegmentTable  # whole local sequences, own rows
    exchange_table: SegmentTable  # Ulysses sequences, exchange rows
    ring: RingPlan
    global_ranks: list[int] = field(default_factory=list)  # group rank -> global rank (P2P)


def _ring_plan(layout: _core.RankLayout, device: torch.device) -> RingPlan:
    seg_rows = layout.segment_row_offset
    seg_tokens = layout.segment_num_tokens
    seg_heads = layout.segment_num_heads
    seg_exchange = layout.segment_in_exchange
    seg_sequence = layout.segment_sequence_index
    entries = []  # (segment, compact offset, rows)
    own_parts, exchange_parts = [], []
    compact = 0
    for is_exchange in (0, 1):
        for e, g in enumerate(layout.ring_segment.tolist()):
            if seg_exchange[g] != is_exchange:
                continue
            rows = int(seg_tokens[g] * seg_heads[g])
            (exchange_parts if is_exchange else own_parts).append(
                np.arange(seg_rows[g], seg_rows[g] + rows)
            )
            entries.append((e, g, compact, rows))
            compact += rows
    own_index = np.concatenate(own_parts) if own_parts else np.zeros(0, np.int64)
    exchange_index = np.concatenate(exchange_parts) if exchange_parts else np.zeros(0, np.int64)

    offsets = [c for _, _, c, _ in entries]
    tokens = [int(seg_tokens[g]) for _, g, _, _ in entries]
    heads = [int(seg_heads[g]) for _, g, _, _ in entries]
    step0 = SegmentTable.build(offsets, offsets, tokens, tokens, heads, device)

    degree, position = layout.ring_degree, layout.ring_position
    peer_offset, peers, block_tokens = (
        layout.ring_peer_offset,
        layout.ring_peers,
        layout.ring_block_tokens,
    )
    steps = []
    max_degree = int(degree.max()) if degree.size else 1
    for s in range(1, max_degree):
        # Messages to / from one peer carry their sequences in batch order on both ends.
        send_to: dict[int, list[tuple[int, int, int]]] = {}
        recv_from: dict[int, list[tuple[int, int, int, int]]] = {}
        for e, g, c, rows in entries:
            r = int(degree[e])
            if r <= s or rows == 0:  # an empty block neither sends nor needs anything
                continue
            j, base = int(position[e]), int(peer_offset[e])
            sequence = int(seg_sequence[g])
            dst, src = (j + s) % r, (j - s) % r
            if block_tokens[base + dst] > 0:
                send_to.setdefault(int(peers[base + dst]), []).append((sequence, c, rows))
            if block_tokens[base + src] > 0:
                recv_from.setdefault(int(peers[base + src]), []).append(
                    (sequence, g, c, int(block_tokens[base + src]))
                )
        sends = [
            (peer, [slice(c, c + rows) for _, c, rows in sorted(items)])
            for peer, items in sorted(send_to.items())
        ]
        recvs, q_offsets, k_offsets, q_tokens, k_tokens, q_heads = [], [], [], [], [], []
        recv_rows_total = 0
        for peer, items in sorted(recv_from.items()):
            start = recv_rows_total
            for _, g, c, block in sorted(items):
                q_offsets.append(c)
                k_offsets.append(recv_rows_total)
                q_tokens.append(int(seg_tokens[g]))
                k_tokens.append(block)
                q_heads.append(int(seg_heads[g]))
                recv_rows_total += block * int(seg_heads[g])
            recvs.append((peer, slice(start, recv_rows_total)))
        table = SegmentTable.build(q_offsets, k_offsets, q_tokens, k_tokens, q_heads, device)
        steps.append(RingStep(sends, recvs, recv_rows_total, table))
    return RingPlan(compact, _long(own_index, device), _long(exchange_index, device), step0, steps)


def _segment_table(layout: _core.RankLayout, kinds: tuple[int, ...], device) -> SegmentTable:
    mask = np.isin(layout.segment_kind, kinds)
    rows = layout.segment_row_offset[mask]
    tokens = layout.segment_num_tokens[mask]
    return SegmentTable.build(rows, rows, tokens, tokens, layout.segment_num_heads[mask], device)


def plan_fingerprint(batch: _core.Batch, plan: _core.Plan) -> int:
    """A 62-bit digest of what the layout depends on, to detect ranks that disagree."""
    text = repr(
        (
            [
                (s.id, s.num_tokens, s.source_rank, s.grid_t, s.grid_h, s.grid_w)
                for s in batch.sequences
            ],
            plan.num_ranks,
            [
                (p.sequence_id, str(p.strategy), list(p.ranks), p.ulysses_degree)
                for p in plan.placements
            ],
        )
    )
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _agree_on_status(error: str | None, fingerprint: int, group, device: torch.device) -> None:
    """One small all_gather: every rank learns whether any rank failed or disagrees, so all raise
    the same error instead of some entering a collective the others never join."""
    status = torch.tensor([1 if error else 0, fingerprint], dtype=torch.long, device=device)
    world = dist.get_world_size(group)
    gathered = [torch.zeros_like(status) for _ in range(world)]
    dist.all_gather(gathered, status, group=group)
    rows = torch.stack(gathered).cpu().tolist()
    failed = [r for r, (flag, _) in enumerate(rows) if flag]
    if failed:
        message = [error]
        source = dist.get_global_rank(group, failed[0]) if group is not None else failed[0]
        dist.broadcast_object_list(message, src=source, group=group)
        raise ValueError(message[0])
    if len({fp for _, fp in rows}) > 1:
        raise ValueError(
            "ranks disagree on the batch or the plan (fingerprints differ); every rank must "
            "compile the same plan for the same batch"
        )


def prepare_step(
    batch: _core.Batch,
    plan: _core.Plan,
    num_heads: int,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    *,
    rank: int | None = None,
    check_agreement: bool = True,
) -> StepLayout:
    """Compiles this rank's layout of `plan` for `batch` and moves it to `device`.

    Validation happens before any exchange: a plan that does not match the batch, the world size
    or the head count raises the same ValueError on every rank. With check_agreement (default),
    one tiny all_gather also catches ranks that were handed different batches or plans.
    rank: defaults to this process's rank in `group`; pass it (and no group) to build a layout
    without a process group (tests, tools), even where one is initialised.
    """
    device = torch.device(device)
    distributed = (
        (rank is None or group is not None) and dist.is_available() and dist.is_initialized()
    )
    if rank is None:
        if not distributed:
            raise ValueError("prepare_step needs an initialised process group or an explicit rank")
        rank = dist.get_rank(group)
    if distributed:
        world = dist.get_world_size(group)
        if plan.num_ranks != world:
            raise ValueError(
                f"the plan is for {plan.num_ranks} ranks but the process group has {world}"
            )
    error = None
    try:
        layout = _core.compile_rank_layout(batch, plan, rank, num_heads)
    except ValueError as exc:
        error = str(exc)
    if distributed and check_agreement:
        _agree_on_status(error, plan_fingerprint(batch, plan), group, device)
    if error is not None:
        raise ValueError(error)
    return build_step_layout(layout, device, group if distributed else None)


def build_step_layout(
    layout: _core.RankLayout, device: torch.device, group: dist.ProcessGroup | None
) -> StepLayout:
    route_recv_index = layout.route_recv_index
    exchange_recv_index = layout.exchange_recv_index
    if group is not None or (dist.is_available() and dist.is_initialized()):
        global_ranks = [
            dist.get_global_rank(group, r) if group is not None else r
            for r in range(layout.num_ranks)
        ]
    else:
        global_ranks = list(range(layout.num_ranks))
    local, ulysses = _core.SegmentKind.local.value, _core.SegmentKind.ulysses.value
    return StepLayout(
        rank=layout.rank,
        num_ranks=layout.num_ranks,
        num_heads=layout.num_heads,
        device=device,
        group=group,
        compiled=layout,
        num_held_tokens=layout.num_held_tokens,
        num_source_tokens=layout.num_source_tokens,
        position_ids=_long(layout.token_position_thw, device),
        sequence_index=_long(layout.token_sequence_index, device),
        route_send_index=_long(layout.route_send_index, device),
        route_recv_index=_long(route_recv_index, device),
        route_recv_inverse=_long(_inverse(route_recv_index), device),
        route_send_splits=layout.route_send_splits.tolist(),
        route_recv_splits=layout.route_recv_splits.tolist(),
        world_has_exchange=bool(layout.world_has_exchange),
        num_exchange_rows=layout.num_exchange_rows,
        exchange_send_index=_long(layout.exchange_send_index, device),
        exchange_recv_index=_long(exchange_recv_index, device),
        exchange_recv_inverse=_long(_inverse(exchange_recv_index), device),
        exchange_send_splits=layout.exchange_send_splits.tolist(),
        exchange_recv_splits=layout.exchange_recv_splits.tolist(),
        local_table=_segment_table(layout, (local,), device),
        exchange_table=_segment_table(layout, (ulysses,), device),
        ring=_ring_plan(layout, device),
        global_ranks=global_ranks,
    )


Step = StepLayout  # the name the public API uses


def compile_step(
    batch: _core.Batch,
    plan: _core.Plan,
    num_heads: int,
    rank: int,
    *,
    joint_attention: bool = False,
) -> _core.StepProgram:
    """This rank's StepProgram (C++ plan compiler): picklable, built once, loaded by load_step.
    Raises ValueError when the plan does not match the batch or the head count."""
    raise NotImplementedError("compile_step: being built on branch w13")


def load_step(
    program: _core.StepProgram | None,
    device: torch.device | str,
    group: dist.ProcessGroup | None = None,
    *,
    error: str | None = None,
    check_agreement: bool = True,
) -> StepLayout:
    """The program's arrays on `device`. Every rank of `group` calls it; when any rank passes an
    `error` (or program None with an error) or the programs are for different batches or plans,
    every rank raises the same ValueError."""
    raise NotImplementedError("load_step: being built on branch w13")
