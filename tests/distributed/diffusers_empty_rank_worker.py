"""torchrun worker: both diffusers examples' training with every sequence on rank 0, so that
rank 1 runs the packed forward and backward on no tokens; rank 0 checks against one process."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import diffusers_flux  # noqa: E402
import diffusers_wan  # noqa: E402

import zellige  # noqa: E402
from zellige.runtime import end_rank_process  # noqa: E402


def all_on_rank_zero(batch: zellige.Batch, cost_model: zellige.CostModel) -> zellige.Plan:
    plan = zellige.Plan()
    plan.num_ranks, plan.planner = cost_model.cluster.num_ranks(), "all-on-rank-0"
    plan.placements = [
        zellige.make_placement(s.id, zellige.Strategy.local, [0], 0) for s in batch.sequences
    ]
    return plan


def main() -> None:
    dist.init_process_group("gloo")
    failures = []
    for example in (diffusers_wan, diffusers_flux):
        losses, gradients, _ = example.train(1, all_on_rank_zero)
        if dist.get_rank() == 0:
            reference = example.reference(1, dist.get_world_size())
            worst, what = example.worst_difference(losses, gradients, *reference)
            print(f"{example.__name__}: {worst:.2e} ({what})")
            if worst > example.TOLERANCE:
                failures.append(example.__name__)
    verdict = [failures]
    dist.broadcast_object_list(verdict, src=0)
    print("FAIL" if verdict[0] else "PASS", flush=True)
    end_rank_process(1 if verdict[0] else 0)


if __name__ == "__main__":
    main()
