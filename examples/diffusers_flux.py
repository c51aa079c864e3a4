"""A diffusers FluxTransformer2DModel (joint attention over text and image tokens) trained under
Zellige, its code and weights unedited.

zellige.integrations.diffusers installs Zellige's attention in the model through diffusers'
attention processors and runs its modules on each rank's packed tokens. The model here is built
from a small config with random weights (nothing downloads); pass your own instead. Run on CPU:

    torchrun --nproc-per-node 2 examples/diffusers_flux.py --steps 2 --check

The default plan is made by hand so that every step has a sequence under ring and one under
Ulysses (the planner would keep such small sequences whole); --planner takes any planner name.
--check trains the same steps in one process with the unmodified model (its own forward and
attention, float64) and fails unless every step's loss and every parameter's gradient agree to
1e-12 relative.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from diffusers import FluxTransformer2DModel

import zellige
from zellige.integrations import diffusers as zd
from zellige.runtime import end_rank_process

CONFIG = dict(  # a tiny Flux: 3 heads of 16 (RoPE axes 4 + 6 + 6), one block of each kind
    in_channels=8,
    num_layers=1,
    num_single_layers=1,
    attention_head_dim=16,
    num_attention_heads=3,
    joint_attention_dim=16,
    pooled_projection_dim=8,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)
F64 = torch.float64
TOLERANCE = 1e-12  # relative; float64 runs agree to ~1e-15


def build_model(seed: int, checkpointing: bool = False) -> FluxTransformer2DModel:
    torch.manual_seed(seed)  # every rank (and the reference) starts from the same weights
    model = FluxTransformer2DModel(**CONFIG).double()
    if checkpointing:  # blocks recomputed in the backward (the packed forward follows the flag)
        model.enable_gradient_checkpointing()
    return model


# ---------------------------------------------------------------- the user's data
def draw_samples(rank: int, step: int, seed: int = 0) -> list[zellige.Sample]:
    """Rank `rank`'s samples at `step`: 1-3 images of latent rows [h*w, in_channels] (Flux's
    packed latents), their text, pooled text, guidance and flow-matching timestep; rank 0 draws
    at least 2."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=gen))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=F64)

    samples = []
    for _ in range(randint(2 if rank == 0 else 1, 3)):
        height, width, text_tokens = randint(1, 4), randint(1, 5), randint(1, 6)
        x0, noise = randn(height * width, 8), randn(height * width, 8)
        sigma = torch.rand((), generator=gen, dtype=F64)
        samples.append(
            zellige.Sample(
                grid_thw=(1, height, width),
                text_tokens=text_tokens,
                tokens={"latents": (1 - sigma) * x0 + sigma * noise, "target": noise - x0},
                text={"text": randn(text_tokens, CONFIG["joint_attention_dim"])},
                values={
                    "timestep": sigma,
                    "pooled": randn(CONFIG["pooled_projection_dim"]),
                    "guidance": torch.tensor(3.5, dtype=F64),
                },
            )
        )
    return samples


def ring_and_ulysses(batch: zellige.Batch, cost_model: zellige.CostModel) -> zellige.Plan:
    """A hand-made plan: the largest sequence in a ring over every rank, the next one under
    Ulysses over every rank, the rest whole on ranks in turn."""
    world = cost_model.cluster.num_ranks()
    order = sorted(batch.sequences, key=lambda s: -(s.num_tokens + s.text_tokens))
    ranks = list(range(world))
    placements = []
    for position, sequence in enumerate(order):
        if position == 0:
            placement = zellige.make_placement(sequence.id, zellige.Strategy.ring, ranks, 0)
        elif position == 1:
            placement = zellige.make_placement(sequence.id, zellige.Strategy.ulysses, ranks, 0)
        else:
            placement = zellige.make_placement(
                sequence.id, zellige.Strategy.local, [position % world], 0
            )
        placements.append(placement)
    plan = zellige.Plan()
    plan.num_ranks, plan.planner, plan.placements = world, "ring-and-ulysses", placements
    return plan


