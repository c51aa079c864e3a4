"""Communication: the route all_to_all, the world-wide Ulysses all_to_all and batched P2P ring
messages. Every collective here is called by every rank of the group with sizes from the plan
compiler, so ranks with nothing to send still take part (zero splits) and none waits alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from zellige.runtime.layout import TOKENS, DeviceRoute, Step

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
    step: Step,
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


def _forward(x: Tensor, route: DeviceRoute, group) -> Tensor:
    send = x.index_select(0, route.send_index)
    recv, _ = all_to_all_rows(send, route.send_splits, route.recv_splits, group)
    return recv.index_select(0, route.recv_index)


def _backward(x: Tensor, route: DeviceRoute, group) -> Tensor:
    """The transpose of _forward: rows go back; a source row sent to several ranks sums."""
    send = x.index_select(0, route.recv_inverse)
    recv, _ = all_to_all_rows(send, route.recv_splits, route.send_splits, group)
    if route.sends_each_row_once:
        return torch.empty_like(recv).index_copy_(0, route.send_index, recv)
    out = recv.new_zeros((route.num_source, *recv.shape[1:]))
    return out.index_add_(0, route.send_index, recv)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, group):
        ctx.route, ctx.group = route, group
        return _forward(x, route, group)

    @staticmethod
    def backward(ctx, grad):
        return _backward(grad.contiguous(), ctx.route, ctx.group), None, None


class _ReverseRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, group):
        ctx.route, ctx.group = route, group
        return _backward(x, route, group)

    @staticmethod
    def backward(ctx, grad):
        return _forward(grad.contiguous(), ctx.route, ctx.group), None, None


def _token_route(step: Step, tokens: str) -> DeviceRoute:
    if tokens not in TOKENS:
        raise ValueError(f"tokens must be one of {', '.join(TOKENS)}, got {tokens!r}")
    if tokens == "text" and not step.joint_attention:
        raise ValueError(
            "tokens='text': a cross-attention step holds no text tokens; route_text delivers "
            "each held chunk's text"
        )
    return step.routes[tokens]


def route(x_source: Tensor, step: Step, tokens: str = "all") -> Tensor:
    """Source tokens [S, ...] (this rank's loader output: its sequences whole, in batch order;
    joint: each its text then its visual tokens) -> held tokens [T, ...] in held order. One
    all_to_all; differentiable (backward: the reverse all_to_all). Any dtype and trailing shape.
    tokens="visual" / "text": only that modality ([S_visual, ...] -> [T_visual, ...], in the
    order of step.visual_index / step.text_index), so streams of different widths route apart."""
    r = _token_route(step, tokens)
    if x_source.shape[0] != r.num_source:
        raise ValueError(
            f"route(tokens={tokens!r}) expects {r.num_source} source rows on rank {step.rank}, "
            f"got {x_source.shape[0]}"
        )
    return _Route.apply(x_source, r, step.group)


def reverse_route(x_held: Tensor, step: Step, tokens: str = "all") -> Tensor:
    """Held tokens [T, ...] -> source tokens [S, ...]: the inverse of `route` (same tokens=)."""
    r = _token_route(step, tokens)
    if x_held.shape[0] != r.num_held:
        raise ValueError(
            f"reverse_route(tokens={tokens!r}) expects {r.num_held} held rows on rank "
            f"{step.rank}, got {x_held.shape[0]}"
        )
    return _ReverseRoute.apply(x_held, r, step.group)


def route_text(text_source: Tensor, step: Step) -> Tensor:
    """Cross-attention: source text rows [S_text, ...] (the rank's sequences' text in batch
    order) -> [X, ...], the whole text of each nonempty held chunk's sequence, chunks in held
    order (step.chunk_cross_text_tokens rows each). Differentiable; the backward sums the
    gradients of a text delivered to several ranks."""
    if step.joint_attention:
        raise ValueError(
            "route_text is for cross-attention; a joint step routes text tokens "
            "with route(x, step, tokens='text')"
        )
    r = step.routes["cross_text"]
    if text_source.shape[0] != r.num_source:
        raise ValueError(
            f"route_text expects {r.num_source} source text rows on rank {step.rank}, got "
            f"{text_source.shape[0]}"
        )
    return _Route.apply(text_source, r, step.group)
