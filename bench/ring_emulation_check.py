"""Runs one rank of a ring, a hybrid and a Ulysses placement through real DiT blocks and the
engine's distributed attention (exchanges as local copies, as validate-profile runs them) and
prints OK per strategy: a seconds-long check of those paths on a GPU before a long run.

    python -X faulthandler bench/ring_emulation_check.py [--model wan-14b] [--tokens 8000]
        [--contiguous]
"""

from __future__ import annotations

import argparse
import time

import torch

from zellige import _core
from zellige.profiler import rank_work
from zellige.profiler.models import dit_config
from zellige.runtime import EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="wan-14b")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--contiguous", action="store_true", help="contiguous kernel inputs")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    config = dit_config(args.model, num_layers=1)
    blocks = rank_work.make_blocks(config, 1, device, dtype)
    batch = _core.Batch()
    batch.sequences = [
        _core.sequence_from_tokens(0, "video", args.tokens, config.text_tokens, 0),
        _core.sequence_from_tokens(1, "image", 1000, config.text_tokens, 1),
    ]
    cases = [
        ("ring", _core.Strategy.ring, [0, 1], 0),
        ("ulysses", _core.Strategy.ulysses, [0, 1], 0),
    ]
    cases.append(("hybrid", _core.Strategy.hybrid, [0, 1, 2, 3], 2))
    for name, strategy, ranks, ulysses_degree in cases:
        plan = _core.Plan()
        plan.planner = "check"
        plan.num_ranks = 4
        first = (
            _core.make_placement(0, strategy, ranks, ulysses_degree)
            if ulysses_degree
            else _core.make_placement(0, strategy, ranks)
        )
        plan.placements = [first, _core.make_placement(1, _core.Strategy.local, [0])]
        start_s = time.perf_counter()
        inputs = rank_work.plan_rank_inputs(
            batch=batch, plan=plan, rank=0, config=config, device=device, dtype=dtype,
            engine=EngineConfig.from_env().replace(contiguous_kernel_inputs=args.contiguous),
        )  # fmt: skip
        rank_work.train_step(blocks, inputs, checkpointing=True)
        if cuda:
            torch.cuda.synchronize()
        print(f"{name}: OK ({time.perf_counter() - start_s:.2f} s)", flush=True)


if __name__ == "__main__":
    main()
