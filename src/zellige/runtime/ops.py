"""The runtime's entry points as PyTorch custom ops, so torch.compile traces through Zellige.

`torch.ops.zellige.{attention, cross_attention, route, reverse_route, route_text}` wrap the
runtime's functions (attention.py, exchange.py) with fake implementations (output shapes for
tracing; the attention outputs have q's shape, the routes a data-dependent row count) and a
registered backward op each. A compiled model that calls `StepOps`' callables therefore has no
graph break inside Zellige.

A Step is not a tensor, so ops name it by a handle: a 0-d int64 tensor whose value keys the
registry below (a tensor, not an int, so that a new step each iteration does not recompile).
The forward op runs the runtime's own differentiable function and keeps its autograd graph in
the step's entry until the backward op consumes it; the entry (and anything unconsumed, e.g. a
forward recomputed under activation checkpointing) goes when the StepOps object is released.

Legend: S source rows, T held rows, N heads, H head dim.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

from zellige.runtime.attention import cross_attention, distributed_attention
from zellige.runtime.exchange import reverse_route, route, route_text
from zellige.runtime.layout import Step

# handle -> (step, saved graphs by ticket: (inputs needing grad, output))
_REGISTRY: dict[int, tuple[Step, dict[int, tuple[tuple[Tensor, ...], Tensor]]]] = {}
_KEYS = itertools.count(1)
_TICKETS = itertools.count(1)


def _entry(handle: Tensor):
    key = int(handle)
    if key not in _REGISTRY:
        raise RuntimeError(
            f"zellige op: step {key} was released (keep the BalancedStep / StepOps alive until "
            "its backward has run)"
        )
    return _REGISTRY[key]


def _with_autograd():
    """A custom op's kernel runs below autograd (its keys excluded), but the forward must record
    the runtime's own graph for the backward op: put the autograd keys back for its duration."""
    keys = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    # AutogradCPU stands for the autograd functionality bit of every backend (CUDA too)
    for key in (keys.AutogradOther, keys.AutogradCPU, keys.AutogradNestedTensor):
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


def _run(fn: Callable[..., Tensor], tensors: list[Tensor], handle: Tensor, save: bool, **kw):
    """fn(*tensors, step) -> (output, ticket); with `save`, the graph waits for the backward op."""
    step, saved = _entry(handle)
    if not any(t.is_floating_point() for t in tensors):
        save = False  # integer rows (positions, labels) have no gradient
    if not save:
        with torch.no_grad():
            return fn(*tensors, step, **kw), torch.zeros((), dtype=torch.int64)
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
    with torch.enable_grad(), _with_autograd():
        output = fn(*inputs, step, **kw)
    if not output.requires_grad:  # e.g. no keys on this rank: the gradient is zero
        return output.detach(), torch.zeros((), dtype=torch.int64)
    ticket = next(_TICKETS)
    saved[ticket] = (tuple(t for t in inputs if t.requires_grad), output)
    return output.detach(), torch.tensor(ticket, dtype=torch.int64)


def _backward_of(handle: Tensor, ticket: Tensor, grad: Tensor, *inputs: Tensor) -> tuple:
    """Gradients of the forward's inputs (`inputs`: the op's own, for ticket 0: no graph)."""
    _, saved = _entry(handle)
    if int(ticket) == 0:
        return tuple(torch.zeros_like(t) for t in inputs)
    leaves, output = saved.pop(int(ticket))
    return torch.autograd.grad(output, leaves, grad, allow_unused=True, materialize_grads=True)


def _dynamic_rows(x: Tensor) -> Tensor:
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, *x.shape[1:]))


# ---- attention: (q, k, v) -> o with q's shape


