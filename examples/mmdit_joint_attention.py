"""Your own MMDiT (Flux / SD3 style: joint attention over text and image tokens) trained with
zellige.Balancer.

Double-stream blocks keep separate weights for the text and visual streams and attend jointly;
single-stream blocks then run on the joint token list. The model is plain PyTorch: it takes its
attention as a callable and the two functions that join the streams into the attended token
list and split it again. The Zellige part is `train()` (about 50 lines). Run on CPU:

    torchrun --nproc-per-node 4 examples/mmdit_joint_attention.py --steps 3 --check

--check trains the same steps again in one process without Zellige (float64) and fails unless
every step's loss agrees. Legend: T tokens (joint: text and visual), V visual tokens, L text
tokens, C chunks (a sample's part on this rank), N heads, D width.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import zellige
from zellige.runtime import end_rank_process

# ---------------------------------------------------------------- the user's model (no Zellige)
WIDTH, HEADS, DOUBLE, SINGLE, FFN, CHANNELS, TEXT_DIM = 32, 4, 2, 1, 64, 8, 16


def sinusoid(x: Tensor, dim: int) -> Tensor:
    freqs = torch.exp(-math.log(100.0) * torch.arange(dim // 2, dtype=x.dtype) / (dim // 2))
    angles = x[..., None] * freqs
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


class Stream(nn.Module):
    """One stream's weights in a double-stream block: modulation, q/k/v, output and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.modulation = nn.Linear(WIDTH, 6 * WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, FFN), nn.GELU(), nn.Linear(FFN, WIDTH))

    def qkv_of(self, x, mod):
        h = F.layer_norm(x, (WIDTH,)) * (1 + mod[1]) + mod[0]
        return self.qkv(h).unflatten(1, (3, HEADS, -1)).unbind(1)

    def finish(self, x, o, mod):
        x = x + mod[2] * self.out(o.flatten(1))
        return x + mod[5] * self.mlp(F.layer_norm(x, (WIDTH,)) * (1 + mod[4]) + mod[3])


class DoubleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual, self.text = Stream(), Stream()

    def forward(self, x_VD, c_LD, emb_CD, chunk_V, chunk_L, attention, join, split):
        mod_v = self.visual.modulation(emb_CD)[chunk_V].chunk(6, -1)
        mod_t = self.text.modulation(emb_CD)[chunk_L].chunk(6, -1)
        qkv_v, qkv_t = self.visual.qkv_of(x_VD, mod_v), self.text.qkv_of(c_LD, mod_t)
        o_v, o_t = split(attention(*(join(a, b) for a, b in zip(qkv_v, qkv_t, strict=True))))
        return self.visual.finish(x_VD, o_v, mod_v), self.text.finish(c_LD, o_t, mod_t)


class SingleBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.modulation = nn.Linear(WIDTH, 3 * WIDTH)
        self.qkv_mlp = nn.Linear(WIDTH, 3 * WIDTH + FFN)
        self.out = nn.Linear(WIDTH + FFN, WIDTH)

    def forward(self, x_TD, emb_CD, chunk_T, attention):
        shift, scale, gate = self.modulation(emb_CD)[chunk_T].chunk(3, -1)
        h = F.layer_norm(x_TD, (WIDTH,)) * (1 + scale) + shift
        qkv, mlp = self.qkv_mlp(h).split([3 * WIDTH, FFN], dim=-1)
        q, k, v = qkv.unflatten(1, (3, HEADS, -1)).unbind(1)
        return x_TD + gate * self.out(torch.cat([attention(q, k, v).flatten(1), F.gelu(mlp)], -1))


