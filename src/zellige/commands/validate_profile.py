"""`zellige validate-profile`: MAPE of the cost model's rank time and peak memory against ranks'
compute run for real on this GPU (exchanges excluded), and KnapFormer's gamma model for
comparison."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from zellige._files import check_outputs, read_input, write_output
from zellige.commands._args import SEED_MAX, int_in, nonnegative_float
from zellige.commands._inputs import add_model_arguments, model_from_args

TARGET_PLANS = 21


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plans",
        type=int_in(1, 10_000),
        default=TARGET_PLANS,
        help=f"plans to draw ({TARGET_PLANS}; fewer is a smoke run, not a measurement)",
    )
    parser.add_argument("--profile", help="profile JSON (default: the built-in H200 profile)")
    add_model_arguments(
        parser,
        "default wan-14b; --quick runs a preset as the tiny preset of its kind: tiny, or "
        "mmdit-tiny for an MMDiT; a spec file at its own sizes",
    )
    parser.add_argument(
        "--layers",
        type=int_in(1, 1000),
        help="layers of the model actually run (default 2; an MMDiT's fewest layers with its "
        "double/single split, 3 for mmdit-11b, as `zellige profile` measures it)",
    )
    parser.add_argument(
        "--eager",
        action="store_true",
        help="run the blocks' per-token layers eager (for training with compile_elementwise "
        "off); default: compiled on a GPU, as training runs them",
    )
    parser.add_argument(
        "--ranks-per-plan",
        type=int_in(1, 1024),
        default=2,
        help="ranks of each drawn plan that are run here one after another (default 2)",
    )
    parser.add_argument(
        "--repeats",
        type=int_in(1, 1000),
        default=3,
        help="timed steps per rank at least, median kept (default 3; 2 for ranks whose step "
        "takes over a second)",
    )
    parser.add_argument(
        "--min-timed-s",
        type=nonnegative_float,
        default=2.0,
        help="time each rank over at least this many seconds of steps (at most 200 steps), "
        "median kept: short, host-bound ranks vary from step to step (default 2.0)",
    )
    parser.add_argument(
        "--seed",
        type=int_in(0, SEED_MAX),
        default=0,
        help="seed of the drawn batches and plans (default 0)",
    )
    parser.add_argument(
        "--no-checkpointing", action="store_true", help="run without activation checkpointing"
    )
    parser.add_argument(
        "--time-budget",
        type=nonnegative_float,
        default=0.0,
        metavar="SECONDS",
        help="stop drawing plans after SECONDS (0: no limit)",
    )
    parser.add_argument(
        "--plan-range",
        type=plan_range,
        metavar="FIRST-LAST",
        help="run only plans FIRST..LAST (1-based, inclusive) of the --plans drawn, to split one "
        "validation over several runs; --summarise then reads their --results-jsonl files together",
    )
    parser.add_argument(
        "--measure-rows",
        type=Path,
        metavar="FILE",
        help="first measure the model's own rows on this GPU on top of --profile (as `zellige "
        "profile --base`), write that profile to FILE, and validate it; one process, so the "
        "per-token regions compile once",
    )
    parser.add_argument(
        "--rows-details", type=Path, help="with --measure-rows: that measurement's details"
    )
    parser.add_argument(
        "--time-rows",
        action="store_true",
        help="with --measure-rows: measure only the time rows that move with the machine (the "
        "model's host launch time and per-token rates, the engine's per-head attention tables) "
        "and keep --profile's memory rows, attention call tables and streams (`zellige profile "
        "--time-only` measures those too, minutes more)",
    )
    parser.add_argument(
        "--launch-rows",
        action="store_true",
        help="with --measure-rows: measure only the model's host launch rows (the host's issue "
        "time of a step, which moves from one process to the next) and keep every other row of "
        "--profile",
    )
    parser.add_argument("--json", type=Path, help="write every rank's numbers here")
    parser.add_argument(
        "--results-jsonl", type=Path, help="append each rank's numbers here as they come"
    )
    parser.add_argument(
        "--exclude", default="", help="comma-separated strategies whose plans are skipped"
    )
    parser.add_argument(
        "--contiguous-kernel-inputs",
        action="store_true",
        help="hand the attention kernel contiguous copies (workaround switch)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="CPU smoke run: tiny model, small batches"
    )
    parser.add_argument(
        "--summarise",
        type=Path,
        nargs="+",
        metavar="JSONL",
        help="run nothing: the report of the ranks in --results-jsonl files (a run cut short, or "
        "the parts of a --plan-range split)",
    )


def format_report(report, options) -> str:
    """The text report; `options` None for --summarise, whose results files do not record the
    model their ranks ran, so the report names none rather than this command's defaults."""
    from zellige.profiler.models import model_name
    from zellige.profiler.validate import host_line, launch_floor

    if options is None:
        model = "model not recorded in the results files"
    else:
        model = f"model {model_name(options.model)} ({options.num_layers} layers)"
    lines = [
        f"plans {report.num_plans}, ranks {len(report.ranks)}, {model}",
        *(f"note: {note}" for note in report.notes),
        f"time MAPE {report.time_mape_percent:.2f}%  (after the best single scale: "
        f"{report.time_mape_best_scale_percent:.2f}%)",
    ]
    if report.memory_mape_percent is not None:
        lines.append(
            f"memory MAPE {report.memory_mape_percent:.2f}%  (step part, peak minus the modelled "
            f"FSDP shard: {report.step_memory_mape_percent:.2f}%)"
        )
    else:
        lines.append("memory MAPE n/a (no allocator statistics on a CPU)")
    for label, size in report.by_size.items():
        memory = size["memory_mape_percent"]
        lines.append(
            f"  {label:<14} {size['ranks']:>3} ranks: time MAPE {size['time_mape_percent']:.2f}%"
            + (f", memory MAPE {memory:.2f}%" if memory is not None else "")
        )
    gamma = f"gamma {report.gamma:.3f}" if report.gamma > 0 else "gamma as in the run's log"
    lines.append(
        f"KnapFormer gamma model ({gamma} from forward latencies, best single "
        f"scale): time MAPE {report.knapformer_time_mape_percent:.2f}%"
    )
    if report.host:
        lines.append(f"host as the ranks began: {host_line(report.host)}")
    floor = [r for r in report.ranks if launch_floor(r.predicted_s, r.predicted_busy_s)]
    if floor:
        lines.append(
            f"launch-floor ranks ({len(floor)}): predicted / measured / host issue ms "
            "(the host's wall time to queue a step's kernels)"
        )
    for r in floor:
        issue = f"{r.host_issue_s * 1e3:8.2f}" if r.host_issue_s is not None else "  not recorded"
        lines.append(
            f"  {r.plan:<40} rank {r.rank:>2} {r.tokens:>7} tokens: {r.predicted_s * 1e3:8.2f} / "
            f"{r.measured_s * 1e3:8.2f} / {issue}"
        )
    if report.num_plans < TARGET_PLANS:
        lines.append(f"note: fewer than {TARGET_PLANS} plans: not a measurement of the target")
    return "\n".join(lines)


