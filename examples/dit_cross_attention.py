"""Your own small DiT (self-attention + cross-attention to text) trained with zellige.Balancer.

The model below is plain PyTorch and knows nothing of Zellige: it takes its attention as
callables. The Zellige part is `train()` (about 50 lines). Run on CPU with 2-4 processes:

    torchrun --nproc-per-node 2 examples/dit_cross_attention.py --steps 3 --check

--check trains the same steps again in one process without Zellige (float64) and fails unless
every step's loss agrees; --fsdp shards the model with FSDP2. --planner takes any planner name
(zellige, knapformer:g1n2, static-cp:2, dp-cost, ...). Legend: T tokens, C chunks (a sample's
part on this rank), X text rows, N heads, H head dim, D width.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

import zellige
from zellige.runtime import end_rank_process

# ---------------------------------------------------------------- the user's model (no Zellige)
WIDTH, HEADS, LAYERS, FFN, CHANNELS, TEXT_DIM = 32, 4, 2, 64, 8, 16


def sinusoid(x: Tensor, dim: int) -> Tensor:
    freqs = torch.exp(-math.log(100.0) * torch.arange(dim // 2, dtype=x.dtype) / (dim // 2))
    angles = x[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.modulation = nn.Linear(WIDTH, 6 * WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.cross_q, self.cross_kv = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2 * WIDTH)
        self.cross_out = nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, FFN), nn.GELU(), nn.Linear(FFN, WIDTH))

    def forward(self, x_TD, text_XD, emb_CD, chunk_T, attention, cross_attention):
        shift, scale, gate, shift2, scale2, gate2 = self.modulation(emb_CD)[chunk_T].chunk(6, -1)
        h = F.layer_norm(x_TD, (WIDTH,)) * (1 + scale) + shift
        q, k, v = self.qkv(h).unflatten(1, (3, HEADS, -1)).unbind(1)
        x_TD = x_TD + gate * self.out(attention(q, k, v).flatten(1))
        q = self.cross_q(F.layer_norm(x_TD, (WIDTH,))).unflatten(1, (HEADS, -1))
        k, v = self.cross_kv(text_XD).unflatten(1, (2, HEADS, -1)).unbind(1)
        x_TD = x_TD + self.cross_out(cross_attention(q, k, v).flatten(1))
        h = F.layer_norm(x_TD, (WIDTH,)) * (1 + scale2) + shift2
        return x_TD + gate2 * self.mlp(h)


class TinyDiT(nn.Module):
    """Predicts each token's velocity from its noisy latent, (t, h, w) position, the sample's flow
    time (per chunk) and its text (cross-attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(CHANNELS, WIDTH)
        self.position = nn.Linear(3 * 8, WIDTH)
        self.time = nn.Sequential(nn.Linear(16, WIDTH), nn.SiLU(), nn.Linear(WIDTH, WIDTH))
        self.text = nn.Linear(TEXT_DIM, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, CHANNELS)

    def forward(self, x_TC, pos_T3, time_C, chunk_T, text_XE, attention, cross_attention):
        x_TD = self.patch(x_TC) + self.position(sinusoid(pos_T3.to(x_TC.dtype), 8).flatten(1))
        emb_CD = self.time(sinusoid(time_C, 16))
        text_XD = self.text(text_XE)
        for block in self.blocks:
            x_TD = block(x_TD, text_XD, emb_CD, chunk_T, attention, cross_attention)
        return self.head(x_TD)


# ---------------------------------------------------------------- the user's data (no Zellige)
def draw_samples(rank: int, step: int, seed: int = 0) -> list[zellige.Sample]:
    """What rank `rank`'s loader draws at `step`: 0-3 images and short clips of random sizes."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (), generator=gen))

    samples = []
    for _ in range(randint(0 if rank % 2 else 1, 3)):  # some ranks draw nothing
        grid = (randint(1, 3), randint(1, 4), randint(1, 5))
        num_tokens, text_tokens = grid[0] * grid[1] * grid[2], randint(1, 6)
        x0, noise = (torch.randn(num_tokens, CHANNELS, generator=gen) for _ in range(2))
        time = torch.rand((), generator=gen, dtype=torch.float64)
        samples.append(
            zellige.Sample(
                grid_thw=grid,
                text_tokens=text_tokens,
                tokens={"noisy": (1 - time) * x0 + time * noise, "target": noise - x0},
                text={"text": torch.randn(text_tokens, TEXT_DIM, generator=gen)},
                values={"time": time},
            )
        )
    return samples


# ---------------------------------------------------------------- Zellige in the training loop
def train(steps: int, planner="zellige", seed: int = 0, fsdp: bool = False) -> list[float]:
    """Trains `steps` steps on this process group; returns the step losses (every rank)."""
    torch.manual_seed(seed)  # every rank starts from the same weights
    model = TinyDiT().double()
    spec = zellige.model_spec_from_module(
        model, text_tokens=6, joint_attention=False, num_heads=HEADS
    )
    if fsdp:  # FSDP2 shards the weights; it averages gradients over ranks
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    balancer = zellige.Balancer(spec, planner=planner, seed=seed)
    rank, losses = dist.get_rank(), []
    pending = balancer.schedule(draw_samples(rank, 0, seed))
    for step_index in range(steps):
        step = pending.start()
        if step_index + 1 < steps:  # the next step is planned while this one trains
            pending = balancer.schedule(draw_samples(rank, step_index + 1, seed))
        held = step.inputs()
        velocity_TC = model(
            held.tokens["noisy"].double(),
            step.position_ids,
            held.samples["time"],
            step.chunk_index,
            held.text["text"].double(),
            step.attention,
            step.cross_attention,
        )
        error_T = (velocity_TC - held.tokens["target"].double()).square().mean(dim=1)
        loss = step.loss(error_T)  # this rank's share of the data-parallel loss
        optimizer.zero_grad()
        if fsdp:
            (loss * step.num_ranks).backward()  # FSDP's average over ranks becomes a sum
        else:
            loss.backward()
            for parameter in model.parameters():  # plain data parallelism: sum the gradients
                dist.all_reduce(parameter.grad)
        optimizer.step()
        losses.append(step.reduce(loss))
    balancer.close()
    return losses


# ---------------------------------------------------------------- the single-process reference
def sdpa(q_TNH: Tensor, k_SNH: Tensor, v_SNH: Tensor) -> Tensor:
    """One sequence's attention, no Zellige."""
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q_TNH, k_SNH, v_SNH)))
    return out[0].transpose(0, 1)


