"""End-to-end planner comparison with real training: the same batches under each planner.

For one training config, launches `torchrun -m zellige.train` once per planner with the same seed
(so the same batch at every step, whatever the planner), W warm-up + M measured steps, reads each
run's --metrics JSONL and reports per planner: mean step time, tokens/s, MFU, the plan's predicted
step time (the cost model's makespan) against the measured one, throughput ratios against the best
knapformer run and against dp-cost, and whether the losses of the same steps agree across planners.

`static-cp` and `knapformer` without an argument are tuned, not measured, per family: the
candidate (static-cp: every power-of-two C that divides the ranks; knapformer: every homogeneous
and mixed spec of power-of-two bags) with the smallest makespan that the cost model predicts for
the FIRST batch is the one trained. `static-cp:C` or `knapformer:SPEC` trains exactly that.

usage: python bench/e2e_compare.py --config NAME [--nproc N] [--planners P,...] [--warmup W]
           [--measured M] [--seed S] [--work-dir DIR] [--markdown FILE] [--reuse]
           [--time-budget-s T] [--commit C] [--dry-run]
Each run's metrics and log stay in --work-dir; with --reuse a planner whose metrics there are
complete is not trained again, so a run cut short by a time limit continues where it stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

DEFAULT_PLANNERS = "zellige,dp-cost,static-cp,knapformer,megatron-dcp"
TUNED_FAMILIES = ("static-cp", "knapformer")
DEFAULT_STARTUP_S = 120.0  # torchrun, process group, model init, loader: guessed for a first run

# Largest relative difference of the same step's loss across planners that still counts as the
# same computation. Placements change only the summation order (and, on GPU, kernel shapes), so
# losses differ by rounding that grows over the steps; one misrouted token in a thousand changes
# the loss by ~1e-3. float32 on CPU: 1.3e-7 measured over 13 tiny-cpu steps (the CPU report),
# 1e-5 leaves 100x for longer runs. bf16 on GPU (8-bit mantissa, ulp 3.9e-3): 2e-2, a few ulps of
# drift after 20 optimizer steps. float64: ~1e-15 per operation (tests/distributed/test_train.py).
LOSS_TOLERANCE = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(kw_only=True, slots=True)
class Choice:
    """What one requested planner name resolved to: the planner trained, and for a tuned family
    the predicted makespan (or the reason it cannot place) of every candidate on the first batch."""

    requested: str
    planner: str | None  # None: no candidate could place the first batch
    sweep: list[tuple[str, float | None, str | None]]  # (candidate, predicted_s, error)


@dataclasses.dataclass(kw_only=True, slots=True)
class RunSummary:
    """Means over the measured steps of one planner's run."""

    planner: str
    measured_steps: int
    step_s: float
    tokens_per_s: float
    mfu: float | None
    predicted_step_s: float
    predicted_error: float  # (mean predicted - mean measured) / mean measured
    predicted_abs_error_per_step: float  # mean over steps of |predicted - measured| / measured
    planned_imbalance: float
    measured_imbalance: float
    plan_ms: float
    data_wait_s: float
    peak_gib: float | None
    # False when the run's profile is of another device (a CPU run under the H200 profile): its
    # predicted times are that device's, so the errors say nothing about the cost model
    prediction_comparable: bool = True


# ---- candidates of the tuned families --------------------------------------------------------


def static_cp_candidates(num_ranks: int) -> list[str]:
    """Every power-of-two group size C >= 2 that divides the ranks (C = 1 is data parallelism)."""
    sizes = [2**k for k in range(1, num_ranks.bit_length()) if num_ranks % 2**k == 0]
    return [f"static-cp:{size}" for size in sizes]


