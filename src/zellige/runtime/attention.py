"""Distributed attention of one layer under a compiled plan, as one autograd Function.

Forward, per rank: (1) start the Ulysses all_to_all (q, k, v rows of all its Ulysses and hybrid
sequences, one collective over the group); (2) meanwhile attend its whole local sequences;
(3) attend the exchanged Ulysses sequences; (4) ring and hybrid blocks: step 0 on its own block,
then per step s one batched P2P (own block to peer j+s, block j-s from peer j-s; the next step is
prefetched while this one computes) and a log-sum-exp merge; (5) the all_to_all back.
A checkpointed block's recompute runs (1) only (runtime/recompute.py keeps the outputs).
Backward mirrors it: dO travels the forward exchange while local gradients compute, ring steps
fetch k/v again and return dk/dv to their owners, and dq/dk/dv travel the exchange back.

Legend: T held tokens, N heads, H head dim; *_rows are [rows, H] with row = token x head.
"""

from __future__ import annotations

import torch

from zellige.runtime import recompute
from zellige.runtime.backends import choose_backend, coalesced_attention, step_kernel
from zellige.runtime.coalesced import SegmentTable, backward_into, forward_into
from zellige.runtime.kernels import Kernel, default_scale, lse_dtype
from zellige.runtime.layout import RingPlan, RingStep, Step
from zellige.runtime.transport import wait_all

Tensor = torch.Tensor

_GRAD_TAG = 1 << 16  # P2P tags: ring step s uses s for k/v blocks, _GRAD_TAG + s for dk/dv


def _issue_kv(rs: RingStep, kv_c: Tensor, step: Step, tag: int) -> tuple[list, Tensor]:
    recv = kv_c.new_empty((rs.num_recv_rows, *kv_c.shape[1:]))
    sends = []
    for peer, slices in rs.sends:
        parts = [kv_c[sl] for sl in slices]
        sends.append((peer, parts[0] if len(parts) == 1 else torch.cat(parts)))
    recvs = [(peer, recv[sl]) for peer, sl in rs.recvs]
    return _p2p(step, sends, recvs, tag), recv


def _p2p(step: Step, sends, recvs, tag: int) -> list:
    return step.transport.p2p(sends, recvs, step.global_ranks, step.group, tag)


def _all_to_all_rows(step: Step, send, send_splits, recv_splits, async_op: bool = False):
    return step.transport.all_to_all_rows(send, send_splits, recv_splits, step.group, async_op)


def _backend(table: SegmentTable, step: Step, kernel: Kernel, scale, q, k, backend):
    """The backend of a step's local or exchanged table (backends.choose_backend under the
    step's engine): one ragged call, or the step's kernel over the plain groups. These tables are
    disjoint and written whole; ring steps add into their rows and keep their groups."""
    return choose_backend(
        table, q, k, step.engine, scale=scale, backend=backend, kernel=kernel, plain_groups=True
    )


def _table_forward(table, step, kernel, scale, q, k, v, o, lse, backend) -> None:
    _backend(table, step, kernel, scale, q, k, backend).forward_into(q, k, v, o, lse)


def _table_backward(table, step, kernel, scale, q, k, v, o, lse, do, dq, dk, dv, backend) -> None:
    """Writes the table's rows of dq / dk / dv."""
    _backend(table, step, kernel, scale, q, k, backend).backward_into(
        do, q, k, v, o, lse, dq, dk, dv
    )


def _ring_forward(
    ring: RingPlan, step: Step, kernel: Kernel, scale: float, q_c: Tensor, kv_c: Tensor
) -> tuple[Tensor, Tensor]:
    acc = lse_dtype(q_c.dtype)
    o_acc = torch.zeros(q_c.shape, dtype=acc, device=q_c.device)
    lse_acc = torch.full((q_c.shape[0],), float("-inf"), dtype=acc, device=q_c.device)
    forward_into(ring.step0, kernel, scale, q_c, kv_c[:, 0], kv_c[:, 1], o_acc, lse_acc)
    pending = _issue_kv(ring.steps[0], kv_c, step, 1) if ring.steps else None
    for s, rs in enumerate(ring.steps, start=1):
        works, recv = pending
        if s < len(ring.steps):
            pending = _issue_kv(ring.steps[s], kv_c, step, s + 1)
        wait_all(works)
        o_s = torch.zeros_like(o_acc)
        lse_s = torch.full_like(lse_acc, float("-inf"))
        forward_into(rs.table, kernel, scale, q_c, recv[:, 0], recv[:, 1], o_s, lse_s)
        lse_new = torch.logaddexp(lse_acc, lse_s)
        o_acc = (
            o_acc * torch.exp(lse_acc - lse_new)[:, None]
            + o_s * torch.exp(lse_s - lse_new)[:, None]
        )
        lse_acc = lse_new
    return o_acc.to(q_c.dtype), lse_acc


