"""Planner quality: zellige against the joint MILP, the lower bound and every baseline.

Per recipe (opensora2-stage2, wan-stage2, wan-stage3, knapformer-joint) and GPU count (16, 32;
8 per node, built-in H200 profile), `--seeds` seeded batches, each planned by zellige and by every
baseline (dp-tokens, dp-cost, static-cp:2/4/8, megatron-dcp, and knapformer over homogeneous and
mixed bag specs), against the cost model's lower bound. The joint MILP (HiGHS, one thread,
`--joint-time-limit` seconds) runs on the first `--joint-seeds` seeds of each configuration only,
to keep the run to minutes on 2 shared cores; the zellige/joint gap counts only batches where the
MILP proved optimality over its candidates. Then the geometric-mean makespan ratio of the best
knapformer spec over zellige at 32 GPUs with NVLink and with PCIe-class links (25 GB/s), and the
planning time at 128 and 1024 GPUs with 4096 sequences.

    PYTHONPATH=src python bench/planner_quality.py [--seeds 50] [--joint-seeds 6]
        [--joint-time-limit 5] [--out bench/results/planner_quality_cpu2_202611.md]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import zellige
from _provenance import git_commit, machine, write_report
from zellige import _core, joint

RECIPES = ["opensora2-stage2", "wan-stage2", "wan-stage3", "knapformer-joint"]
GPU_COUNTS = [16, 32]
GPUS_PER_NODE = 8
SCALE_SEQUENCES = 4096
SCALE_GPUS = [128, 1024]


def knapformer_specs(num_gpus: int) -> list[str]:
    """Homogeneous bag specs (KnapFormer's own sweep) plus mixed ones, bags of 1..8 GPUs."""
    homogeneous = [f"g{g}n{num_gpus // g}" for g in (1, 2, 4, 8) if num_gpus % g == 0]
    mixed = {
        16: ["g1n4+g2n2+g8n1", "g1n8+g4n2", "g2n4+g4n2", "g1n4+g2n2+g4n2", "g1n8+g2n2+g4n1"],
        32: [
            "g1n8+g2n4+g4n2+g8n1",
            "g1n16+g2n4+g8n1",
            "g2n8+g4n4",
            "g1n8+g4n4+g8n1",
            "g1n16+g4n4",
            "g2n4+g4n4+g8n1",
        ],
    }.get(num_gpus, [])
    return [f"knapformer:{spec}" for spec in homogeneous + mixed]


def baselines(num_gpus: int) -> list[str]:
    return [
        "dp-tokens",
        "dp-cost",
        "static-cp:2",
        "static-cp:4",
        "static-cp:8",
        "megatron-dcp",
        *knapformer_specs(num_gpus),
    ]


@dataclass(kw_only=True, slots=True)
class Config:
    recipe: str
    num_gpus: int
    links: str = "nvlink"
    zellige_s: list[float] = field(default_factory=list)
    plan_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)  # make_plan's thread CPU time
    bound_ratio: list[float] = field(default_factory=list)  # zellige / lower bound
    baseline_ratio: list[float] = field(default_factory=list)  # best baseline / zellige
    best_baseline: list[str] = field(default_factory=list)
    knapformer_ratio: list[float] = field(default_factory=list)  # best knapformer / zellige
    joint_gap: list[float] = field(default_factory=list)  # zellige / joint - 1, joint optimal
    joint_suboptimal_gap: list[float] = field(default_factory=list)  # joint not proven
    joint_runs: int = 0
    sequences: list[int] = field(default_factory=list)


def plan_makespan(planner: str, batch, cost_model, seed: int) -> float:
    try:
        plan = zellige.make_plan(planner, batch, cost_model, zellige.PlannerOptions(seed=seed))
    except ValueError:  # memory refusal, or a spec whose heads do not divide its bags
        return math.inf
    return plan.predicted.makespan_s if plan.predicted.makespan_s > 0 else math.inf


