"""torchrun --nproc-per-node N -m zellige.train --config NAME [--steps K] [--seed S] [--planner P]
[--metrics FILE.jsonl] [--out DIR] [--resume DIR]"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch.distributed as dist

from zellige.train.config import CONFIGS, get_config
from zellige.train.loop import train


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m zellige.train", description="Train the reference video DiT."
    )
    parser.add_argument("--config", required=True, help=f"one of: {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, help="total steps (resumed ones included)")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--planner",
        help="zellige, dp-tokens, dp-cost, static-cp:C, knapformer:SPEC[:GAMMA], megatron-dcp",
    )
    parser.add_argument("--metrics", help="write one JSON object per step to this file")
    parser.add_argument("--out", help="checkpoint directory")
    parser.add_argument("--resume", help="resume from this checkpoint directory")
    args = parser.parse_args(argv)
    try:
        config = get_config(args.config)
    except ValueError as error:
        parser.error(str(error))
    overrides = {
        key: value
        for key, value in (("steps", args.steps), ("seed", args.seed), ("planner", args.planner))
        if value is not None
    }
    config = dataclasses.replace(config, **overrides)
    try:
        train(config, metrics_path=args.metrics, out_dir=args.out, resume_dir=args.resume)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