def _ring_backward(
    ring: RingPlan,
    step: Step,
    kernel: Kernel,
    scale: float,
    q_c: Tensor,
    kv_c: Tensor,
    o_c: Tensor,
    lse_c: Tensor,
    do_c: Tensor,
) -> tuple[Tensor, Tensor]:
    acc = lse_dtype(q_c.dtype)
    dq_c = torch.zeros(q_c.shape, dtype=acc, device=q_c.device)
    dkv_c = torch.zeros(kv_c.shape, dtype=acc, device=q_c.device)
    backward_into(
        ring.step0, kernel, scale, q_c, kv_c[:, 0], kv_c[:, 1], o_c, lse_c, do_c,
        dq_c, dkv_c[:, 0], dkv_c[:, 1],
    )  # fmt: skip

    def finish(grad_works: list, sends: list, bufs: list[Tensor]) -> None:
        wait_all(grad_works)
        for (_, slices), buf in zip(sends, bufs, strict=True):
            start = 0
            for sl in slices:
                rows = sl.stop - sl.start
                dkv_c[sl] += buf[start : start + rows]
                start += rows

    pending = _issue_kv(ring.steps[0], kv_c, step, 1) if ring.steps else None
    pending_grads = None
    for s, rs in enumerate(ring.steps, start=1):
        works, recv = pending
        if s < len(ring.steps):
            pending = _issue_kv(ring.steps[s], kv_c, step, s + 1)
        wait_all(works)
        dkv_recv = torch.zeros_like(recv)
        backward_into(
            rs.table, kernel, scale, q_c, recv[:, 0], recv[:, 1], o_c, lse_c, do_c,
            dq_c, dkv_recv[:, 0], dkv_recv[:, 1],
        )  # fmt: skip
        # dk/dv of a received block belong to its owner: the reverse of this step's messages.
        bufs = [
            kv_c.new_empty((sum(sl.stop - sl.start for sl in slices), *kv_c.shape[1:]))
            for _, slices in rs.sends
        ]
        grad_works = _p2p(
            step,
            [(peer, dkv_recv[sl]) for peer, sl in rs.recvs],
            [(peer, buf) for (peer, _), buf in zip(rs.sends, bufs, strict=True)],
            _GRAD_TAG + s,
        )
        if pending_grads is not None:
            finish(*pending_grads)
        pending_grads = (grad_works, rs.sends, bufs)
    if pending_grads is not None:
        finish(*pending_grads)
    return dq_c, dkv_c


def _gather_ring(ring: RingPlan, own_rows: Tensor, exchange_rows: Tensor | None) -> Tensor:
    parts = [own_rows.index_select(0, ring.own_index)]
    if exchange_rows is not None and ring.exchange_index.numel():
        parts.append(exchange_rows.index_select(0, ring.exchange_index))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _scatter_ring(ring: RingPlan, compact: Tensor, own_rows: Tensor, exchange_rows) -> None:
    num_own = ring.own_index.numel()
    own_rows.index_copy_(0, ring.own_index, compact[:num_own].to(own_rows.dtype))
    if exchange_rows is not None and ring.exchange_index.numel():
        exchange_rows.index_copy_(0, ring.exchange_index, compact[num_own:].to(exchange_rows.dtype))


def _received(step: Step, recv: Tensor, work) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v rows of the exchanged sequences, in the exchange table's order."""
    work.wait()
    return tuple(recv[:, i].index_select(0, step.exchange_recv_index) for i in range(3))