def _register_attention(name: str, fn: Callable[..., Tensor]) -> None:
    @torch.library.custom_op(f"zellige::{name}", mutates_args=())
    def op(q: Tensor, k: Tensor, v: Tensor, handle: Tensor, save: bool) -> tuple[Tensor, Tensor]:
        return _run(fn, [q, k, v], handle, save)

    @op.register_fake
    def _(q, k, v, handle, save):
        return torch.empty_like(q), handle.new_empty(())

    @torch.library.custom_op(f"zellige::{name}_backward", mutates_args=())
    def backward_op(
        grad: Tensor, handle: Tensor, ticket: Tensor, q: Tensor, k: Tensor, v: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        return _backward_of(handle, ticket, grad, q, k, v)

    @backward_op.register_fake
    def _(grad, handle, ticket, q, k, v):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, handle, _ = inputs
        ctx.save_for_backward(handle, output[1], q, k, v)

    def backward(ctx, grad, _ticket_grad):
        handle, ticket, q, k, v = ctx.saved_tensors
        dq, dk, dv = backward_op(grad.contiguous(), handle, ticket, q, k, v)
        return dq, dk, dv, None, None

    op.register_autograd(backward, setup_context=setup_context)


_register_attention("attention", distributed_attention)
_register_attention("cross_attention", cross_attention)


# ---- routes: rows [A, ...] -> rows [B, ...], B data-dependent


def _register_route(name: str, fn: Callable[..., Tensor]) -> None:
    @torch.library.custom_op(f"zellige::{name}", mutates_args=())
    def op(x: Tensor, handle: Tensor, tokens: str, save: bool) -> tuple[Tensor, Tensor]:
        if fn is route_text:
            return _run(fn, [x], handle, save)
        return _run(fn, [x], handle, save, tokens=tokens)

    @op.register_fake
    def _(x, handle, tokens, save):
        return _dynamic_rows(x), handle.new_empty(())

    @torch.library.custom_op(f"zellige::{name}_backward", mutates_args=())
    def backward_op(grad: Tensor, handle: Tensor, ticket: Tensor, x: Tensor) -> Tensor:
        return _backward_of(handle, ticket, grad, x)[0]

    @backward_op.register_fake
    def _(grad, handle, ticket, x):
        return torch.empty_like(x)

    def setup_context(ctx, inputs, output):
        x, handle, _, _ = inputs
        ctx.save_for_backward(handle, output[1], x)

    def backward(ctx, grad, _ticket_grad):
        handle, ticket, x = ctx.saved_tensors
        return backward_op(grad.contiguous(), handle, ticket, x), None, None, None

    op.register_autograd(backward, setup_context=setup_context)


_register_route("route", route)
_register_route("reverse_route", reverse_route)
_register_route("route_text", route_text)


def _needs_grad(*tensors: Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


class _Attention:
    """(q_TNH, k_TNH, v_TNH) -> o_TNH through torch.ops.zellige.attention."""

    def __init__(self, handle: Tensor) -> None:
        self.handle = handle

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.ops.zellige.attention(q, k, v, self.handle, _needs_grad(q, k, v))[0]


class _CrossAttention(_Attention):
    """(q_TNH, k_XNH, v_XNH) -> o_TNH through torch.ops.zellige.cross_attention."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return torch.ops.zellige.cross_attention(q, k, v, self.handle, _needs_grad(q, k, v))[0]


class StepOps:
    """One step's entry points as custom ops; keep it alive until the step's backward has run.

    attention / cross_attention: the model's callables (q_TNH, k, v) -> o_TNH.
    route(x, tokens) / reverse_route(x, tokens) / route_text(x): as zellige.runtime's."""

    def __init__(self, step: Step) -> None:
        key = next(_KEYS)
        _REGISTRY[key] = (step, {})
        self.step = step
        self.handle = torch.tensor(key, dtype=torch.int64)
        weakref.finalize(self, _REGISTRY.pop, key, None)
        self.attention = _Attention(self.handle)
        self.cross_attention = _CrossAttention(self.handle)

    def route(self, x: Tensor, tokens: str = "all") -> Tensor:
        return torch.ops.zellige.route(x, self.handle, tokens, _needs_grad(x))[0]

    def reverse_route(self, x: Tensor, tokens: str = "all") -> Tensor:
        return torch.ops.zellige.reverse_route(x, self.handle, tokens, _needs_grad(x))[0]

    def route_text(self, x: Tensor) -> Tensor:
        return torch.ops.zellige.route_text(x, self.handle, "", _needs_grad(x))[0]
