"""`zellige profile`: measure this GPU for the cost model and write a profile JSON."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from zellige.commands._inputs import add_model_arguments, model_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, type=Path, help="profile JSON to write")
    add_model_arguments(
        parser, "whose per-token layers and memory are measured (wan-14b; tiny with --quick)"
    )
    parser.add_argument(
        "--block",
        metavar="MODULE:FACTORY",
        help="measure the per-token layers on your own block: FACTORY(model_spec) returns an "
        "nn.Module with forward(x_TD, attention) (see docs/profiling.md)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a few small points only: a smoke run (the only mode allowed without a GPU)",
    )
    parser.add_argument(
        "--details", type=Path, help="also write what the profile schema has no field for"
    )
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="measure only the model's memory and add it to the profile --base (or the built-in)",
    )
    parser.add_argument("--base", help="profile JSON that --memory-only starts from")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per point, median kept (default 5)"
    )
    parser.add_argument(
        "--attention-backend",
        help="engine attention kernel (cudnn, flash, efficient, cpu, math); default automatic",
    )


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    import torch

    from zellige.profile import load_profile, profile_from_dict, profile_to_dict, save_profile
    from zellige.profiler.measure import ProfileOptions, profile_device, profile_memory_into
    from zellige.profiler.models import load_block_factory

    if args.block is not None:
        load_block_factory(args.block)  # a bad target fails now, not after minutes of measuring

    device = "cuda" if torch.cuda.is_available() else "cpu"
    options = ProfileOptions(
        model=model_from_args(args) or ("tiny" if args.quick else "wan-14b"),
        quick=args.quick,
        device=device,
        repeats=min(args.repeats, 3) if args.quick else args.repeats,
        attention_backend=args.attention_backend,
        block=args.block,
    )

    def progress(line: str) -> None:
        print(f"[profile] {line}", file=sys.stderr, flush=True)

    if args.memory_only:
        base = profile_to_dict(load_profile(args.base))
        result = profile_memory_into(base, options, progress)
    else:
        result = profile_device(options, progress)
    profile = profile_from_dict(result.profile)  # the core validates what it will read
    save_profile(profile, args.out)
    if args.details:
        args.details.write_text(json.dumps(result.details, indent=1) + "\n")
    print(f"wrote {args.out} ({profile.device_name})")
    return 0