def run_config(config: Config, seeds: int, joint_seeds: int, joint_time_limit_s: float) -> None:
    recipe = zellige.load_recipe(config.recipe)
    cost_model = zellige.make_cost_model(
        recipe.model, config.num_gpus, GPUS_PER_NODE, links=config.links
    )
    names = baselines(config.num_gpus)
    for seed in range(seeds):
        batch = zellige.generate(recipe, config.num_gpus, seed)
        config.sequences.append(len(batch.sequences))
        cpu_start = time.thread_time()
        plan = zellige.make_plan("zellige", batch, cost_model, zellige.PlannerOptions(seed=seed))
        config.cpu_ms.append((time.thread_time() - cpu_start) * 1e3)
        ours = plan.predicted.makespan_s
        config.zellige_s.append(ours)
        config.plan_ms.append(plan.plan_ms)
        config.bound_ratio.append(ours / zellige.makespan_lower_bound(batch, cost_model))
        makespans = {name: plan_makespan(name, batch, cost_model, seed) for name in names}
        best = min(makespans, key=makespans.get)
        config.baseline_ratio.append(makespans[best] / ours)
        config.best_baseline.append(best)
        config.knapformer_ratio.append(
            min(v for k, v in makespans.items() if k.startswith("knapformer")) / ours
        )
        if seed < joint_seeds:
            reference = joint.plan_joint(batch, cost_model, time_limit_s=joint_time_limit_s)
            config.joint_runs += 1
            gap = ours / reference.predicted.makespan_s - 1
            if "optimal=true" in reference.note.split():
                config.joint_gap.append(gap)
            else:
                config.joint_suboptimal_gap.append(gap)


def scale_batch(recipe_name: str, num_gpus: int) -> zellige.Batch:
    """SCALE_SEQUENCES sequences of one recipe: steps of the recipe on num_gpus ranks (seeds 0,
    1, ...) concatenated, renumbered, truncated."""
    recipe = zellige.load_recipe(recipe_name)
    sequences = []
    seed = 0
    while len(sequences) < SCALE_SEQUENCES:
        sequences += list(zellige.generate(recipe, num_gpus, seed).sequences)
        seed += 1
    batch = zellige.Batch()
    batch.sequences = sequences[:SCALE_SEQUENCES]
    for i, sequence in enumerate(batch.sequences):
        sequence.id = i
    return batch


