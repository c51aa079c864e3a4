"""Planning time of every planner at 8, 32, 128 and 1024 GPUs on recipe batches, and of zellige at
scale against its targets.

For each GPU count and seed, one step's batch is generated from the recipe (a bucketed loader on
every rank) and each planner plans it. The table reports the median over seeds of the planner's
own wall time (`plan_ms`, the policy alone), of the whole `make_plan` call (name parsing, memory
check, validation and prediction included) and of its thread CPU time (what preemption on shared
cores does not inflate), plus the makespan over the lower bound so a fast planner cannot hide a bad
plan. The scale table: zellige at 1024 GPUs with 4096 sequences (recipe steps concatenated) and on
one recipe batch at 4096 and 8192 GPUs; targets: <= 2 ms median at 32 GPUs, <= 50 ms at 1024 GPUs
with 4096 sequences, <= 200 ms at 4096 GPUs. The few-huge table: 12 videos of 200k-280k tokens
(wan-14b) at 512 and 4096 GPUs, with zellige's makespan over the bound and the best static-cp.
The held-out table: seven families of batches no planner constant was tuned on (HELD_OUT_FAMILIES:
many images of one resolution plus one 200k-450k-token video; 256-token images and 64k-token
clips; lengths uniform in 1k-100k; MMDiT image buckets whose text varies 0-512 with caption
dropout; 100-150 tiny images per GPU; fewer long videos than GPUs; one sequence that fits only
split 8+ ways), up to 16k sequences, at 32, 1024 and 4096 GPUs: zellige's make_plan thread CPU
time (per batch the least of --repeats calls, so that a call slowed by the shared machine's
load does not set the maximum; median and max over seeds; targets 5 / 50 / 250 ms) and the best
covered baseline over zellige.

    PYTHONPATH=src python bench/planning_time.py [--gpus 8,32,128,1024] [--seeds 5]
        [--scale-gpus 4096,8192] [--few-huge-gpus 512,4096] [--held-out-gpus 32,1024,4096]
        [--held-out-seeds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import zellige
from _provenance import git_commit, machine, write_report


@dataclass(kw_only=True, slots=True)
class Row:
    planner: str
    num_gpus: int
    num_sequences: list[int] = field(default_factory=list)
    plan_ms: list[float] = field(default_factory=list)
    call_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)
    ratio_to_bound: list[float] = field(default_factory=list)
    note: str = ""


def planners_for(num_gpus: int) -> list[str]:
    return [
        "dp-tokens",
        "dp-cost",
        "static-cp:8",
        f"knapformer:g4n{num_gpus // 4}",
        "megatron-dcp",
        "zellige",
    ]


def measure(workload: str, model: str | None, num_gpus: int, seeds: int) -> list[Row]:
    recipe = zellige.load_recipe(workload)
    cost_model = zellige.make_cost_model(model or recipe.model, num_gpus)
    rows = {name: Row(planner=name, num_gpus=num_gpus) for name in planners_for(num_gpus)}
    for seed in range(seeds):
        batch = zellige.generate(recipe, num_gpus, seed)
        lower_bound_s = zellige.makespan_lower_bound(batch, cost_model)
        for name, row in rows.items():
            if row.note:
                continue
            start, cpu_start = time.perf_counter(), time.thread_time()
            try:
                plan = zellige.make_plan(name, batch, cost_model, zellige.PlannerOptions(seed=seed))
            except ValueError as error:  # not built yet, or a memory refusal: say so in the row
                row.note = str(error).splitlines()[0]
                continue
            row.call_ms.append((time.perf_counter() - start) * 1e3)
            row.cpu_ms.append((time.thread_time() - cpu_start) * 1e3)
            row.plan_ms.append(plan.plan_ms)
            row.num_sequences.append(len(batch.sequences))
            row.ratio_to_bound.append(plan.predicted.makespan_s / lower_bound_s)
    return list(rows.values())


def table(rows: list[Row], workload: str, seeds: int) -> str:
    lines = [
        f"Planning time on {workload} batches, median over {seeds} seeds",
        "",
        "| GPUs | sequences | planner | plan_ms | make_plan ms | make_plan cpu ms | "
        "makespan / lower bound |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if row.note:
            lines.append(f"| {row.num_gpus} | | {row.planner} | - | - | - | {row.note} |")
            continue
        lines.append(
            f"| {row.num_gpus} | {statistics.median(row.num_sequences):.0f} | {row.planner} | "
            f"{statistics.median(row.plan_ms):.3f} | {statistics.median(row.call_ms):.3f} | "
            f"{statistics.median(row.cpu_ms):.3f} | {statistics.median(row.ratio_to_bound):.3f} |"
        )
    return "\n".join(lines)


def scale_batch(recipe: zellige.Recipe, num_gpus: int, num_sequences: int) -> zellige.Batch:
    """`num_sequences` sequences: recipe steps on num_gpus ranks (seeds 0, 1, ...) concatenated,
    renumbered, truncated."""
    sequences = []
    seed = 0
    while len(sequences) < num_sequences:
        sequences += list(zellige.generate(recipe, num_gpus, seed).sequences)
        seed += 1
    batch = zellige.Batch()
    batch.sequences = sequences[:num_sequences]
    for i, sequence in enumerate(batch.sequences):
        sequence.id = i
    return batch


def time_zellige(batch: zellige.Batch, cost_model, repeats: int):
    """zellige's plan of `batch` `repeats` times (seeds 0..repeats-1): the last plan, each call's
    plan_ms and each call's make_plan thread CPU ms."""
    plan_ms, cpu_ms = [], []
    for r in range(repeats):
        cpu_start = time.thread_time()
        plan = zellige.make_plan("zellige", batch, cost_model, zellige.PlannerOptions(seed=r))
        cpu_ms.append((time.thread_time() - cpu_start) * 1e3)
        plan_ms.append(plan.plan_ms)
    return plan, plan_ms, cpu_ms


