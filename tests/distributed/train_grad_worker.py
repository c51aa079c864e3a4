"""torchrun worker for test_train.py: one training step of the same batch under several planners,
plus a single-process reference on rank 0; saves losses and full gradients with torch.save.

usage: torchrun --nproc-per-node N train_grad_worker.py OUT.pt BATCH PLANNER [PLANNER ...]
(PLANNER "hand-ring" is RING_PLAN, on 2 ranks and the "mixed" batch)
"""

from __future__ import annotations

import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from zellige.data import StepDataset
from zellige.data.synthetic import SyntheticLatents, grid_positions
from zellige.model import PackedTokens, VideoDiT
from zellige.runtime import end_rank_process
from zellige.train.config import tiny_cpu
from zellige.train.loop import setup_distributed, step_loss
from zellige.train.parallelize import parallelize
from zellige.train.step import assemble_step
from zellige.train.timing import StepTimer

BATCHES = {
    # mixed lengths and text lengths; odd lengths split unevenly; one-token and textless sequences
    "mixed": [
        {"id": 0, "num_tokens": 12, "grid": [1, 3, 4], "text_tokens": 8, "source_rank": 0},
        {"id": 1, "num_tokens": 1, "grid": [1, 1, 1], "text_tokens": 3, "source_rank": 0},
        {"id": 2, "num_tokens": 45, "grid": [5, 3, 3], "text_tokens": 0, "source_rank": 1},
        {"id": 3, "num_tokens": 16, "grid": [1, 4, 4], "text_tokens": 8, "source_rank": 1},
        {"id": 4, "num_tokens": 30, "grid": [2, 3, 5], "text_tokens": 5, "source_rank": 0},
    ],
    # one sequence: under whole-sequence placement every other rank holds no token at all
    "single": [{"id": 0, "num_tokens": 20, "grid": [1, 4, 5], "text_tokens": 4, "source_rank": 0}],
}


# A hand-made plan for "mixed" with ring placements, in both rank orders (no baseline uses ring)
RING_PLAN = {
    "planner": "hand",
    "num_ranks": 2,
    "placements": [
        {"id": 0, "strategy": "ulysses", "ranks": [1, 0]},
        {"id": 1, "strategy": "local", "ranks": [0]},
        {"id": 2, "strategy": "ring", "ranks": [1, 0]},
        {"id": 3, "strategy": "local", "ranks": [1]},
        {"id": 4, "strategy": "ring", "ranks": [0, 1]},
    ],
}


def make_model(config) -> VideoDiT:
    torch.manual_seed(config.seed)
    model = VideoDiT(config.model.dit)
    # the zero-initialised output layer would make every other gradient zero
    torch.nn.init.normal_(model.head.linear.weight, std=0.1)
    return model.to(torch.float64)


def reference(config, sequences) -> tuple[float, dict[str, torch.Tensor]]:
    """The whole batch on this process alone: no route, no exchange, no FSDP."""
    model = make_model(config)
    latents = SyntheticLatents(
        token_channels=config.model.dit.token_channels,
        text_dim=config.model.dit.text_dim,
        seed=config.seed,
    )
    samples = [
        latents.sample(
            step=0, sequence_id=s["id"], grid_thw=tuple(s["grid"]), text_tokens=s["text_tokens"]
        )
        for s in sequences
    ]
    tokens = PackedTokens(
        latents_TC=torch.cat([x.noisy_LC for x in samples]).double(),
        positions_T3=torch.cat([grid_positions(*s["grid"]) for s in sequences]),
        timesteps_S=torch.tensor([x.timestep for x in samples], dtype=torch.float32).double(),
        text_XE=torch.cat([x.text_XE for x in samples]).double(),
        tokens_per_sequence=[s["num_tokens"] for s in sequences],
        text_tokens_per_sequence=[s["text_tokens"] for s in sequences],
    )
    velocity = torch.cat([x.velocity_LC for x in samples]).double()
    total = sum(s["num_tokens"] for s in sequences)
    loss = (model(tokens) - velocity).square().mean(1).sum() / total
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def main() -> None:
    out_path, batch_name, planners = sys.argv[1], sys.argv[2], sys.argv[3:]
    config = tiny_cpu().with_fields(dtype="float64", activation_checkpointing=True)
    sequences = BATCHES[batch_name]
    device = setup_distributed(config)
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    results = {}
    for planner in planners:
        timer = StepTimer(device)
        model = make_model(config)
        mesh = init_device_mesh("cpu", (num_ranks,))
        parallelize(model, mesh, dtype="float64", activation_checkpointing=True, timer=timer)
        dataset = StepDataset(
            model=config.model.dit,
            recipe=config.data.recipe,
            planner=planner,
            rank=rank,
            num_ranks=num_ranks,
            gpus_per_node=num_ranks,
            seed=config.seed,
            sequences=sequences,
            plan=RING_PLAN if planner == "hand-ring" else None,
        )
        data = dataset[0]
        step_input = assemble_step(data, config.model.dit.num_heads, device)
        loss = step_loss(model, step_input, data.total_tokens, timer)
        (loss * num_ranks).backward()  # as the training loop: FSDP averages, we want the sum
        total = loss.detach().clone()
        dist.all_reduce(total)
        grads = {
            re.sub(r"^blocks\.(\d+)\.block\.", r"blocks.\1.", name): p.grad.full_tensor()
            for name, p in model.named_parameters()
        }
        held = [0] * num_ranks
        dist.all_gather_object(held, step_input.step.num_held_tokens)
        results[planner] = {"loss": total.item(), "grads": grads, "held_tokens": held}
    if rank == 0:
        loss, grads = reference(config, sequences)
        results["reference"] = {"loss": loss, "grads": grads}
        torch.save(results, out_path)
    # Rank 0 computes the reference alone, so the ranks leave together (a barrier); and the
    # FSDP2-held gloo group must not meet Python's finalization, where it aborts a rank now and
    # then ("terminate called without an active exception"): runtime/teardown.py
    end_rank_process()


if __name__ == "__main__":
    main()