def run_scale(repeats: int) -> list[tuple[str, int, str, str]]:
    rows = []
    for recipe_name in ("opensora2-stage2", "knapformer-joint"):
        recipe = zellige.load_recipe(recipe_name)
        for num_gpus in SCALE_GPUS:
            cost_model = zellige.make_cost_model(recipe.model, num_gpus, GPUS_PER_NODE)
            batch = scale_batch(recipe_name, num_gpus)
            times, cpu_times = [], []
            try:
                for r in range(repeats):
                    cpu_start = time.thread_time()
                    plan = zellige.make_plan(
                        "zellige", batch, cost_model, zellige.PlannerOptions(seed=r)
                    )
                    cpu_times.append((time.thread_time() - cpu_start) * 1e3)
                    times.append(plan.plan_ms)
            except _core.PlanMemoryError:
                rows.append((recipe_name, num_gpus, "batch does not fit in memory", "-"))
                continue
            rows.append(
                (
                    recipe_name,
                    num_gpus,
                    f"{statistics.median(times):.1f} (max {max(times):.1f})",
                    f"{statistics.median(cpu_times):.1f}",
                )
            )
    return rows


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def report(configs: list[Config], pcie: list[Config], scale, args) -> str:
    lines = [
        "Modelled makespan, built-in H200 profile, 8 GPUs per node. zellige/LB: zellige over the "
        "lower bound (median, max). best baseline/zellige: min over batches (>= 1 means never "
        "worse) and the baseline that was best most often. vs joint: zellige over the joint MILP "
        "(mean, worst) on the batches where it proved optimality (proven/run), and the mean over "
        "the others. knapformer/zellige: geomean of the best knapformer spec over zellige. "
        "plan ms: zellige's own wall time (median, p99); cpu ms: make_plan's thread CPU time "
        "(median, p99; includes the memory check, validation and prediction), which preemption "
        "on the shared cores does not inflate.",
        "",
        "| recipe | GPUs | seqs | zellige/LB med | max | best baseline/zellige min | "
        "most often best | vs joint mean | worst | proven | unproven mean | "
        "knapformer/zellige | plan ms med | p99 | cpu ms med | p99 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: | ---: | ---: |",
    ]
    for c in configs:
        proven = len(c.joint_gap)
        joint_mean = f"{100 * statistics.mean(c.joint_gap):+.2f}%" if proven else "-"
        joint_worst = f"{100 * max(c.joint_gap):+.2f}%" if proven else "-"
        unproven = (
            f"{100 * statistics.mean(c.joint_suboptimal_gap):+.2f}%"
            if c.joint_suboptimal_gap
            else "-"
        )
        common = statistics.mode(c.best_baseline)
        lines.append(
            f"| {c.recipe} | {c.num_gpus} | {statistics.median(c.sequences):.0f} | "
            f"{statistics.median(c.bound_ratio):.4f} | {max(c.bound_ratio):.4f} | "
            f"{min(c.baseline_ratio):.4f} | {common} | {joint_mean} | {joint_worst} | "
            f"{proven}/{c.joint_runs} | {unproven} | {geomean(c.knapformer_ratio):.3f} | "
            f"{statistics.median(c.plan_ms):.2f} | {percentile(c.plan_ms, 0.99):.2f} | "
            f"{statistics.median(c.cpu_ms):.2f} | {percentile(c.cpu_ms, 0.99):.2f} |"
        )
    lines += [
        "",
        "Geomean makespan of the best knapformer spec (per batch) over zellige, 32 GPUs:",
        "",
        "| recipe | nvlink | pcie (25 GB/s) |",
        "| --- | ---: | ---: |",
    ]
    for p in pcie:
        nv = next(c for c in configs if c.recipe == p.recipe and c.num_gpus == p.num_gpus)
        lines.append(
            f"| {p.recipe} | {geomean(nv.knapformer_ratio):.3f} | "
            f"{geomean(p.knapformer_ratio):.3f} |"
        )
    lines += [
        "",
        f"Planning time with {SCALE_SEQUENCES} sequences (plan_ms, median of {args.repeats}):",
        "",
        "| recipe | GPUs | zellige plan ms | make_plan cpu ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {recipe} | {gpus} | {text} | {cpu} |" for recipe, gpus, text, cpu in scale]
    lines += [
        "",
        f"seeds: {args.seeds} per recipe and GPU count; joint: first {args.joint_seeds} seeds, "
        f"{args.joint_time_limit} s limit, 1 thread",
        f"machine: {machine()}",
        f"versions: zellige {zellige.__version__}, python {platform.python_version()}, "
        f"highspy {importlib.metadata.version('highspy')}, "
        f"{platform.system()} {platform.release()}",
        f"commit: {git_commit()}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--joint-seeds", type=int, default=6)
    parser.add_argument("--joint-time-limit", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=5, help="planning-time repeats at scale")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    configs, pcie = [], []
    for recipe in args.recipes.split(","):
        for num_gpus in GPU_COUNTS:
            config = Config(recipe=recipe, num_gpus=num_gpus)
            run_config(config, args.seeds, args.joint_seeds, args.joint_time_limit)
            configs.append(config)
            print(f"{recipe} x {num_gpus}: done", file=sys.stderr)
        if recipe in ("knapformer-joint", "opensora2-stage2"):
            config = Config(recipe=recipe, num_gpus=32, links="pcie")
            run_config(config, args.seeds, 0, args.joint_time_limit)
            pcie.append(config)
    scale = run_scale(args.repeats)
    text = report(configs, pcie, scale, args)
    text += f"\nwall time of the whole run: {time.perf_counter() - started:.0f} s"
    if args.out is not None:
        write_report(args.out, "Planner quality", "planner_quality.py", argv, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
