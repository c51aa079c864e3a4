"""Selective activation checkpointing: a checkpointed block keeps its attention outputs and its
recompute runs only the per-token layers.

The policy, in one place (training's blocks and the profiler's harness both call recomputed();
the cost model prices it, docs/training.md):
- a checkpointed block keeps its input and, of every attention it calls (self-, cross- or joint
  attention), what that attention's backward needs beyond q, k and v: the output o and the
  log-sum-exp (for the Ulysses exchange also the exchanged layout's o and lse, and the ring
  rows' merged lse);
- its recompute runs the per-token layers again (projections, norms, modulation, RoPE, FFN) and,
  where a distributed plan sends q, k, v to other ranks (Ulysses), that exchange, since the
  backward needs the received rows; attention kernels, ring steps and the exchange that returns
  the output are not run again.

How: torch.utils.checkpoint (non-reentrant) with a context_fn whose two contexts share one list.
In the block's forward each of the runtime's attention Functions (coalesced.py, attention.py)
puts the tensors above into the list (keep); in the recompute each takes its entry back in the
same order (replayed) instead of computing them. Not a TorchDispatchMode policy
(create_selective_checkpoint_contexts): a dispatch mode on the stack can turn the compiled
per-token regions back to eager in some torch versions, and at kernel granularity the ring's
per-step partial outputs would be kept and its P2P steps run again.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

_state = threading.local()  # .mode: None, ("keep", deque) or ("replay", deque)


class _Kept:
    """One attention's outputs, detached, with their versions (an in-place change after the
    forward would make the recompute silently wrong)."""

    __slots__ = ("tensors", "versions")

    def __init__(self, tensors: tuple[Tensor | None, ...]) -> None:
        self.tensors = tuple(None if t is None else t.detach() for t in tensors)
        self.versions = tuple(None if t is None else t._version for t in tensors)

    def take(self) -> tuple[Tensor | None, ...]:
        for t, version in zip(self.tensors, self.versions, strict=True):
            if t is not None and t._version != version:
                raise RuntimeError(
                    "an attention output kept by selective checkpointing was modified in place "
                    "after the forward; the recompute would use the modified values"
                )
        return self.tensors


class _Mode:
    """Sets the thread's mode for the duration of a with-block; re-enterable (checkpoint enters
    the recompute context again on a second backward)."""

    def __init__(self, mode: str, entries: deque) -> None:
        self.mode = (mode, entries)
        self.previous = []

    def __enter__(self) -> None:
        self.previous.append(getattr(_state, "mode", None))
        _state.mode = self.mode

    def __exit__(self, *exc) -> None:
        _state.mode = self.previous.pop()


def _contexts():
    """checkpoint's context_fn: one list per checkpointed call, filled in the forward (only when
    grad is on: a forward without backward has no recompute) and emptied by the recompute, so
    each output is released with the recompute's saved tensors."""
    entries: deque = deque()
    forward = _Mode("keep", entries) if torch.is_grad_enabled() else contextlib.nullcontext()
    return forward, _Mode("replay", entries)


def checkpointed(fn: Callable[..., Tensor], *args) -> Tensor:
    """fn(*args) under selective activation checkpointing (the module docstring's policy)."""
    return checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)


def recomputed(fn: Callable[..., Tensor], *args, full: bool) -> Tensor:
    """fn(*args) checkpointed as a training block is: selectively (checkpointed()), or with
    `full` a plain full recompute that keeps only the input and runs attention again (the layers
    the cost model's full_recompute_layers says do not fit with their attention outputs kept)."""
    if full:
        return checkpoint(fn, *args, use_reentrant=False)
    return checkpointed(fn, *args)


def keep(*tensors: Tensor | None) -> None:
    """Called by an attention Function's forward with the outputs its backward needs beyond
    q, k, v: kept when the call is part of a checkpointed block's forward, else nothing."""
    mode = getattr(_state, "mode", None)
    if mode is not None and mode[0] == "keep":
        mode[1].append(_Kept(tensors))


def replayed() -> tuple[Tensor | None, ...] | None:
    """In a checkpointed block's recompute: this attention's outputs kept in its forward (the
    Function must then skip its kernels); None everywhere else."""
    mode = getattr(_state, "mode", None)
    if mode is None or mode[0] != "replay":
        return None
    if not mode[1]:
        raise RuntimeError(
            "selective checkpointing: the recompute calls more attentions than the forward did "
            "(a second backward through a checkpointed block, retain_graph=True, is not "
            "supported: its kept attention outputs went to the first)"
        )
    return mode[1].popleft().take()