def knapformer_candidates(num_ranks: int) -> list[str]:
    """Every KnapFormer spec of power-of-two bags that covers the ranks exactly: the homogeneous
    ones (g1n8, g2n4, ...) and every mix of distinct bag sizes (g1n2+g2n1+g4n1, ...)."""
    sizes = [2**k for k in range(num_ranks.bit_length()) if 2**k <= num_ranks]
    specs = []
    for counts in itertools.product(*(range(num_ranks // size + 1) for size in sizes)):
        if sum(c * s for c, s in zip(counts, sizes, strict=True)) != num_ranks:
            continue
        specs.append("+".join(f"g{s}n{c}" for s, c in zip(sizes, counts, strict=True) if c))
    # homogeneous first, then mixes with fewer terms
    return [f"knapformer:{spec}" for spec in sorted(specs, key=lambda s: (s.count("+"), s))]


def family_candidates(family: str, num_ranks: int) -> list[str]:
    if family == "static-cp":
        return static_cp_candidates(num_ranks)
    if family == "knapformer":
        return knapformer_candidates(num_ranks)
    raise ValueError(f"no sweep for {family!r}; tuned families: {', '.join(TUNED_FAMILIES)}")


def first_step_makespan_s(config, num_ranks: int, planner: str) -> float:
    """The makespan the cost model predicts for `planner` on step 1's batch, made exactly as the
    training loop's loader makes it (same batch, cost model and planner seed)."""
    from zellige.data import StepDataset
    from zellige.train.optimizer_builder import cost_options

    dataset = StepDataset(
        model=config.model.dit,
        recipe=config.data.recipe,
        planner=planner,
        rank=0,
        num_ranks=num_ranks,
        gpus_per_node=config.parallelism.gpus_per_node,
        seed=config.seed,
        profile=config.parallelism.profile,
        cost_options=cost_options(config, num_ranks),
    )
    return dataset[0].record.makespan_s


def resolve_planners(names: Iterable[str], config, num_ranks: int) -> list[Choice]:
    """Turns `static-cp` / `knapformer` into their best candidate on the first batch."""
    choices = []
    for name in names:
        if name not in TUNED_FAMILIES:
            choices.append(Choice(requested=name, planner=name, sweep=[]))
            continue
        sweep = []
        for candidate in family_candidates(name, num_ranks):
            try:
                sweep.append((candidate, first_step_makespan_s(config, num_ranks, candidate), None))
            except ValueError as error:  # PlanMemoryError is a ValueError; so are bad specs
                sweep.append((candidate, None, str(error).split("\n")[0]))
        placed = [(s, candidate) for candidate, s, _ in sweep if s is not None]
        best = min(placed)[1] if placed else None
        choices.append(Choice(requested=name, planner=best, sweep=sweep))
    return choices


# ---- reading and summarising metrics ---------------------------------------------------------


def read_metrics(path: str | Path) -> list[dict]:
    """One record per step, in step order (a resumed file may repeat steps: the last one wins)."""
    by_step = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[step] for step in sorted(by_step)]


def measured_records(records: list[dict], warmup_steps: int) -> list[dict]:
    return [r for r in records if r["step"] > warmup_steps]


def summarise(planner: str, records: list[dict], warmup_steps: int) -> RunSummary:
    steps = measured_records(records, warmup_steps)
    if not steps:
        raise ValueError(f"{planner}: no step after the {warmup_steps} warm-up steps")
    step_s = sum(r["step_s"] for r in steps)
    predicted_s = sum(r["predicted_makespan_s"] for r in steps)
    # MFU per step is flops / (step_s * ranks * peak): weighting by step_s gives the run's MFU
    mfu = None
    if all(r["mfu"] is not None for r in steps):
        mfu = sum(r["mfu"] * r["step_s"] for r in steps) / step_s
    peaks = [r["peak_gib"] for r in steps if r.get("peak_gib") is not None]
    return RunSummary(
        planner=planner,
        measured_steps=len(steps),
        step_s=step_s / len(steps),
        tokens_per_s=sum(r["tokens"] for r in steps) / step_s,
        mfu=mfu,
        predicted_step_s=predicted_s / len(steps),
        predicted_error=(predicted_s - step_s) / step_s,
        predicted_abs_error_per_step=sum(
            abs(r["predicted_makespan_s"] - r["step_s"]) / r["step_s"] for r in steps
        )
        / len(steps),
        planned_imbalance=sum(r["planned_imbalance"] for r in steps) / len(steps),
        measured_imbalance=sum(r["measured_imbalance"] for r in steps) / len(steps),
        plan_ms=sum(r["plan_ms"] for r in steps) / len(steps),
        data_wait_s=sum(r["data_wait_s_max"] for r in steps) / len(steps),
        peak_gib=max(peaks) if peaks else None,
        prediction_comparable=all(r.get("prediction_comparable", True) for r in steps),
    )


def same_batches(histories: dict[str, list[dict]]) -> list[str]:
    """Problems that show two runs did not train the same batches (empty: they did). Every run
    must have the same steps, and each step the same token and sequence counts."""
    problems = []
    items = list(histories.items())
    reference_name, reference = items[0]
    want = {r["step"]: (r["tokens"], r["sequences"]) for r in reference}
    for name, records in items[1:]:
        got = {r["step"]: (r["tokens"], r["sequences"]) for r in records}
        if got.keys() != want.keys():
            problems.append(f"{name} ran steps {sorted(got)}, {reference_name} {sorted(want)}")
            continue
        for step in sorted(want):
            if got[step] != want[step]:
                problems.append(
                    f"step {step}: {name} had (tokens, sequences) {got[step]}, "
                    f"{reference_name} {want[step]}"
                )
    return problems


@dataclasses.dataclass(kw_only=True, slots=True)
class LossAgreement:
    planner: str
    first_step_rel_diff: float  # step 1: the same weights, so only the forward pass's rounding
    max_rel_diff: float  # over every common step
    worst_step: int


def loss_agreement(histories: dict[str, list[dict]], reference: str) -> list[LossAgreement]:
    """|loss - reference loss| / |reference loss| of every other planner, over the steps both
    ran (all of them, warm-up included: the losses must agree from the first step on)."""
    want = {r["step"]: r["loss"] for r in histories[reference]}
    rows = []
    for name, records in histories.items():
        if name == reference:
            continue
        diffs = {
            r["step"]: abs(r["loss"] - want[r["step"]]) / max(abs(want[r["step"]]), 1e-30)
            for r in records
            if r["step"] in want
        }
        if not diffs:
            raise ValueError(f"{name} and {reference} have no step in common")
        worst_step = max(diffs, key=diffs.get)
        first = min(diffs)
        rows.append(
            LossAgreement(
                planner=name,
                first_step_rel_diff=diffs[first],
                max_rel_diff=diffs[worst_step],
                worst_step=worst_step,
            )
        )
    return rows


def throughput_ratios(summaries: list[RunSummary]) -> dict[str, dict[str, float | None]]:
    """tokens/s of each planner over that of the best knapformer run and of dp-cost (None when
    that baseline did not run)."""
    knapformer = [s.tokens_per_s for s in summaries if s.planner.startswith("knapformer")]
    dp_cost = [s.tokens_per_s for s in summaries if s.planner == "dp-cost"]
    best_knapformer = max(knapformer) if knapformer else None
    return {
        s.planner: {
            "vs_best_knapformer": s.tokens_per_s / best_knapformer if best_knapformer else None,
            "vs_dp_cost": s.tokens_per_s / dp_cost[0] if dp_cost else None,
        }
        for s in summaries
    }


# ---- running ----------------------------------------------------------------------------------


def metrics_name(planner: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]", "_", planner) + ".jsonl"


def train_command(
    config_name: str, num_ranks: int, planner: str, num_steps: int, seed: int, metrics: Path
) -> list[str]:
    return [
        *("torchrun", "--standalone", "--nproc-per-node", str(num_ranks)),
        *("-m", "zellige.train", "--config", config_name, "--steps", str(num_steps)),
        *("--seed", str(seed), "--planner", planner, "--metrics", str(metrics)),
    ]


def run_training(command: list[str], log_path: Path, cpu_threads: int | None) -> float:
    """Runs one torchrun (as `python -m torch.distributed.run`, so this interpreter's packages);
    returns its wall seconds. Raises RuntimeError with the log's tail when it fails."""
    env = dict(os.environ)
    if cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    launcher = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    start = time.perf_counter()
    with open(log_path, "w") as log:
        done = subprocess.run(launcher, env=env, stdout=log, stderr=subprocess.STDOUT)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        tail = log_path.read_text()[-2000:]
        raise RuntimeError(f"exit {done.returncode} after {wall_s:.0f} s; log tail:\n{tail}")
    return wall_s


def expected_run_s(
    predicted_step_s: float, num_steps: int, finished: list[tuple[float, float, float]]
) -> float:
    """Seconds one run should take: `num_steps` steps of the predicted step time, scaled by how
    the finished runs' (predicted step s summed, measured step s summed, wall s) compared, plus
    their largest start-up and shut-down (wall minus steps); DEFAULT_STARTUP_S before any run."""
    if not finished:
        return num_steps * predicted_step_s + DEFAULT_STARTUP_S
    predicted_s = sum(run[0] for run in finished)
    measured_s = sum(run[1] for run in finished)
    startup_s = max(wall_s - steps_s for _, steps_s, wall_s in finished)
    return num_steps * predicted_step_s * measured_s / predicted_s + startup_s


def is_complete(path: Path, num_steps: int) -> bool:
    return path.exists() and len(read_metrics(path)) >= num_steps


# ---- report -------------------------------------------------------------------------------------


def machine_description(device: str, num_ranks: int) -> str:
    import torch

    if device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}"
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = re.findall(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        model = names[0].strip() if names else model
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"CPU {model}, {cores} cores usable, {num_ranks} processes"


def versions(backend: str) -> str:
    import torch

    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if backend == "nccl" and torch.cuda.is_available():
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
        parts += [f"CUDA {torch.version.cuda}", f"NCCL {nccl}"]
    return ", ".join(parts)


def git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run(
        ["git", "-C", str(root), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
    )
    return run.stdout.strip() or "?"


def _fmt(value: float | None, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{scale * value:{spec}}{suffix}"


def results_table(summaries: list[RunSummary], requested: dict[str, str]) -> list[str]:
    ratios = throughput_ratios(summaries)
    header = (
        "planner",
        "step s",
        "tokens/s",
        "MFU",
        "predicted s",
        "pred. error",
        "per-step abs error",
        "imbalance planned / measured",
        "vs best knapformer",
        "vs dp-cost",
    )
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for s in summaries:
        name = s.planner if requested[s.planner] == s.planner else f"{s.planner} (best)"
        cells = (
            name,
            f"{s.step_s:.4g}",
            f"{s.tokens_per_s:,.0f}",
            _fmt(s.mfu, ".1f", 100, "%"),
            f"{s.predicted_step_s:.4g}",
            f"{100 * s.predicted_error:+.1f}%" if s.prediction_comparable else "- (a)",
            f"{100 * s.predicted_abs_error_per_step:.1f}%" if s.prediction_comparable else "- (a)",
            f"{s.planned_imbalance:.3f} / {s.measured_imbalance:.3f}",
            _fmt(ratios[s.planner]["vs_best_knapformer"], ".3f", suffix="x"),
            _fmt(ratios[s.planner]["vs_dp_cost"], ".3f", suffix="x"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def loss_lines(
    histories: dict[str, list[dict]], reference: str, tolerance: float, dtype: str
) -> tuple[list[str], bool]:
    rows = loss_agreement(histories, reference)
    agree = all(row.max_rel_diff <= tolerance for row in rows)
    lines = [
        f"Reference: {reference}. Tolerance: relative difference <= {tolerance:g} for {dtype} "
        "(placements change only the summation order, so the same step's loss differs by rounding "
        "that grows over the steps; a routing or normalisation error would change it by its own "
        "order).",
        "",
        "| planner | step 1 rel. diff | max rel. diff (step) | agrees |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.planner} | {row.first_step_rel_diff:.2e} | {row.max_rel_diff:.2e} "
            f"({row.worst_step}) | {'yes' if row.max_rel_diff <= tolerance else 'NO'} |"
        )
    steps = [r["step"] for r in histories[reference]]
    lines += ["", "Loss per step:", ""]
    lines.append("| step | " + " | ".join(histories) + " |")
    lines.append("|" + " --- |" * (len(histories) + 1))
    for step in steps:
        losses = [
            next((f"{r['loss']:.6f}" for r in records if r["step"] == step), "-")
            for records in histories.values()
        ]
        lines.append(f"| {step} | " + " | ".join(losses) + " |")
    return lines, agree


def throughput_targets(summaries: list[RunSummary], recipe: str) -> list[str]:
    """The end-to-end targets (never slower than a baseline; on opensora2-stage2 >= 1.15x the best
    knapformer and >= 1.5x dp-cost; predictions within 5%), checked on this run's numbers (GPU
    runs only)."""
    by_name = {s.planner: s for s in summaries}
    if "zellige" not in by_name:
        return []
    zellige = by_name["zellige"]
    ratios = throughput_ratios(summaries)["zellige"]
    baselines = [s for s in summaries if s.planner != "zellige"]
    lines = []
    if baselines:
        slowest = min(zellige.tokens_per_s / s.tokens_per_s for s in baselines)
        lines.append(f"- never slower than a baseline: min ratio {slowest:.3f}x ({slowest >= 1.0})")
    if recipe.startswith("opensora2-stage2"):
        for key, target, label in (
            ("vs_best_knapformer", 1.15, "best knapformer"),
            ("vs_dp_cost", 1.5, "dp-cost"),
        ):
            if ratios[key] is not None:
                lines.append(
                    f"- >= {target}x {label}: {ratios[key]:.3f}x ({ratios[key] >= target})"
                )
    worst = max(abs(s.predicted_error) for s in summaries)
    lines.append(f"- predicted step time within 5% of measured: worst {100 * worst:.1f}%")
    return lines


# ---- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="a zellige.train config name")
    parser.add_argument("--nproc", type=int, help="ranks (default: the GPUs, or 4 on CPU)")
    parser.add_argument("--planners", default=DEFAULT_PLANNERS, help="comma-separated")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the means")
    parser.add_argument("--measured", type=int, default=20, help="steps averaged")
    parser.add_argument("--seed", type=int, help="default: the config's")
    parser.add_argument("--work-dir", default="e2e-runs", help="metrics and logs of each run")
    parser.add_argument("--markdown", help="write the report here")
    parser.add_argument("--note", default="", help="a paragraph at the top of the report")
    parser.add_argument("--reuse", action="store_true", help="keep complete runs in --work-dir")
    parser.add_argument(
        "--time-budget-s",
        type=float,
        help="start no run expected to end after this many seconds (report what ran)",
    )
    parser.add_argument("--commit", help="the commit to report (default: git describe)")
    parser.add_argument("--dry-run", action="store_true", help="resolve and print the commands")
    args = parser.parse_args(argv)

    import torch

    from zellige.train.config import get_config

    config = get_config(args.config)
    if args.seed is not None:
        config = config.with_fields(seed=args.seed)
    cuda = config.parallelism.device == "cuda"
    num_ranks = args.nproc or (torch.cuda.device_count() if cuda else 4)
    num_steps = args.warmup + args.measured
    work_dir = Path(args.work_dir) / config.name
    work_dir.mkdir(parents=True, exist_ok=True)
    cpu_threads = None
    if config.parallelism.device == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
        cpu_threads = max(1, cores // num_ranks)

    started = time.perf_counter()
    choices = resolve_planners(args.planners.split(","), config, num_ranks)
    # a tuned family may resolve to a planner also named explicitly: train it once
    choices = [
        c for i, c in enumerate(choices) if c.planner not in {d.planner for d in choices[:i]}
    ]
    requested = {c.planner: c.requested for c in choices if c.planner}
    for choice in choices:
        for candidate, makespan_s, error in choice.sweep:
            mark = " <- trained" if candidate == choice.planner else ""
            shown = f"{makespan_s:.4g} s" if error is None else f"cannot place: {error}"
            print(f"{choice.requested}: {candidate} predicted {shown}{mark}", flush=True)

    histories: dict[str, list[dict]] = {}
    failures: dict[str, str] = {}
    commands: dict[str, list[str]] = {}
    finished: list[tuple[float, float, float]] = []  # runs made here, for expected_run_s
    for choice in choices:
        if choice.planner is None:
            failures[choice.requested] = "no candidate places the first batch"
            continue
        metrics = work_dir / metrics_name(choice.planner)
        command = train_command(
            config.name, num_ranks, choice.planner, num_steps, config.seed, metrics
        )
        commands[choice.planner] = command
        needs_run = not (args.reuse and is_complete(metrics, num_steps))
        if args.dry_run or (needs_run and args.time_budget_s is not None):
            predicted_step_s = dict((c, s) for c, s, _ in choice.sweep).get(choice.planner)
            if predicted_step_s is None:
                predicted_step_s = first_step_makespan_s(config, num_ranks, choice.planner)
            expected_s = expected_run_s(predicted_step_s, num_steps, finished)
        if args.dry_run:
            print(f"# about {expected_s:.0f} s (step 1's prediction x steps + start-up):")
            print(" ".join(command), flush=True)
            continue
        if needs_run:
            elapsed_s = time.perf_counter() - started
            if args.time_budget_s is not None and elapsed_s + expected_s > args.time_budget_s:
                failures[choice.planner] = (
                    f"not run: {elapsed_s:.0f} s spent, about {expected_s:.0f} s needed, "
                    f"budget {args.time_budget_s:.0f} s (run again with --reuse)"
                )
                continue
            print(f"training {choice.planner} ({num_steps} steps)...", flush=True)
            try:
                wall_s = run_training(command, metrics.with_suffix(".log"), cpu_threads)
            except RuntimeError as error:
                failures[choice.planner] = str(error)
                print(f"{choice.planner}: FAILED {error}", file=sys.stderr, flush=True)
                continue
            print(f"  done in {wall_s:.0f} s", flush=True)
        histories[choice.planner] = read_metrics(metrics)[:num_steps]
        if needs_run:
            records = histories[choice.planner]
            predicted_s = sum(r["predicted_makespan_s"] for r in records)
            finished.append((predicted_s, sum(r["step_s"] for r in records), wall_s))
    if args.dry_run:
        return 0

    summaries = [summarise(name, records, args.warmup) for name, records in histories.items()]
    machine = machine_description(config.parallelism.device, num_ranks)
    backend = config.parallelism.backend
    stamp = (
        f"{machine}; {versions(backend)}; commit {args.commit or git_commit()}; backend "
        f"{backend}, {config.model.dtype}"
    )
    model = config.model.dit
    lines = [
        f"# End-to-end planner comparison: {config.name}, {num_ranks} ranks "
        f"({datetime.date.today():%Y-%m})",
        "",
    ]
    if args.note:
        lines += [args.note, ""]
    lines += [
        f"Machine: {stamp}.",
        f"Model {model.name}: width {model.width}, {model.num_layers} layers, {model.num_heads} "
        f"heads; batches from recipe `{config.data.recipe}` with seed {config.seed} (the same "
        f"batches for every planner); {args.warmup} warm-up + {args.measured} measured steps, "
        f"means over steps {args.warmup + 1}..{num_steps}. Step time: the slowest rank's wall "
        "time of the step; predicted: the plan's makespan from the cost model (hardware profile "
        f"{config.parallelism.profile or 'built-in H200'}); tokens/s over the measured steps.",
        "",
        "Command:",
        "",
        "```bash",
        "python bench/e2e_compare.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "```",
        "",
    ]
    tuned = [c for c in choices if c.sweep]
    if tuned:
        lines += [
            "## Tuned baselines",
            "",
            "static-cp's C and knapformer's spec are chosen by the cost model's predicted makespan "
            "on the first batch (step 1), not by training every candidate; the chosen one is "
            "trained.",
            "",
            "| family | candidate | predicted makespan s (step 1) |",
            "| --- | --- | --- |",
        ]
        for choice in tuned:
            for candidate, makespan_s, error in choice.sweep:
                shown = f"{makespan_s:.4g}" if error is None else f"cannot place ({error[:80]})"
                chosen = " **(trained)**" if candidate == choice.planner else ""
                lines.append(f"| {choice.requested} | {candidate}{chosen} | {shown} |")
        lines.append("")
    table = results_table(summaries, requested)
    lines += ["## Results", ""] + table + [""]
    lines += [
        "pred. error: mean predicted over mean measured step time, minus 1; per-step abs error: "
        "mean of |predicted - measured| / measured. vs best knapformer / vs dp-cost: tokens/s over "
        "the highest tokens/s among this report's knapformer runs / over dp-cost's.",
        "",
    ]
    if not all(s.prediction_comparable for s in summaries):
        lines += [
            "(a) not comparable: the cost model's profile was measured on another device than "
            "this run's (e.g. the built-in H200 profile on a CPU run), so its predicted times are "
            "that device's; `zellige profile` measures this machine and `--profile` uses it.",
            "",
        ]
    agree = True
    if len(histories) > 1:
        batch_problems = same_batches(histories)
        reference = "dp-cost" if "dp-cost" in histories else next(iter(histories))
        tolerance = LOSS_TOLERANCE[config.model.dtype]
        loss_text, agree = loss_lines(histories, reference, tolerance, config.model.dtype)
        lines += ["## Losses of the same steps", ""]
        lines += [
            "Same batches in every run (token and sequence counts per step): "
            + ("yes." if not batch_problems else "NO: " + "; ".join(batch_problems)),
            "",
            *loss_text,
            "",
        ]
        agree = agree and not batch_problems
    if config.parallelism.device == "cuda":
        targets = throughput_targets(summaries, config.data.recipe)
        if targets:
            lines += ["## Targets", "", *targets, ""]
    if failures:
        lines += ["## Runs that did not complete", ""]
        lines += [f"- {name}: {reason.splitlines()[0]}" for name, reason in failures.items()]
        lines.append("")
    lines += ["## Training commands (one per planner)", "", "```bash"]
    lines += [" ".join(command) for command in commands.values()] + ["```", ""]
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text("\n".join(lines))

    print(f"\nlosses agree across planners: {'yes' if agree else 'NO'}")
    for name, reason in failures.items():
        print(f"{name}: {reason.splitlines()[0]}")
    print(f"\n{stamp}; {config.name}, {num_ranks} ranks, steps {args.warmup + 1}..{num_steps}")
    print("\n".join(table))
    return 0 if agree and not failures else 1


if __name__ == "__main__":
    sys.exit(main())
