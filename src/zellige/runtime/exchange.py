"""Communication: the route all_to_all, the world-wide Ulysses all_to_all and batched P2P ring
messages. Every collective here is called by every rank of the group with sizes from the plan
compiler, so ranks with nothing to send still take part (zero splits) and none waits alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zellige.runtime.layout import StepLayout

Tensor = torch.Tensor


def all_to_all_rows(
    send: Tensor,
    send_splits: list[int],
    recv_splits: list[int],
    group: dist.ProcessGroup | None,
    async_op: bool = False,
) -> tuple[Tensor, dist.Work | None]:
    """Uneven all_to_all_single on dim 0; returns the receive buffer (and the handle if async)."""
    recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
    work = dist.all_to_all_single(
        recv, send.contiguous(), recv_splits, send_splits, group=group, async_op=async_op
    )
    return recv, work


def p2p(
    sends: Sequence[tuple[int, Tensor]],
    recvs: Sequence[tuple[int, Tensor]],
    step: StepLayout,
    tag: int,
) -> list:
    """One dist.batch_isend_irecv for all messages of a ring step (group ranks -> global)."""
    ops = [
        dist.P2POp(dist.isend, t.contiguous(), step.global_ranks[p], step.group, tag)
        for p, t in sends
        if t.numel() > 0
    ]
    ops += [
        dist.P2POp(dist.irecv, t, step.global_ranks[p], step.group, tag)
        for p, t in recvs
        if t.numel() > 0
    ]
    return dist.batch_isend_irecv(ops) if ops else []


def wait_all(works: list) -> None:
    for work in works:
        work.wait()


def _route(x: Tensor, step: StepLayout) -> Tensor:
    send = x.index_select(0, step.route_send_index)
    recv, _ = all_to_all_rows(send, step.route_send_splits, step.route_recv_splits, step.group)
    return recv.index_select(0, step.route_recv_index)


def _reverse_route(x: Tensor, step: StepLayout) -> Tensor:
    send = x.index_select(0, step.route_recv_inverse)
    recv, _ = all_to_all_rows(send, step.route_recv_splits, step.route_send_splits, step.group)
    out = torch.empty_like(recv)
    return out.index_copy_(0, step.route_send_index, recv)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step):
        ctx.step = step
        return _route(x, step)

    @staticmethod
    def backward(ctx, grad):
        return _reverse_route(grad.contiguous(), ctx.step), None


class _ReverseRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, step):
        ctx.step = step
        return _reverse_route(x, step)

    @staticmethod
    def backward(ctx, grad):
        return _route(grad.contiguous(), ctx.step), None


def route(x_source: Tensor, step: StepLayout) -> Tensor:
    """Source tokens [S, ...] (this rank's loader output: its sequences whole, in batch order)
    -> held tokens [T, ...] in held order. One all_to_all; differentiable (backward: the reverse
    all_to_all). Any dtype, any trailing shape (features, positions, labels)."""
    if x_source.shape[0] != step.num_source_tokens:
        raise ValueError(
            f"route expects {step.num_source_tokens} source tokens on rank {step.rank}, "
            f"got {x_source.shape[0]}"
        )
    return _Route.apply(x_source, step)


def reverse_route(x_held: Tensor, step: StepLayout) -> Tensor:
    """Held tokens [T, ...] -> source tokens [S, ...]: the inverse of `route`."""
    if x_held.shape[0] != step.num_held_tokens:
        raise ValueError(
            f"reverse_route expects {step.num_held_tokens} held tokens on rank {step.rank}, "
            f"got {x_held.shape[0]}"
        )
    return _ReverseRoute.apply(x_held, step)


def route_text(text_source: Tensor, step: StepLayout) -> Tensor:
    """Cross-attention: source text rows [S_text, ...] (the rank's sequences' text in batch
    order) -> [X, ...], the whole text of each held chunk's sequence, chunks in held order.
    Differentiable; the backward sums the gradients of a text delivered to several ranks."""
    raise NotImplementedError("route_text: being built on branch w13")