# ---------------------------------------------------------------- Zellige in the training loop
def train(
    steps: int, planner, seed: int = 0, checkpointing: bool = False
) -> tuple[list[float], list[dict], set[str]]:
    """Trains `steps` steps on this process group: (losses, gradients per step, strategies)."""
    model = build_model(seed, checkpointing)
    packed = zd.pack(model)  # Zellige's attention processors; the model's own code and weights
    optimizer = torch.optim.SGD(packed.parameters(), lr=0.5)
    balancer = zellige.Balancer(zd.model_spec(model, text_tokens=6), planner=planner, seed=seed)
    rank, losses, gradients, strategies = dist.get_rank(), [], [], set()
    for step_index in range(steps):
        step = balancer.step(draw_samples(rank, step_index, seed))
        strategies |= {str(p.strategy).split(".")[-1] for p in step.plan.placements}
        held = step.inputs()
        out_VC = packed(
            step,
            held.tokens["latents"],
            held.samples["timestep"],
            held.text["text"],
            held.samples["pooled"],
            held.samples["guidance"],
        )
        loss = step.loss((out_VC - held.tokens["target"]).square().mean(dim=1))
        optimizer.zero_grad()
        loss.backward()
        for parameter in packed.parameters():  # data parallelism: sum the ranks' shares
            dist.all_reduce(parameter.grad)
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        losses.append(step.reduce(loss))
    balancer.close()
    return losses, gradients, strategies


# ---------------------------------------------------------------- the single-process reference
def reference(steps: int, num_ranks: int, seed: int = 0) -> tuple[list[float], list[dict]]:
    """The same training in one process with the unmodified model: one forward per sample, its
    text before its image tokens, ids as the Flux pipelines build them."""
    model = build_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, gradients = [], []
    for step_index in range(steps):
        samples = [s for r in range(num_ranks) for s in draw_samples(r, step_index, seed)]
        total_tokens = sum(s.num_tokens for s in samples)
        loss = torch.zeros((), dtype=F64)
        for s in samples:
            _, height, width = s.grid_thw
            rows, columns = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
            image_ids = torch.stack([torch.zeros_like(rows), rows, columns], -1).reshape(-1, 3)
            out = model(
                hidden_states=s.tokens["latents"][None],
                encoder_hidden_states=s.text["text"][None],
                pooled_projections=s.values["pooled"][None],
                timestep=s.values["timestep"][None],
                img_ids=image_ids.to(F64),
                txt_ids=torch.zeros(s.text_tokens, 3, dtype=F64),
                guidance=s.values["guidance"][None],
            ).sample[0]
            error = (out - s.tokens["target"]).square().mean(dim=1)
            loss = loss + error.sum() / total_tokens
        optimizer.zero_grad()
        loss.backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, gradients


def worst_difference(losses, gradients, ref_losses, ref_gradients) -> tuple[float, str]:
    """The largest relative difference of a step's loss or a parameter's gradient (norm), and
    what it is."""
    worst = max(
        (abs(a - b) / abs(b), f"step {i} loss")
        for i, (a, b) in enumerate(zip(losses, ref_losses, strict=True))
    )
    for i, (got, expected) in enumerate(zip(gradients, ref_gradients, strict=True)):
        scale = max(float(g.norm()) for g in expected.values())
        for name, g in expected.items():
            error = float((got[name] - g).norm()) / max(float(g.norm()), 1e-3 * scale)
            worst = max(worst, (error, f"step {i} gradient of {name}"))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--planner", default=None, help="a planner name (default: by hand)")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute blocks in the backward"
    )
    args = parser.parse_args()
    dist.init_process_group("gloo")
    losses, gradients, strategies = train(
        args.steps, args.planner or ring_and_ulysses, checkpointing=args.gradient_checkpointing
    )
    failure = None
    if dist.get_rank() == 0:
        print(f"losses {' '.join(f'{x:.12f}' for x in losses)} ({', '.join(sorted(strategies))})")
        if args.check:
            ref_losses, ref_gradients = reference(args.steps, dist.get_world_size())
            worst, what = worst_difference(losses, gradients, ref_losses, ref_gradients)
            print(f"single process: {' '.join(f'{x:.12f}' for x in ref_losses)}")
            print(f"largest relative difference {worst:.2e} ({what})")
            if worst > TOLERANCE:
                failure = "FAIL: the run differs from the single-process run"
            elif args.planner is None and not {"ring", "ulysses"} <= strategies:
                failure = f"FAIL: no sequence under ring and one under Ulysses ({strategies})"
            print(failure or "PASS", flush=True)
    verdict = [failure]
    dist.broadcast_object_list(verdict, src=0)  # every rank exits with rank 0's verdict
    end_rank_process(1 if verdict[0] else 0)  # the ranks leave together (zellige.runtime.teardown)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