def reference_losses(steps: int, num_ranks: int, seed: int = 0) -> list[float]:
    """The same training in one process: every rank's samples, each sample attending whole."""
    torch.manual_seed(seed)
    model = TinyDiT().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for step_index in range(steps):
        samples = [s for r in range(num_ranks) for s in draw_samples(r, step_index, seed)]
        total_tokens = sum(s.num_tokens for s in samples)
        loss = torch.zeros((), dtype=torch.float64)
        for s in samples:
            t, h, w = s.grid_thw
            grid = torch.stack(torch.meshgrid(*map(torch.arange, (t, h, w)), indexing="ij"), -1)
            velocity = model(
                s.tokens["noisy"].double(),
                grid.reshape(-1, 3),
                s.values["time"][None],
                torch.zeros(s.num_tokens, dtype=torch.int64),
                s.text["text"].double(),
                sdpa,
                sdpa,
            )
            error = (velocity - s.tokens["target"].double()).square().mean(dim=1)
            loss = loss + error.sum() / total_tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--planner", default="zellige")
    parser.add_argument("--check", action="store_true", help="compare with one process")
    parser.add_argument("--fsdp", action="store_true", help="shard the model with FSDP2")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    losses = train(args.steps, args.planner, fsdp=args.fsdp)
    if dist.get_rank() == 0:
        print(" ".join(f"{loss:.12f}" for loss in losses))
        if args.check:
            reference = reference_losses(args.steps, dist.get_world_size())
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
            print(f"single process: {' '.join(f'{x:.12f}' for x in reference)}")
            print(f"largest relative difference {worst:.2e}")
            if worst > 1e-9:
                raise SystemExit("FAIL: the losses differ from the single-process run")
            print("PASS")
    # The ranks leave together, without Python's finalization: a gloo group that something
    # still refers to (FSDP2 does) would otherwise be torn down there, which aborts a rank now
    # and then.
    end_rank_process()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
