"""Python's garbage collector kept out of the steps' time (training's loop and the profiler's
validated ranks run with the same collector)."""

from __future__ import annotations

import gc

import torch


def compile_events() -> int:
    """A count that torch.compile increases whenever it captures, compiles or loads a graph
    (forward or backward); unchanged over steps that run compiled code only."""
    counters = torch._dynamo.utils.counters
    return sum(sum(counters[kind].values()) for kind in ("frames", "aot_autograd", "inductor"))


class QuietCollector:
    """Keeps Python's full garbage collections out of the steps' time. torch.compile leaves
    hundreds of thousands of long-lived objects (graphs, guards, generated code, sympy caches);
    Python's full collection, which runs whenever enough new objects have survived since the
    last one, traverses all of them: a pause of 0.2 s on a CPU for 0.4 M objects, and it falls
    in whichever step trips it (on an H200, wan-1.3b: one image step 0.3-0.5 s longer, the
    host idle while the device waits). So the objects that exist when training starts and
    after each step that compiled are collected once, between steps, and then frozen
    (gc.freeze: never traversed again; freed as usual when their last reference goes). A full
    collection in a later step traverses only what came after. close() unfreezes them (a
    finished run's cycles can be collected). enabled=False: does nothing (Python collects as it
    would)."""

    def __init__(self, enabled: bool = True) -> None:
        self._enabled = enabled
        self._events = compile_events()
        if enabled:
            self._settle()

    def after_step(self) -> None:
        """Settles a step's compiled graphs; nothing after a step that compiled nothing."""
        events = compile_events()
        if self._enabled and events != self._events:
            self._events = events
            self._settle()

    @staticmethod
    def _settle() -> None:
        gc.collect()  # the garbage first: a frozen cycle would never be freed
        gc.freeze()

    def close(self) -> None:
        if self._enabled:
            gc.unfreeze()