def _attend(step: Step, kernel: Kernel, scale: float, q, k, v, recv, work, backend=None):
    """The forward's attention of the held rows: local sequences (overlapping the q/k/v
    exchange), exchanged sequences, ring blocks, and the exchange of the outputs back.
    Returns o, lse, o_x, lse_x, lse_c, q_x, k_x, v_x (None where the plan has no such rows)."""
    lse_type = lse_dtype(q.dtype)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[0], dtype=lse_type, device=q.device)
    # overlaps the exchange
    _table_forward(step.local_table, step, kernel, scale, q, k, v, o, lse, backend)

    q_x = k_x = v_x = o_x = lse_x = None
    if work is not None:
        q_x, k_x, v_x = _received(step, recv, work)
        o_x = torch.empty_like(q_x)
        lse_x = torch.empty(q_x.shape[0], dtype=lse_type, device=q.device)
        _table_forward(step.exchange_table, step, kernel, scale, q_x, k_x, v_x, o_x, lse_x, backend)

    ring = step.ring
    lse_c = None
    if ring.num_rows:
        q_c = _gather_ring(ring, q, q_x)
        kv_c = torch.stack([_gather_ring(ring, k, k_x), _gather_ring(ring, v, v_x)], dim=1)
        o_c, lse_c = _ring_forward(ring, step, kernel, scale, q_c, kv_c)
        _scatter_ring(ring, o_c, o, o_x)

    if work is not None:
        back, _ = _all_to_all_rows(
            step,
            o_x.index_select(0, step.exchange_recv_inverse),
            step.exchange_recv_splits,
            step.exchange_send_splits,
        )
        o.index_copy_(0, step.exchange_send_index, back)
    return o, lse, o_x, lse_x, lse_c, q_x, k_x, v_x


class _DistributedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_TNH, k_TNH, v_TNH, step: Step, kernel: Kernel, scale: float, backend):
        num_tokens, num_heads, head_dim = q_TNH.shape
        q, k, v = (
            t.contiguous().view(num_tokens * num_heads, head_dim) for t in (q_TNH, k_TNH, v_TNH)
        )
        work = recv = None
        if step.world_has_exchange:
            index = step.exchange_send_index
            send = torch.stack([t.index_select(0, index) for t in (q, k, v)], dim=1)
            recv, work = _all_to_all_rows(
                step, send, step.exchange_send_splits, step.exchange_recv_splits, True
            )
        kept = recompute.replayed()
        if kept is None:
            o, lse, o_x, lse_x, lse_c, q_x, k_x, v_x = _attend(
                step, kernel, scale, q, k, v, recv, work, backend
            )
            recompute.keep(o, lse, o_x, lse_x, lse_c)
        else:
            # A checkpointed block's recompute: the outputs are the forward's; only the q/k/v
            # rows the exchange delivers are needed again (the backward attends them).
            o, lse, o_x, lse_x, lse_c = kept
            q_x, k_x, v_x = _received(step, recv, work) if work is not None else (None,) * 3
        # Ring rows are gathered again in backward rather than kept: ring is chosen for memory.
        ctx.save_for_backward(q, k, v, o, lse, q_x, k_x, v_x, o_x, lse_x, lse_c)
        ctx.step, ctx.kernel, ctx.scale, ctx.backend = step, kernel, scale, backend
        ctx.shape = q_TNH.shape
        return o.view(num_tokens, num_heads, head_dim)

    @staticmethod
    def backward(ctx, grad_TNH):
        q, k, v, o, lse, q_x, k_x, v_x, o_x, lse_x, lse_c = ctx.saved_tensors
        step, kernel, scale, backend = ctx.step, ctx.kernel, ctx.scale, ctx.backend
        do = grad_TNH.contiguous().view(q.shape)
        work = None
        if step.world_has_exchange:
            recv, work = _all_to_all_rows(
                step,
                do.index_select(0, step.exchange_send_index),
                step.exchange_send_splits,
                step.exchange_recv_splits,
                True,
            )
        dq, dk, dv = (torch.zeros_like(t) for t in (q, k, v))
        _table_backward(
            step.local_table, step, kernel, scale, q, k, v, o, lse, do, dq, dk, dv, backend
        )

        do_x = dq_x = dk_x = dv_x = None
        if work is not None:
            work.wait()
            do_x = recv.index_select(0, step.exchange_recv_index)
            dq_x, dk_x, dv_x = (torch.zeros_like(t) for t in (q_x, k_x, v_x))
            _table_backward(
                step.exchange_table, step, kernel, scale, q_x, k_x, v_x, o_x, lse_x, do_x,
                dq_x, dk_x, dv_x, backend,
            )  # fmt: skip

        ring = step.ring
        if ring.num_rows:
            q_c, o_c, do_c = (_gather_ring(ring, a, b) for a, b in ((q, q_x), (o, o_x), (do, do_x)))
            kv_c = torch.stack([_gather_ring(ring, k, k_x), _gather_ring(ring, v, v_x)], dim=1)
            dq_c, dkv_c = _ring_backward(ring, step, kernel, scale, q_c, kv_c, o_c, lse_c, do_c)
            _scatter_ring(ring, dq_c, dq, dq_x)
            _scatter_ring(ring, dkv_c[:, 0], dk, dk_x)
            _scatter_ring(ring, dkv_c[:, 1], dv, dv_x)

        if work is not None:
            send = torch.stack(
                [t.index_select(0, step.exchange_recv_inverse) for t in (dq_x, dk_x, dv_x)], 1
            )
            back, _ = _all_to_all_rows(
                step, send, step.exchange_recv_splits, step.exchange_send_splits
            )
            for grad, i in ((dq, 0), (dk, 1), (dv, 2)):
                grad.index_copy_(0, step.exchange_send_index, back[:, i])
        shape = ctx.shape
        return dq.view(shape), dk.view(shape), dv.view(shape), None, None, None, None


