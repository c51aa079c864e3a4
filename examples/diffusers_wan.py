"""A diffusers WanTransformer3DModel (text-to-video, cross-attention) trained under Zellige,
its code and weights unedited.

zellige.integrations.diffusers installs Zellige's attention in the model through diffusers'
attention processors and runs its modules on each rank's packed tokens. The model here is built
from a small config with random weights (nothing downloads); pass your own instead. Run on CPU:

    torchrun --nproc-per-node 3 examples/diffusers_wan.py --steps 2 --check

The default plan is made by hand so that every step has a sequence under ring and one under
Ulysses (the planner would keep such small sequences whole); --planner takes any planner name.
--check trains the same steps in one process with the unmodified model (its own forward and
attention, float64) and fails unless every step's loss and every parameter's gradient agree to
TOLERANCE (float32 rounding: Wan computes parts of every block in float32, see there) and the
first step's loss to 1e-12.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from diffusers import WanTransformer3DModel

import zellige
from zellige.integrations import diffusers as zd
from zellige.runtime import end_rank_process

PATCH = (1, 2, 2)
CONFIG = dict(  # a tiny Wan: 4 heads of 12 (RoPE: 4 t, 4 h, 4 w), 2 blocks
    patch_size=PATCH,
    num_attention_heads=4,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    rope_max_seq_len=32,
)
# relative. Wan rounds to float32 inside, whatever the model's dtype: its residual stream, norms
# (FP32LayerNorm) and modulation are cast with .float(). Two float64 runs that differ in the last
# bits (another summation order: packed tokens, ring and Ulysses merges) round some values to
# neighbouring float32 numbers, so loss and gradients agree to float32 rounding (unit roundoff
# 6e-8; measured up to 1.4e-7 over 2 steps), not to float64's. examples/diffusers_flux.py, whose
# model keeps float64 where it matters, checks to 1e-12.
TOLERANCE = 1e-6
FIRST_LOSS_TOLERANCE = 1e-12  # the first forward: same weights, no float32 rounding apart yet


def build_model(seed: int, checkpointing: bool = False) -> WanTransformer3DModel:
    torch.manual_seed(seed)  # every rank (and the reference) starts from the same weights
    model = WanTransformer3DModel(**CONFIG).double()
    if checkpointing:  # blocks recomputed in the backward (the packed forward follows the flag)
        model.enable_gradient_checkpointing()
    return model


# ---------------------------------------------------------------- the user's data
def draw_samples(rank: int, step: int, seed: int = 0) -> list[zellige.Sample]:
    """Rank `rank`'s samples at `step`: 1-3 images and clips of latents [C, F, H, W], their
    text and flow-matching timestep; rank 0 draws at least 2."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=gen))

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    samples = []
    for _ in range(randint(2 if rank == 0 else 1, 3)):
        frames, height, width = randint(1, 3), 2 * randint(1, 3), 2 * randint(1, 4)
        x0, noise = randn(4, frames, height, width), randn(4, frames, height, width)
        sigma = torch.rand((), generator=gen, dtype=torch.float64)
        text_tokens = randint(1, 6)
        samples.append(
            zellige.Sample(
                grid_thw=(frames // PATCH[0], height // PATCH[1], width // PATCH[2]),
                text_tokens=text_tokens,
                tokens={
                    "patches": zd.patchify((1 - sigma) * x0 + sigma * noise, PATCH),
                    "target": zd.patchify(noise - x0, PATCH, channels_last=True),
                },
                text={"text": randn(text_tokens, CONFIG["text_dim"])},
                values={"timestep": sigma * 1000},
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
        out_TP = packed(step, held.tokens["patches"], held.samples["timestep"], held.text["text"])
        loss = step.loss((out_TP - held.tokens["target"]).square().mean(dim=1))
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
    """The same training in one process with the unmodified model: one forward per sample."""
    model = build_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, gradients = [], []
    for step_index in range(steps):
        samples = [s for r in range(num_ranks) for s in draw_samples(r, step_index, seed)]
        total_tokens = sum(s.num_tokens for s in samples)
        loss = torch.zeros((), dtype=torch.float64)
        for s in samples:
            latents = _unpatch_input(s.tokens["patches"], s.grid_thw)
            out = model(latents[None], s.values["timestep"][None], s.text["text"][None]).sample
            target = zd.unpatchify(s.tokens["target"], s.grid_thw, PATCH)
            error = (out[0] - target).square().sum() / (s.tokens["target"].shape[1])
            loss = loss + error / total_tokens
        optimizer.zero_grad()
        loss.backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses, gradients


def _unpatch_input(patches, grid_thw):
    """Latents [C, F, H, W] back from patchify's rows (the inverse of zd.patchify)."""
    t, h, w = grid_thw
    x = patches.reshape(t, h, w, -1, *PATCH).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(x.shape[0], t * PATCH[0], h * PATCH[1], w * PATCH[2])


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
            first = abs(losses[0] - ref_losses[0]) / abs(ref_losses[0])
            print(f"first step's loss: relative difference {first:.2e}")
            if worst > TOLERANCE or first > FIRST_LOSS_TOLERANCE:
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
