"""torchrun worker for test_train_late_metrics.py: trains the tiny model in float64 with a step's
metrics read during the next step (metrics_one_step_late) or at its own end, and saves what each
run gave; rank 0 writes them.

usage: late_metrics_worker.py OUT OUT_DIR late|sync [NAN_STEP]
NAN_STEP (1-based): the last rank's loss of that step is NaN (its gradients too); the run must
stop there, every rank alike, with nothing saved and no later optimizer step."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from zellige.runtime import end_rank_process
from zellige.train import loop
from zellige.train.config import get_config

STEPS = 5
CHECKPOINT_EVERY = 2  # saves after steps 2 and 4 (synchronized) and 5 (the last)


def run(out_dir: str, late: bool, nan_step: int | None) -> dict:
    config = get_config("tiny-cpu").with_fields(
        steps=STEPS,
        loader_workers=0,
        dtype="float64",
        planner="static-cp:2",
        checkpoint_every=CHECKPOINT_EVERY,
        metrics_one_step_late=late,
    )
    built, calls = {}, {"losses": 0, "updates": 0}
    build_model, step_loss, clip_and_step = loop.build_model, loop.step_loss, loop.clip_and_step

    def keeping(*args):
        built["model"] = build_model(*args)
        return built["model"]

    def poisoned_loss(*args):
        calls["losses"] += 1
        loss = step_loss(*args)
        last_rank = dist.get_rank() == dist.get_world_size() - 1
        return loss * float("nan") if calls["losses"] == nan_step and last_rank else loss

    def counted_step(*args):
        calls["updates"] += 1
        return clip_and_step(*args)

    loop.build_model, loop.step_loss, loop.clip_and_step = keeping, poisoned_loss, counted_step
    failure = None
    history = []
    try:
        history = loop.train(config, out_dir=out_dir, progress=False)
    except loop.TrainingFailed as error:
        failure = str(error)
    finally:
        loop.build_model, loop.step_loss, loop.clip_and_step = build_model, step_loss, clip_and_step
    params = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in built["model"].named_parameters()
    }
    return {"history": history, "failure": failure, "updates": calls["updates"], "params": params}


def main() -> None:
    out, out_dir, mode, *nan = sys.argv[1:]
    result = run(out_dir, mode == "late", int(nan[0]) if nan else None)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {k: result[k] for k in ("failure", "updates")})
    result["ranks"] = gathered
    if dist.get_rank() == 0:
        torch.save(result, out)
    end_rank_process()


if __name__ == "__main__":
    main()
