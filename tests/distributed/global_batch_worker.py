"""torchrun worker for test_global_batch_train.py: one optimizer step over a global batch run as
K micro-batches with the trainer's own gradient accumulation (loop.StepsAhead, accumulation,
forward_backward_step, clip_and_step), for each K given, plus on rank 0 a single-process
reference step over the whole global batch; saves losses, gradients and updated weights.

K = 1 is the global-batch planner's own cut (its tiny batch fits one micro-batch); K > 1 cuts the
batch round robin into K micro-batches (the tiny models cannot fill the 1 GiB memory floor the
planner would need to cut them itself), each placed by the zellige planner for odd K (whole
sequences, here) and by static-cp over every rank for even K (every sequence sharded).

usage: torchrun --nproc-per-node N global_batch_worker.py OUT.pt MODEL K [K ...]
(MODEL: wan or mmdit)
"""

from __future__ import annotations

import re
import sys

import mmdit_grad_worker
import torch
import torch.distributed as dist
import train_grad_worker
from torch.distributed.device_mesh import init_device_mesh

import zellige
from zellige import _core
from zellige.balancer import Balancer
from zellige.data import StepDataset
from zellige.global_batch import global_plan_to_dict, parse_global_batch_size
from zellige.runtime import end_rank_process
from zellige.train.accumulation import accumulate
from zellige.train.config import mmdit_tiny_cpu, tiny_cpu
from zellige.train.loop import StepsAhead, forward_backward_step, setup_distributed
from zellige.train.optimizer_builder import clip_and_step, full_tensor, make_optimizer
from zellige.train.parallelize import parallelize
from zellige.train.timing import StepTimer

# mixed lengths and text lengths, odd lengths split unevenly, one-token and textless sequences
GLOBAL_BATCH = [
    *train_grad_worker.BATCHES["mixed"],
    {"id": 5, "num_tokens": 24, "grid": [2, 3, 4], "text_tokens": 6},
    {"id": 6, "num_tokens": 9, "grid": [1, 3, 3], "text_tokens": 2},
    {"id": 7, "num_tokens": 60, "grid": [3, 4, 5], "text_tokens": 8},
]
MODELS = {
    "wan": (tiny_cpu, train_grad_worker),
    "mmdit": (mmdit_tiny_cpu, mmdit_grad_worker),
}


def _names(model) -> dict[str, torch.nn.Parameter]:
    return {
        re.sub(r"^blocks\.(\d+)\.block\.", r"blocks.\1.", name): p
        for name, p in model.named_parameters()
    }


def _fixed_cut(dataset: StepDataset, count: int) -> dict:
    """The global batch cut round robin into `count` micro-batches, each placed by zellige (odd
    count) or static-cp over every rank (even count)."""
    batch = dataset.batch(0)
    ids = [sequence.id for sequence in batch.sequences]
    cut = [ids[k::count] for k in range(count)]
    planner = f"static-cp:{dataset.num_ranks}" if count % 2 == 0 else "zellige"
    plan = _core.place_micro_batches(planner, batch, cut, dataset.pipeline().cost_model)
    return global_plan_to_dict(plan)


def one_step(config, worker, sequences, count: int, device) -> dict:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    timer = StepTimer(device)
    model = worker.make_model(config)
    parallelize(
        model,
        init_device_mesh("cpu", (num_ranks,)),
        dtype="float64",
        activation_checkpointing=True,
        timer=timer,
    )
    optimizer = make_optimizer(config, model, device)
    options = dict(
        model=config.model.dit,
        recipe=config.data.recipe,
        planner="zellige",
        rank=rank,
        num_ranks=num_ranks,
        gpus_per_node=num_ranks,
        seed=config.seed,
        sequences=sequences,
        global_batch=parse_global_batch_size(str(len(sequences))),
    )
    dataset = StepDataset(**options)
    if count > 1:
        dataset = StepDataset(**options, global_plan=_fixed_cut(dataset, count))
    balancer = Balancer.from_pipeline(dataset.pipeline(), device=device, plan_ahead=False)
    ahead = StepsAhead(iter([dataset[0]]), config, device, balancer)
    data, first_input, _ = ahead.take(0)
    local_loss = accumulate(
        model,
        data.micro_batches,
        first_input,
        rank=rank,
        assemble=ahead.assemble,
        forward_backward=lambda micro_input, micro: forward_backward_step(
            config, model, micro_input, micro.total_tokens, timer
        ),
    )
    dist.all_reduce(local_loss)
    grads = {name: full_tensor(p.grad).clone() for name, p in _names(model).items()}
    clip_and_step(
        model, optimizer, config.optimizer.grad_clip_norm, config.optimizer.clip_in_optimizer
    )
    weights = {name: full_tensor(p.detach()).clone() for name, p in _names(model).items()}
    strategies = {
        placement["strategy"]
        for micro in dataset.plan(0).micro_batches
        for placement in zellige.plan_to_dict(micro.plan)["placements"]
    }
    return {
        "loss": local_loss.item(),
        "grads": grads,
        "weights": weights,
        "micro_batches": len(data.micro_batches),
        "strategies": sorted(strategies),
    }


def reference(config, worker, sequences) -> dict:
    """The whole global batch in one single-process step: no micro-batches, no FSDP."""
    loss, grads = worker.reference(config, sequences)
    model = worker.make_model(config)
    for name, p in model.named_parameters():
        p.grad = grads[name].clone()
    optimizer = make_optimizer(config, model, torch.device("cpu"))
    clip_and_step(model, optimizer, config.optimizer.grad_clip_norm)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {"loss": loss, "grads": grads, "weights": weights}


def main() -> None:
    out_path, model_name, counts = sys.argv[1], sys.argv[2], [int(k) for k in sys.argv[3:]]
    make_config, worker = MODELS[model_name]
    config = make_config().with_fields(dtype="float64", activation_checkpointing=True)
    device = setup_distributed(config)
    num_ranks = dist.get_world_size()
    sequences = [{**s, "source_rank": s["id"] % num_ranks} for s in GLOBAL_BATCH]
    results = {count: one_step(config, worker, sequences, count, device) for count in counts}
    if dist.get_rank() == 0:
        results["reference"] = reference(config, worker, sequences)
        torch.save(results, out_path)
    end_rank_process()  # rank 0 computed the reference alone: the ranks leave together


if __name__ == "__main__":
    main()
