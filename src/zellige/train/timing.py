"""Where a rank's step time goes, measured inside autograd (forward, recompute and backward).

A region is opened and closed by identity autograd functions around a computation: their forward
marks the forward pass, their backward marks the backward pass (which runs the other way round).
On CUDA the marks are events read once at the end of the step, so timing adds no synchronisation.
Regions are measured inside module bodies, so FSDP's weight all-gathers and gradient
reduce-scatters (which run in hooks around the bodies) do not count as a rank's own work.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import Tensor, nn


class StepTimer:
    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._intervals: dict[str, list[tuple[object, object]]] = defaultdict(list)
        self._open: dict[tuple[str, int], object] = {}
        self._ranges: dict[tuple[str, int], torch.profiler.record_function] = {}
        self._next_id = 0

    def _stamp(self) -> object:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _begin(self, key: tuple[str, int]) -> None:
        self._open[key] = self._stamp()
        if torch.autograd._profiler_enabled():
            # the region as a named range for torch.profiler (bench/train_throughput.py --trace)
            self._ranges[key] = torch.profiler.record_function(f"zellige.{key[0]}").__enter__()

    def _end(self, key: tuple[str, int]) -> None:
        self._intervals[key[0]].append((self._open.pop(key), self._stamp()))
        named = self._ranges.pop(key, None)
        if named is not None:
            named.__exit__(None, None, None)

    def wrap(
        self, name: str, fn: Callable[..., Tensor], fresh_output: bool = True
    ) -> Callable[..., Tensor]:
        """fn(*tensors, *rest) -> tensor, with forward and backward time counted under `name`.

        The tensor arguments that require grad carry the backward mark; the others pass as they
        are (a mark would make them require grad: RoPE tables would get gradients computed and
        their products' operands saved). fresh_output: the output is a copy (a module's output,
        which FSDP hooks); False: a view, for a function whose output its caller saves anyway
        (an attention output would otherwise be held twice until the backward)."""

        def is_marked(a) -> bool:
            return isinstance(a, Tensor) and a.requires_grad

        def timed(*args):
            key = (name, self._next_id)
            self._next_id += 1
            inputs = [a for a in args if is_marked(a)]
            marked = iter(_Mark.apply(self, key, False, False, *inputs))
            args = [next(marked) if is_marked(a) else a for a in args]
            self._begin(key)
            out = fn(*args)
            self._end(key)
            return _Mark.apply(self, key, True, fresh_output, out)[0]

        return timed

    def seconds(self) -> dict[str, float]:
        """Total seconds per region since the last reset; waits for the device once."""
        if self._cuda:
            torch.cuda.synchronize()
        return region_seconds(self._intervals)

    def take(self) -> dict[str, list[tuple[object, object]]]:
        """The intervals since the last reset (for region_seconds once the device has passed
        them); the timer starts empty, so the next step's marks do not mix with them."""
        intervals, self._intervals = self._intervals, defaultdict(list)
        return intervals

    def reset(self) -> None:
        self._intervals.clear()
        self._open.clear()
        self._ranges.clear()


def region_seconds(intervals: dict[str, list[tuple[object, object]]]) -> dict[str, float]:
    """Total seconds per region of StepTimer.take()'s intervals; CUDA events must have been
    passed by the device (the caller waited for a later event)."""
    totals = {}
    for name, marks in intervals.items():
        if marks and isinstance(marks[0][0], torch.cuda.Event):
            totals[name] = sum(a.elapsed_time(b) for a, b in marks) / 1e3
        else:
            totals[name] = sum(b - a for a, b in marks)
    return totals


class _Mark(torch.autograd.Function):
    """Identity whose backward opens (at a region's output) or closes (at its inputs) the
    backward interval of the region."""

    @staticmethod
    def forward(
        ctx, timer: StepTimer, key: tuple[str, int], is_output: bool, fresh: bool, *tensors: Tensor
    ):
        ctx.timer, ctx.key, ctx.is_output = timer, key, is_output
        # a module's output is a fresh tensor, not a view: FSDP hooks module outputs, and views
        # of them are fragile under in-place use
        return tuple(t.clone() if fresh else t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        key = (ctx.key[0] + ".backward", ctx.key[1])
        if ctx.is_output:
            ctx.timer._begin(key)
        elif key in ctx.timer._open:
            ctx.timer._end(key)
        return (None, None, None, None, *grads)


class TimedModule(nn.Module):
    """Counts a module's body (forward and backward) under `name`; applied from the outside."""

    def __init__(self, module: nn.Module, timer: StepTimer, name: str) -> None:
        super().__init__()
        self.module = module
        self._timed = timer.wrap(name, module)

    def forward(self, *args):
        return self._timed(*args)