def distributed_attention(
    q_TNH: Tensor,
    k_TNH: Tensor,
    v_TNH: Tensor,
    step: Step,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> Tensor:
    """Bidirectional attention of every sequence under the step's plan; returns o [T, N, H] for the
    rank's held tokens, exactly what single-process attention gives for them. Differentiable in
    q, k, v. Every rank of the group must call it (ranks without work take part in the exchange).
    backend: attention kernel override ("cudnn", "flash", "efficient", "cpu", "math")."""
    if q_TNH.shape[0] != step.num_held_tokens or q_TNH.shape[1] != step.num_heads:
        raise ValueError(
            f"rank {step.rank} holds {step.num_held_tokens} tokens x {step.num_heads} heads, got "
            f"q of shape {tuple(q_TNH.shape)}"
        )
    if k_TNH.shape != q_TNH.shape or v_TNH.shape != q_TNH.shape:
        raise ValueError("q, k and v must have the same shape [T, N, H]")
    head_dim = q_TNH.shape[-1]
    kernel = step_kernel(step.engine, q_TNH.device, q_TNH.dtype, head_dim, backend)
    scale = default_scale(head_dim) if scale is None else scale
    return _DistributedAttention.apply(q_TNH, k_TNH, v_TNH, step, kernel, scale, backend)


def cross_attention(
    q_TNH: Tensor,
    k_XNH: Tensor,
    v_XNH: Tensor,
    step: Step,
    *,
    scale: float | None = None,
    backend: str | None = None,
) -> Tensor:
    """Each held chunk's queries against its sequence's text rows (route_text's order), in the
    program's dense groups; a chunk whose sequence has no text gets zeros. Local to the rank."""
    num_tokens, num_heads, head_dim = q_TNH.shape
    if num_tokens != step.num_held_tokens or num_heads != step.num_heads:
        raise ValueError(
            f"rank {step.rank} holds {step.num_held_tokens} tokens x {step.num_heads} heads, got "
            f"q of shape {tuple(q_TNH.shape)}"
        )
    text_rows = step.routes["cross_text"].num_held
    if k_XNH.shape[:2] != (text_rows, num_heads) or v_XNH.shape != k_XNH.shape:
        raise ValueError(
            f"rank {step.rank} attends to {text_rows} text rows x {num_heads} heads, got k of "
            f"shape {tuple(k_XNH.shape)} and v of shape {tuple(v_XNH.shape)}"
        )
    o_rows = coalesced_attention(
        q_TNH.reshape(-1, head_dim),
        k_XNH.reshape(-1, head_dim),
        v_XNH.reshape(-1, head_dim),
        step.cross_table,
        scale=scale,
        backend=backend,
        engine=step.engine,
    )
    return o_rows.view(num_tokens, num_heads, head_dim)
