"""torchrun worker for test_train.py's MMDiT checks: one training step of the same batch under
several planners or hand-made plans, plus a single-process reference on rank 0 (the whole batch,
every sequence's text and visual tokens attending jointly); saves losses and full gradients.

usage: torchrun --nproc-per-node N mmdit_grad_worker.py OUT.pt BATCH PLANNER [PLANNER ...]
(PLANNER "hand-ring": train_grad_worker.RING_PLAN on 2 ranks; "hand-hybrid": HYBRID_PLAN on 4)
"""

from __future__ import annotations

import re
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from train_grad_worker import BATCHES, RING_PLAN

from zellige.data import StepDataset
from zellige.data.synthetic import SyntheticLatents, grid_positions
from zellige.model import JointTokens, MMDiT
from zellige.runtime import end_rank_process
from zellige.train.config import mmdit_tiny_cpu
from zellige.train.loop import setup_distributed
from zellige.train.mmdit_step import assemble_joint_step, joint_step_loss
from zellige.train.parallelize import parallelize
from zellige.train.timing import StepTimer

# 4 ranks on "mixed": hybrid(2,2) in two rank orders, a ring over two ranks that do not load the
# sequence, Ulysses over 3 ranks (4 heads split 2,1,1) and a sequence whose 1 visual token and 3
# text tokens sit on one rank
HYBRID_PLAN = {
    "planner": "hand",
    "num_ranks": 4,
    "placements": [
        {"id": 0, "strategy": "hybrid(2,2)", "ranks": [3, 0, 1, 2]},
        {"id": 1, "strategy": "local", "ranks": [2]},
        {"id": 2, "strategy": "ring", "ranks": [1, 3]},
        {"id": 3, "strategy": "ulysses", "ranks": [0, 2, 3]},
        {"id": 4, "strategy": "hybrid(2,2)", "ranks": [0, 1, 2, 3]},
    ],
}
HAND_PLANS = {"hand-ring": RING_PLAN, "hand-hybrid": HYBRID_PLAN}


def make_model(config) -> MMDiT:
    torch.manual_seed(config.seed)
    model = MMDiT(config.model.dit)
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
    modality, sequence_index, positions = [], [], []
    for index, s in enumerate(sequences):  # each sequence: its text, then its visual tokens
        modality += [1] * s["text_tokens"] + [0] * s["num_tokens"]
        sequence_index += [index] * (s["text_tokens"] + s["num_tokens"])
        positions += [
            torch.zeros(s["text_tokens"], 3, dtype=torch.int64),
            grid_positions(*s["grid"]),
        ]
    tokens = JointTokens(
        latents_VC=torch.cat([x.noisy_LC for x in samples]).double(),
        text_XE=torch.cat([x.text_XE for x in samples]).double(),
        modality_T=torch.tensor(modality),
        sequence_index_T=torch.tensor(sequence_index),
        positions_T3=torch.cat(positions),
        timesteps_S=torch.tensor([x.timestep for x in samples], dtype=torch.float32).double(),
    )
    velocity = torch.cat([x.velocity_LC for x in samples]).double()
    total = sum(s["num_tokens"] for s in sequences)
    loss = (model(tokens) - velocity).square().mean(1).sum() / total
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def main() -> None:
    out_path, batch_name, planners = sys.argv[1], sys.argv[2], sys.argv[3:]
    config = mmdit_tiny_cpu().with_fields(dtype="float64", activation_checkpointing=True)
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
            planner=planner if planner not in HAND_PLANS else "dp-cost",
            rank=rank,
            num_ranks=num_ranks,
            gpus_per_node=num_ranks,
            seed=config.seed,
            sequences=sequences,
            plan=HAND_PLANS.get(planner),
        )
        data = dataset[0]
        step_input = assemble_joint_step(data, config.model.dit.num_heads, device)
        loss = joint_step_loss(model, step_input, data.total_tokens, timer)
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
    end_rank_process()  # together, and without interpreter finalization (runtime/teardown.py)


if __name__ == "__main__":
    main()