def plan_range(text: str) -> tuple[int, int]:
    first, sep, last = text.partition("-")
    if not sep or not first.isdigit() or not last.isdigit():
        raise argparse.ArgumentTypeError(f"'{text}' is not FIRST-LAST, e.g. 1-11")
    return int(first), int(last)


def summarise_jsonl(paths: list[Path]):
    """The report of the ranks runs appended to `paths` (--results-jsonl)."""
    from zellige.profiler.validate import RankResult, summarise

    ranks, seen = [], set()
    for path in paths:
        lines = [line for line in read_input(path).splitlines() if line.strip()]
        if not lines:
            raise ValueError(f"{path} holds no rank results")
        for number, line in enumerate(lines, start=1):
            try:
                rank = RankResult(**json.loads(line))
            except (ValueError, TypeError, RecursionError) as error:
                raise ValueError(f"{path} line {number} is not a rank result: {error}") from None
            if (rank.plan, rank.rank) in seen:  # the same rank twice would weigh it double
                raise ValueError(f"{path} line {number}: plan {rank.plan} rank {rank.rank} again")
            seen.add((rank.plan, rank.rank))
            ranks.append(rank)
    report = summarise(ranks, gamma=0.0)
    names = ", ".join(path.name for path in paths)
    report.notes = [f"summarised from {names} ({len(ranks)} ranks); no rank was run now"]
    return report