def scale_table(workload: str, scale_gpus: list[int], repeats: int) -> str:
    recipe = zellige.load_recipe(workload)
    cases = [(1024, scale_batch(recipe, 1024, 4096), 50.0)]
    cases += [(g, zellige.generate(recipe, g, 0), 200.0 if g == 4096 else None) for g in scale_gpus]
    lines = [
        f"zellige at scale on {workload} ({repeats} repeats): plan_ms and make_plan thread CPU ms",
        "",
        "| GPUs | sequences | plan_ms median | cpu ms median | target ms |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for num_gpus, batch, target in cases:
        cost_model = zellige.make_cost_model(recipe.model, num_gpus)
        plan, plan_ms, cpu_ms = time_zellige(batch, cost_model, repeats)
        lines.append(
            f"| {num_gpus} | {len(batch.sequences)} | {statistics.median(plan_ms):.1f} | "
            f"{statistics.median(cpu_ms):.1f} | {target if target else '-'} |"
        )
        print(f"scale {num_gpus} GPUs done", file=sys.stderr)
    return "\n".join(lines)


def few_huge_batch(num_gpus: int, num_videos: int = 12) -> zellige.Batch:
    """`num_videos` videos of 200k-280k tokens: each spans
    hundreds of ranks, so anchor degrees, windows and baseline group sizes reach the thousands."""
    rng = random.Random(f"few-huge-scale-{num_gpus}")
    batch = zellige.Batch()
    batch.sequences = [
        zellige.sequence_from_tokens(i, "video", rng.randint(200000, 280000), 512, i % num_gpus)
        for i in range(num_videos)
    ]
    return batch


def few_huge_table(gpu_counts: list[int], repeats: int) -> str:
    """zellige on few_huge_batch (wan-14b): plan_ms, its makespan over the lower bound and over the
    best static-cp:C (C a power of two, which is what covered_baselines builds there)."""
    lines = [
        f"zellige on 12 videos of 200k-280k tokens, wan-14b ({repeats} repeats)",
        "",
        "| GPUs | plan_ms median | cpu ms median | zellige / lower bound | best static-cp | "
        "best static-cp / zellige |",
        "| ---: | ---: | ---: | ---: | --- | ---: |",
    ]
    for num_gpus in gpu_counts:
        batch = few_huge_batch(num_gpus)
        cost_model = zellige.make_cost_model("wan-14b", num_gpus)
        plan, plan_ms, cpu_ms = time_zellige(batch, cost_model, repeats)
        makespan_s = plan.predicted.makespan_s
        bound_s = zellige.makespan_lower_bound(batch, cost_model)
        best_name, best_s = "-", float("inf")
        size = 2
        while size <= num_gpus:
            name = f"static-cp:{size}"
            try:
                other = zellige.make_plan(name, batch, cost_model, zellige.PlannerOptions(seed=0))
                if other.predicted.makespan_s < best_s:
                    best_name, best_s = name, other.predicted.makespan_s
            except ValueError:  # out of memory at that size
                pass
            size *= 2
        lines.append(
            f"| {num_gpus} | {statistics.median(plan_ms):.1f} | {statistics.median(cpu_ms):.1f} | "
            f"{makespan_s / bound_s:.3f} | {best_name} | {best_s / makespan_s:.3f} |"
        )
        print(f"few-huge {num_gpus} GPUs done", file=sys.stderr)
    return "\n".join(lines)


# Held-out families: batches real mixed image/video training produces, none of them a recipe.
HELD_OUT_FAMILIES = {
    # family: model preset
    "images+huge-video": "wan-14b",
    "images256+clips64k": "wan-14b",
    "uniform-1k-100k": "wan-14b",
    "mmdit-text-dropout": "mmdit-11b",
    "tiny-images": "wan-1.3b",
    "few-long-videos": "wan-14b",
    "split-8-ways": "wan-14b",
}
# Batches stay within this many sequences (the targets hold up to 16k sequences).
MAX_HELD_OUT_SEQUENCES = 16384


def held_out_batch(family: str, num_gpus: int, seed: int) -> zellige.Batch:
    """One seeded batch of a held-out family (HELD_OUT_FAMILIES) for `num_gpus` GPUs: lengths and
    counts drawn fresh per seed, so no planner constant is tuned to them."""
    rng = random.Random(f"held-out-{family}-{num_gpus}-{seed}")
    cap = MAX_HELD_OUT_SEQUENCES
    sequences: list[tuple[int, int]] = []  # (tokens, text tokens)
    if family == "images+huge-video":
        image_tokens = rng.choice([1024, 2304, 4096])
        count = min(cap - 1, rng.randint(num_gpus // 2, 2 * num_gpus))
        sequences = [(image_tokens, 512)] * count + [(rng.randint(200000, 450000), 512)]
    elif family == "images256+clips64k":
        clips = max(1, rng.randint(num_gpus // 8, num_gpus // 2))
        images = min(cap - clips, rng.randint(num_gpus, 4 * num_gpus))
        sequences = [(65536, 512)] * clips + [(256, 512)] * images
    elif family == "uniform-1k-100k":
        # Up to 60k-100k tokens per GPU (wan-14b on an H200 holds about 100k-140k).
        budget, total = rng.uniform(60000, 100000) * num_gpus, 0
        while len(sequences) < cap and total < budget:
            sequences.append((rng.randint(1000, 100000), 512))
            total += sequences[-1][0]
    elif family == "mmdit-text-dropout":
        count = min(cap, rng.randint(2 * num_gpus, 4 * num_gpus))
        buckets = [1024, 2304, 4096]
        sequences = [
            (rng.choice(buckets), 0 if rng.random() < 0.1 else rng.randint(1, 512))
            for _ in range(count)
        ]
    elif family == "tiny-images":
        count = min(cap, sum(rng.randint(100, 150) for _ in range(num_gpus)))
        sequences = [(rng.choice([64, 144, 256]), 512) for _ in range(count)]
    elif family == "few-long-videos":
        count = rng.randint(max(1, num_gpus // 4), max(1, num_gpus // 2))
        sequences = [(rng.randint(100000, 300000), 512) for _ in range(count)]
    elif family == "split-8-ways":
        # wan-14b on an H200: 600k-780k tokens fit on 8 ranks, not on 4.
        sequences = [(rng.randint(600_000, 780_000), 512)]
        budget, total = rng.uniform(10000, 40000) * num_gpus, 0  # tokens of the others
        while len(sequences) < cap and total < budget:
            sequences.append((rng.randint(4000, 60000), 512))
            total += sequences[-1][0]
    else:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(HELD_OUT_FAMILIES)}")
    batch = zellige.Batch()
    batch.sequences = [
        zellige.sequence_from_tokens(
            i, "video" if tokens > 4096 else "image", tokens, text, i % num_gpus
        )
        for i, (tokens, text) in enumerate(sequences)
    ]
    return batch


# make_plan("zellige") thread CPU time targets (ms), max over a family's batches.
HELD_OUT_TARGET_MS = {32: 5.0, 1024: 50.0, 4096: 250.0}


def held_out_table(gpu_counts: list[int], seeds: int, families: list[str], repeats: int) -> str:
    """zellige on HELD_OUT_FAMILIES: make_plan thread CPU ms (per batch the least of `repeats`
    calls; median and max over seeds) against the target, and the best covered baseline's
    makespan over zellige's (worst = min over seeds; >= 1: zellige never worse)."""
    lines = [
        f"zellige on held-out families ({seeds} seeds each): make_plan thread CPU ms (per batch "
        f"the least of {repeats} calls) and the best covered baseline / zellige (modelled "
        "makespan)",
        "",
        "| family | model | GPUs | sequences (median) | cpu ms median | cpu ms max | target | "
        "baseline/zellige worst | geomean |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for num_gpus in gpu_counts:
        for family in families:
            model = HELD_OUT_FAMILIES[family]
            cost_model = zellige.make_cost_model(model, num_gpus)
            cpu_ms, ratios, counts = [], [], []
            for seed in range(seeds):
                batch = held_out_batch(family, num_gpus, seed)
                counts.append(len(batch.sequences))
                options = zellige.PlannerOptions(seed=seed)
                least_ms = float("inf")
                for _ in range(repeats):
                    cpu_start = time.thread_time()
                    plan = zellige.make_plan("zellige", batch, cost_model, options)
                    least_ms = min(least_ms, (time.thread_time() - cpu_start) * 1e3)
                cpu_ms.append(least_ms)
                best_s = float("inf")
                for name in zellige._core.covered_baselines(batch, cost_model):
                    try:
                        other = zellige.make_plan(name, batch, cost_model, options)
                    except ValueError:  # no plan within memory: nothing to compare
                        continue
                    best_s = min(best_s, other.predicted.makespan_s)
                ratios.append(best_s / plan.predicted.makespan_s)
            target = HELD_OUT_TARGET_MS.get(num_gpus)
            geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            lines.append(
                f"| {family} | {model} | {num_gpus} | {statistics.median(counts):.0f} | "
                f"{statistics.median(cpu_ms):.1f} | {max(cpu_ms):.1f} | "
                f"{target if target else '-'} | {min(ratios):.4f} | {geomean:.4f} |"
            )
            print(f"held-out {family} x {num_gpus} done", file=sys.stderr)
    return "\n".join(lines)


def provenance() -> str:
    lines = [
        "",
        f"machine: {machine()} (shared with other jobs: thread CPU times, which preemption does "
        "not inflate, still vary by about 30% from run to run with the load)",
        f"versions: zellige {zellige.__version__}, python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}",
        f"commit: {git_commit()}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="opensora2-stage2")
    parser.add_argument("--model", default=None, help="model preset (default: the recipe's)")
    parser.add_argument("--gpus", default="8,32,128,1024", help="comma-separated GPU counts")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--scale-gpus", default="4096,8192", help="'' to skip the scale table")
    parser.add_argument(
        "--repeats", type=int, default=3, help="repeats per scale case and per held-out batch"
    )
    parser.add_argument(
        "--few-huge-gpus",
        default="512,4096",
        help="GPU counts of the 12-huge-videos case; '' to skip",
    )
    parser.add_argument(
        "--held-out-gpus",
        default="32,1024,4096",
        help="GPU counts of the held-out families' table; '' to skip",
    )
    parser.add_argument("--held-out-seeds", type=int, default=3)
    parser.add_argument(
        "--held-out-families",
        default=",".join(HELD_OUT_FAMILIES),
        help="comma-separated held-out families",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown)")
    args = parser.parse_args(argv)

    rows: list[Row] = []
    for num_gpus in (int(n) for n in args.gpus.split(",")):
        rows += measure(args.workload, args.model, num_gpus, args.seeds)
        print(f"measured {num_gpus} GPUs", file=sys.stderr)
    text = table(rows, args.workload, args.seeds)
    if args.scale_gpus:
        scale_gpus = [int(n) for n in args.scale_gpus.split(",")]
        text += "\n\n" + scale_table(args.workload, scale_gpus, args.repeats)
    if args.few_huge_gpus:
        few_huge_gpus = [int(n) for n in args.few_huge_gpus.split(",")]
        text += "\n\n" + few_huge_table(few_huge_gpus, args.repeats)
    if args.held_out_gpus:
        held_out_gpus = [int(n) for n in args.held_out_gpus.split(",")]
        families = args.held_out_families.split(",")
        text += "\n\n" + held_out_table(held_out_gpus, args.held_out_seeds, families, args.repeats)
    text += "\n" + provenance()
    if args.out is not None:
        write_report(args.out, "Planning time", "planning_time.py", argv, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
