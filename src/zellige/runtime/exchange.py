"""Routes: source tokens to held tokens and back, one all_to_all each through the step's
transport (runtime/transport.py). Every rank of the group calls them with sizes from the plan
compiler, so ranks with nothing to send still take part (zero splits) and none waits alone.
"""

from __future__ import annotations

import torch

from zellige.runtime.layout import TOKENS, DeviceRoute, Step

Tensor = torch.Tensor


def _forward(x: Tensor, route: DeviceRoute, step: Step) -> Tensor:
    send = x.index_select(0, route.send_index)
    recv, _ = step.transport.all_to_all_rows(send, route.send_splits, route.recv_splits, step.group)
    return recv.index_select(0, route.recv_index)


def _backward(x: Tensor, route: DeviceRoute, step: Step) -> Tensor:
    """The transpose of _forward: rows go back; a source row sent to several ranks sums."""
    send = x.index_select(0, route.recv_inverse)
    recv, _ = step.transport.all_to_all_rows(send, route.recv_splits, route.send_splits, step.group)
    if route.sends_each_row_once:
        return torch.empty_like(recv).index_copy_(0, route.send_index, recv)
    out = recv.new_zeros((route.num_source, *recv.shape[1:]))
    return out.index_add_(0, route.send_index, recv)


class _Route(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, step):
        ctx.route, ctx.step = route, step
        return _forward(x, route, step)

    @staticmethod
    def backward(ctx, grad):
        return _backward(grad.contiguous(), ctx.route, ctx.step), None, None


class _ReverseRoute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, route, step):
        ctx.route, ctx.step = route, step
        return _backward(x, route, step)

    @staticmethod
    def backward(ctx, grad):
        return _forward(grad.contiguous(), ctx.route, ctx.step), None, None


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
    return _Route.apply(x_source, r, step)


def reverse_route(x_held: Tensor, step: Step, tokens: str = "all") -> Tensor:
    """Held tokens [T, ...] -> source tokens [S, ...]: the inverse of `route` (same tokens=)."""
    r = _token_route(step, tokens)
    if x_held.shape[0] != r.num_held:
        raise ValueError(
            f"reverse_route(tokens={tokens!r}) expects {r.num_held} held rows on rank "
            f"{step.rank}, got {x_held.shape[0]}"
        )
    return _ReverseRoute.apply(x_held, r, step)


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
    return _Route.apply(text_source, r, step)