class TinyMMDiT(nn.Module):
    """Velocity of each visual token from the noisy latents, (t, h, w) positions, the text tokens
    and the sample's flow time (per chunk)."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Linear(CHANNELS, WIDTH)
        self.position = nn.Linear(3 * 8, WIDTH)
        self.text = nn.Linear(TEXT_DIM, WIDTH)
        self.time = nn.Sequential(nn.Linear(16, WIDTH), nn.SiLU(), nn.Linear(WIDTH, WIDTH))
        self.double_blocks = nn.ModuleList(DoubleBlock() for _ in range(DOUBLE))
        self.single_blocks = nn.ModuleList(SingleBlock() for _ in range(SINGLE))
        self.head = nn.Linear(WIDTH, CHANNELS)

    def forward(self, x_VC, pos_V3, text_LE, time_C, chunk_V, chunk_L, attention, join, split):
        x_VD = self.patch(x_VC) + self.position(sinusoid(pos_V3.to(x_VC.dtype), 8).flatten(1))
        c_LD = self.text(text_LE)
        emb_CD = self.time(sinusoid(time_C, 16))
        for block in self.double_blocks:
            x_VD, c_LD = block(x_VD, c_LD, emb_CD, chunk_V, chunk_L, attention, join, split)
        x_TD, chunk_T = join(x_VD, c_LD), join(chunk_V, chunk_L)
        for block in self.single_blocks:
            x_TD = block(x_TD, emb_CD, chunk_T, attention)
        return self.head(split(x_TD)[0])


# ---------------------------------------------------------------- the user's data (no Zellige)
def draw_samples(rank: int, step: int, seed: int = 0) -> list[zellige.Sample]:
    """What rank `rank`'s loader draws at `step`: 0-3 images and short clips with their text."""
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
def train(steps: int, planner="zellige", seed: int = 0) -> list[float]:
    """Trains `steps` steps on this process group; returns the step losses (every rank)."""
    torch.manual_seed(seed)  # every rank starts from the same weights
    model = TinyMMDiT().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    spec = zellige.model_spec_from_module(
        model, text_tokens=6, joint_attention=True, num_heads=HEADS, ffn_width=FFN
    )
    balancer = zellige.Balancer(spec, planner=planner, seed=seed)
    rank, losses = dist.get_rank(), []
    pending = balancer.schedule(draw_samples(rank, 0, seed))
    for step_index in range(steps):
        step = pending.start()
        if step_index + 1 < steps:  # the next step is planned while this one trains
            pending = balancer.schedule(draw_samples(rank, step_index + 1, seed))
        held = step.inputs()
        chunk_V, chunk_L = step.split(step.chunk_index)
        velocity_VC = model(
            held.tokens["noisy"].double(),
            step.split(step.position_ids)[0],
            held.text["text"].double(),
            held.samples["time"],
            chunk_V,
            chunk_L,
            step.attention,
            step.join,
            step.split,
        )
        error_V = (velocity_VC - held.tokens["target"].double()).square().mean(dim=1)
        loss = step.loss(error_V)  # this rank's share of the data-parallel loss
        optimizer.zero_grad()
        loss.backward()
        for parameter in model.parameters():  # data parallelism (DDP / FSDP average instead:
            dist.all_reduce(parameter.grad)  # backpropagate loss * step.num_ranks with them)
        optimizer.step()
        losses.append(step.reduce(loss))
    balancer.close()
    return losses


# ---------------------------------------------------------------- the single-process reference
def sdpa(q_TNH: Tensor, k_TNH: Tensor, v_TNH: Tensor) -> Tensor:
    """One sequence's attention, no Zellige."""
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q_TNH, k_TNH, v_TNH)))
    return out[0].transpose(0, 1)


def reference_losses(steps: int, num_ranks: int, seed: int = 0) -> list[float]:
    """The same training in one process: every rank's samples, each attending whole over its
    text followed by its visual tokens (as SD3 / Flux concatenate them)."""
    torch.manual_seed(seed)
    model = TinyMMDiT().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for step_index in range(steps):
        samples = [s for r in range(num_ranks) for s in draw_samples(r, step_index, seed)]
        total_tokens = sum(s.num_tokens for s in samples)
        loss = torch.zeros((), dtype=torch.float64)
        for s in samples:
            t, h, w = s.grid_thw
            grid = torch.stack(torch.meshgrid(*map(torch.arange, (t, h, w)), indexing="ij"), -1)
            text_tokens = s.text_tokens

            def join(visual, text):
                return torch.cat([text, visual])

            def split(x, text_tokens=text_tokens):
                return x[text_tokens:], x[:text_tokens]

            velocity = model(
                s.tokens["noisy"].double(),
                grid.reshape(-1, 3),
                s.text["text"].double(),
                s.values["time"][None],
                torch.zeros(s.num_tokens, dtype=torch.int64),
                torch.zeros(text_tokens, dtype=torch.int64),
                sdpa,
                join,
                split,
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
    args = parser.parse_args()
    dist.init_process_group("gloo")
    losses = train(args.steps, args.planner)
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
    # still refers to would otherwise be torn down there, which aborts a rank now and then.
    end_rank_process()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