def run(args: argparse.Namespace) -> int:
    if args.rows_details and not args.measure_rows:
        raise ValueError("--rows-details needs --measure-rows")
    if args.time_rows and not args.measure_rows:
        raise ValueError("--time-rows needs --measure-rows")
    if args.launch_rows and not args.measure_rows:
        raise ValueError("--launch-rows needs --measure-rows")
    if args.launch_rows and args.time_rows:
        raise ValueError(
            "--launch-rows and --time-rows exclude each other (--time-rows measures "
            "the launch rows too)"
        )
    check_outputs(
        {
            "--json": args.json,
            "--results-jsonl": args.results_jsonl,
            "--measure-rows": args.measure_rows,
            "--rows-details": args.rows_details,
        },
        {
            "--profile": args.profile,
            **{f"--summarise {path}": path for path in args.summarise or []},
            "--model-spec": args.model_spec,
        },
    )
    import torch

    from zellige.model import fused
    from zellige.profiler.models import model_to_run, stack_layers
    from zellige.profiler.validate import ValidationOptions, report_dict, validate

    device = "cuda" if torch.cuda.is_available() else "cpu"
    compiled = device == "cuda" and not args.eager  # training's default (compile_elementwise)
    model = model_to_run(model_from_args(args), args.quick, "validate")
    options = ValidationOptions(
        num_plans=args.plans,
        profile=args.profile,
        model=model,
        num_layers=args.layers or stack_layers(model),
        compiled=compiled,
        ranks_per_plan=args.ranks_per_plan,
        repeats=args.repeats,
        min_timed_s=args.min_timed_s,
        seed=args.seed,
        activation_checkpointing=not args.no_checkpointing,
        device=device,
        quick=args.quick,
        time_budget_s=args.time_budget,
        plan_range=args.plan_range,
        exclude_strategies=tuple(s for s in args.exclude.split(",") if s),
        contiguous_kernel_inputs=args.contiguous_kernel_inputs,
        results_jsonl=str(args.results_jsonl) if args.results_jsonl else None,
    )

    started_s = time.monotonic()

    def progress(line: str) -> None:  # with the seconds since the start: where a run's time goes
        elapsed_s = time.monotonic() - started_s
        print(f"[validate] {line} ({elapsed_s:.0f} s)", file=sys.stderr, flush=True)

    def measure_rows():
        from zellige.profile import load_profile, profile_from_dict, profile_to_dict, save_profile
        from zellige.profiler.measure import (
            ProfileOptions,
            profile_memory_into,
            profile_time_into,
        )

        def save(data: dict) -> None:
            save_profile(profile_from_dict(data), args.measure_rows)

        base = profile_to_dict(load_profile(args.profile))
        profile_options = ProfileOptions(
            model=model, quick=args.quick, device=device, compiled=compiled, repeats=3
        )

        def rows_progress(line: str) -> None:
            elapsed_s = time.monotonic() - started_s
            print(f"[profile] {line} ({elapsed_s:.0f} s)", file=sys.stderr, flush=True)

        if args.time_rows or args.launch_rows:
            result = profile_time_into(
                base,
                profile_options,
                rows_progress,
                save,
                call_tables=False,
                launch_only=args.launch_rows,
            )
        else:
            result = profile_memory_into(base, profile_options, rows_progress, save, per_token=True)
        save(result.profile)
        if args.rows_details:
            write_output(args.rows_details, json.dumps(result.details, indent=1) + "\n")
        progress(f"wrote {args.measure_rows}")
        return profile_from_dict(result.profile)

    if args.summarise:
        report = summarise_jsonl(args.summarise)
    else:
        fused.use_compiled(compiled)
        report = validate(options, progress, measure_rows if args.measure_rows else None)
    if args.json:
        write_output(args.json, json.dumps(report_dict(report), indent=1, allow_nan=False) + "\n")
    print(format_report(report, None if args.summarise else options))
    return 0
