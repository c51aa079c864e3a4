"""`zellige profile`: measure this GPU for the cost model and write a profile JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from zellige._files import check_outputs, write_output
from zellige.commands._args import int_in
from zellige.commands._inputs import add_model_arguments, model_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        required=True,
        type=Path,
        help="profile JSON to write (checked before measuring; written atomically)",
    )
    add_model_arguments(
        parser,
        "whose per-token layers and memory are measured (default wan-14b; --quick runs a "
        "preset as the tiny preset of its kind: tiny, or mmdit-tiny for an MMDiT; a spec file "
        "at its own sizes)",
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
        "--base",
        help="measure only the model's own rows (per-token layers on its blocks, memory, host "
        "launch time) and add them to this profile JSON, whose attention and exchange rows "
        "serve every model",
    )
    parser.add_argument(
        "--memory-only",
        action="store_true",
        help="measure only the model's memory and launch rows and add them to --base (or the "
        "built-in profile)",
    )
    parser.add_argument(
        "--time-only",
        action="store_true",
        help="measure only the time rows and write them over --base (or the built-in profile): "
        "the attention engine's per-head and call tables, the streams it runs here and the "
        "overlap they give, and the model's per-token rates and host launch time; its memory "
        "rows are kept (docs/profiling.md)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="run the blocks' per-token layers eager (for training with compile_elementwise "
        "off); default: compiled on a GPU, as training runs them",
    )
    parser.add_argument(
        "--attention-calls",
        action="store_true",
        help="measure only the attention call table that prices the engine's padded merges and "
        "write it to --out (not a profile: see runtime/merging.py; zellige/profiles/ ships one "
        "per GPU model, $ZELLIGE_ATTENTION_CALLS selects another)",
    )
    parser.add_argument(
        "--repeats",
        type=int_in(1, 1000),
        default=5,
        help="timed runs per point, median kept (default 5)",
    )
    parser.add_argument(
        "--attention-backend",
        help="engine attention kernel (cudnn, flash, efficient, cpu, math); default automatic",
    )


def run(args: argparse.Namespace) -> int:
    # Before measuring (minutes on a GPU): an output that cannot be written fails now.
    check_outputs(
        {"--out": args.out, "--details": args.details},
        {"--base": args.base, "--model-spec": args.model_spec},
    )
    import torch

    from zellige.profile import load_profile, profile_from_dict, profile_to_dict, save_profile
    from zellige.profiler.measure import ProfileOptions, profile_device, profile_memory_into
    from zellige.profiler.models import load_block_factory, model_to_run

    if args.block is not None:
        load_block_factory(args.block)  # a bad target fails now, not after minutes of measuring

    from zellige.model import fused

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.attention_calls:
        return _attention_calls(args, torch.device(device))
    compiled = device == "cuda" and not args.eager  # training's default (compile_elementwise)
    fused.use_compiled(compiled)
    options = ProfileOptions(
        model=model_to_run(model_from_args(args), args.quick, "profile"),
        quick=args.quick,
        device=device,
        repeats=min(args.repeats, 3) if args.quick else args.repeats,
        attention_backend=args.attention_backend,
        block=args.block,
        compiled=compiled,
    )

    started_s = time.monotonic()

    def progress(line: str) -> None:  # with the seconds since the start: where a run's time goes
        print(
            f"[profile] {line} ({time.monotonic() - started_s:.0f} s)", file=sys.stderr, flush=True
        )

    def save_part(data: dict) -> None:  # what is measured so far: a run stopped keeps it
        save_profile(profile_from_dict(data), args.out)
        progress(f"wrote {args.out} (the rows measured so far)")

    if args.time_only and args.memory_only:
        raise ValueError("--time-only and --memory-only exclude each other")
    if args.time_only:
        from zellige.profiler.measure import profile_time_into

        base = profile_to_dict(load_profile(args.base))
        result = profile_time_into(base, options, progress, save_part)
    elif args.memory_only or args.base:
        base = profile_to_dict(load_profile(args.base))
        result = profile_memory_into(
            base, options, progress, save_part, per_token=not args.memory_only
        )
    else:
        result = profile_device(options, progress)
    profile = profile_from_dict(result.profile)  # the core validates what it will read
    save_profile(profile, args.out)
    if args.details:
        write_output(args.details, json.dumps(result.details, indent=1) + "\n")
    print(f"wrote {args.out} ({profile.device_name})")
    return 0


def _attention_calls(args: argparse.Namespace, device) -> int:
    from zellige.profiler.attention_calls import measure_call_table

    if device.type != "cuda" and not args.quick:
        raise ValueError("--attention-calls needs a GPU (or --quick for a smoke run)")
    table = measure_call_table(
        device,
        quick=args.quick,
        repeats=min(args.repeats, 3) if args.quick else args.repeats,
        progress=lambda line: print(f"[profile] {line}", file=sys.stderr, flush=True),
    )
    write_output(args.out, json.dumps(table, indent=1) + "\n")
    print(f"wrote {args.out} (attention call table, {table['device_name']})")
    return 0
