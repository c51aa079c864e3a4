"""Trains the tiny model with the compiled per-token regions (aot_eager: torch.compile's capture
and autograd graphs, without generating code) over steps that alternate packs of many images
and of one clip, and saves per step what a Python full garbage collection would traverse in it
(gc.get_objects() at the loss, inside the step) and the compile events in it
(test_train_one_rank.py checks them); trained twice: with the loop's freezing (freeze_gc, the
default; compiles), then without it (the same graphs, compiled already).

usage: gc_worker.py OUT (a world of one)"""

from __future__ import annotations

import gc
import json
import sys

from zellige.model import fused
from zellige.runtime import end_rank_process
from zellige.runtime.collector import compile_events
from zellige.train import loop
from zellige.train.config import get_config

STEPS = 5


def run(freeze_gc: bool) -> dict:
    config = get_config("tiny-cpu").with_fields(
        steps=STEPS,
        loader_workers=0,
        compile_elementwise=True,
        freeze_gc=freeze_gc,
    )
    steps = []
    use_compiled, step_loss, run_step = fused.use_compiled, loop.step_loss, loop.train_step

    def counted_loss(*args):
        steps[-1]["traversed"] = len(gc.get_objects())  # the generations a full GC walks
        return step_loss(*args)

    def counted_step(*args):
        steps.append({"compile_events": -compile_events()})
        records, pending = run_step(*args)
        steps[-1]["compile_events"] += compile_events()
        for record in records:  # a late step's record comes from the next step's call
            steps[record["step"] - 1]["sequences"] = record["sequences"]
        return records, pending

    fused.use_compiled = lambda enabled, backend="aot_eager", outside=None: use_compiled(
        enabled, "aot_eager", outside
    )
    loop.step_loss, loop.train_step = counted_loss, counted_step
    before = len(gc.get_objects())  # the process's objects: torch, zellige, ...
    try:
        loop.train(config, progress=False)
    finally:
        fused.use_compiled, loop.step_loss, loop.train_step = use_compiled, step_loss, run_step
    return {"before": before, "steps": steps, "frozen_after": gc.get_freeze_count()}


def main() -> None:
    report = {"frozen": run(freeze_gc=True), "auto": run(freeze_gc=False)}
    with open(sys.argv[1], "w") as file:
        json.dump(report, file)
    end_rank_process()


if __name__ == "__main__":
    main()
