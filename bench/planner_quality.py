"""Planner quality: zellige against every baseline, the best known plan and the lower bound.

Per workload family and GPU count (16, 32; 8 per node, built-in H200 profile; NVLink, and PCIe-class
links at 32 GPUs for two families), `--seeds` seeded batches. Families: four recipes
(opensora2-stage2, wan-stage2, wan-stage3, knapformer-joint) and two synthetic shapes that broke
the planner: many-equal-long (many sequences of one long length plus medium and
short ones) and few-huge (a few 150k-300k-token videos next to 40k-200k ones); and, when named in
`--families`, the held-out families of planning_time.py (HELD_OUT_FAMILIES) at 8 and 16 GPUs,
where the joint MILP is the reference. Each batch is
planned by zellige and by every baseline (`zellige.covered_baselines` plus the historical list),
priced by the cost model. The joint MILP (HiGHS, one thread, `--joint-time-limit` s, warm-started
from zellige) runs on the first `--joint-seeds` seeds; the best known plan of a batch is the
fastest of zellige, every baseline and the joint plan.

Reported per family: best-baseline / zellige (geomean, worst = min; >= 1 means never worse),
zellige / best known (geomean, worst = max), zellige / lower bound (median, max), zellige's peak
memory against the best baseline's, and zellige's make_plan thread CPU time (median).

    PYTHONPATH=src python bench/planner_quality.py [--seeds 10] [--joint-seeds 2]
        [--joint-time-limit 20] [--out bench/results/planner_quality_cpu2_202612.md]
"""

from __future__ import annotations

import argparse
import importlib.metadata
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
from planning_time import HELD_OUT_FAMILIES, held_out_batch
from zellige import _core, joint

RECIPES = ["opensora2-stage2", "wan-stage2", "wan-stage3", "knapformer-joint"]
SYNTHETIC = {"many-equal-long": "wan-14b", "few-huge": "wan-14b"}
GPU_COUNTS = [16, 32]
# The held-out families (planning_time.py) at the small sizes where the joint MILP is a reference.
HELD_OUT_GPU_COUNTS = [8, 16]
GPUS_PER_NODE = 8
PCIE_FAMILIES = ["opensora2-stage2", "many-equal-long"]


def historical_baselines(num_gpus: int) -> list[str]:
    """The baselines earlier reports compared against (bags of 1..8 GPUs, mixed specs)."""
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
    static = [f"static-cp:{c}" for c in (2, 4, 8) if num_gpus % c == 0]
    knapformer = [f"knapformer:{spec}" for spec in homogeneous + mixed]
    return ["dp-tokens", "dp-cost", *static, "megatron-dcp", *knapformer]


def synthetic_batch(family: str, num_gpus: int, seed: int) -> zellige.Batch:
    rng = random.Random(f"{family}-{num_gpus}-{seed}")
    lengths: list[int] = []
    if family == "many-equal-long":
        long_tokens = rng.randint(50000, 80000)
        lengths += [long_tokens] * rng.randint(num_gpus // 2, num_gpus)
        lengths += [rng.randint(8000, 30000) for _ in range(rng.randint(num_gpus // 2, num_gpus))]
        lengths += [rng.randint(256, 4096) for _ in range(rng.randint(num_gpus, 2 * num_gpus))]
    elif family == "few-huge":
        lengths += [rng.randint(200000, 290000) for _ in range(rng.randint(2, 4))]
        lengths += [rng.randint(60000, 200000) for _ in range(rng.randint(2, num_gpus // 4))]
    else:
        raise ValueError(f"unknown family {family}")
    batch = zellige.Batch()
    batch.sequences = [
        zellige.sequence_from_tokens(i, "video", n, 512, i % num_gpus)
        for i, n in enumerate(lengths)
    ]
    return batch


@dataclass(kw_only=True, slots=True)
class Config:
    family: str
    num_gpus: int
    links: str = "nvlink"
    baseline_ratio: list[float] = field(default_factory=list)  # best baseline / zellige
    best_baseline: list[str] = field(default_factory=list)
    known_ratio: list[float] = field(default_factory=list)  # zellige / best known
    joint_ratio: list[float] = field(default_factory=list)  # zellige / joint (joint seeds)
    joint_proven: int = 0
    joint_runs: int = 0
    joint_errors: list[str] = field(default_factory=list)
    bound_ratio: list[float] = field(default_factory=list)  # zellige / lower bound
    peak_gib: list[float] = field(default_factory=list)
    baseline_peak_gib: list[float] = field(default_factory=list)  # of the best baseline
    cpu_ms: list[float] = field(default_factory=list)
    sequences: list[int] = field(default_factory=list)


def priced(planner: str, batch, cost_model, seed: int) -> tuple[float, float]:
    """(makespan s, peak GiB), or (inf, inf) when the planner refuses."""
    try:
        plan = zellige.make_plan(planner, batch, cost_model, zellige.PlannerOptions(seed=seed))
    except ValueError:  # memory refusal, or a spec whose heads do not divide its bags
        return math.inf, math.inf
    return plan.predicted.makespan_s, max(plan.predicted.rank_peak_bytes) / (1 << 30)


def run_config(config: Config, seeds: int, joint_seeds: int, joint_time_limit_s: float) -> None:
    if config.family in SYNTHETIC:
        model = SYNTHETIC[config.family]
    elif config.family in HELD_OUT_FAMILIES:
        model = HELD_OUT_FAMILIES[config.family]
    else:
        recipe = zellige.load_recipe(config.family)
        model = recipe.model
    cost_model = zellige.make_cost_model(model, config.num_gpus, GPUS_PER_NODE, links=config.links)
    for seed in range(seeds):
        if config.family in SYNTHETIC:
            batch = synthetic_batch(config.family, config.num_gpus, seed)
        elif config.family in HELD_OUT_FAMILIES:
            batch = held_out_batch(config.family, config.num_gpus, seed)
        else:
            batch = zellige.generate(recipe, config.num_gpus, seed)
        config.sequences.append(len(batch.sequences))
        cpu_start = time.thread_time()
        plan = zellige.make_plan("zellige", batch, cost_model, zellige.PlannerOptions(seed=seed))
        config.cpu_ms.append((time.thread_time() - cpu_start) * 1e3)
        ours = plan.predicted.makespan_s
        config.peak_gib.append(max(plan.predicted.rank_peak_bytes) / (1 << 30))
        config.bound_ratio.append(ours / zellige.makespan_lower_bound(batch, cost_model))
        names = dict.fromkeys(
            historical_baselines(config.num_gpus) + _core.covered_baselines(batch, cost_model)
        )
        results = {name: priced(name, batch, cost_model, seed) for name in names}
        best = min(results, key=lambda name: results[name][0])
        config.baseline_ratio.append(results[best][0] / ours)
        config.best_baseline.append(best)
        config.baseline_peak_gib.append(results[best][1])
        known = min(ours, results[best][0])
        if seed < joint_seeds:
            config.joint_runs += 1
            try:
                reference = joint.plan_joint(batch, cost_model, time_limit_s=joint_time_limit_s)
            except TimeoutError as error:
                config.joint_errors.append(str(error).split(";")[0])
            else:
                config.joint_ratio.append(ours / reference.predicted.makespan_s)
                config.joint_proven += "optimal=true" in reference.note.split()
                known = min(known, reference.predicted.makespan_s)
        config.known_ratio.append(ours / known)


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def report(configs: list[Config], args) -> str:
    lines = [
        "Modelled makespan (cost model, built-in H200 profile), 8 GPUs per node. "
        "baseline/zellige: the best baseline's makespan over zellige's, per batch (geomean, "
        "worst = min; >= 1 means zellige is never worse). zellige/known: over the best known "
        "plan (fastest of zellige, every baseline and, on the joint seeds, the joint MILP; "
        "geomean, worst = max). zellige/joint: over the joint MILP's plan (geomean; proven = "
        "runs where the MILP proved optimality over its candidates). zellige/LB: over the lower "
        "bound (median, max). peak GiB: zellige's and the best baseline's peak memory "
        "(medians). cpu ms: make_plan's thread CPU time for zellige (median).",
        "",
        "| family | links | GPUs | seqs | baseline/zellige geo | worst | most often best | "
        "zellige/known geo | worst | zellige/joint geo | proven | zellige/LB med | max | "
        "peak GiB | baseline peak | cpu ms |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | "
        "---: | ---: | ---: | ---: |",
    ]
    for c in configs:
        joint_geo = f"{geomean(c.joint_ratio):.4f}" if c.joint_ratio else "-"
        lines.append(
            f"| {c.family} | {c.links} | {c.num_gpus} | {statistics.median(c.sequences):.0f} | "
            f"{geomean(c.baseline_ratio):.4f} | {min(c.baseline_ratio):.4f} | "
            f"{statistics.mode(c.best_baseline)} | {geomean(c.known_ratio):.4f} | "
            f"{max(c.known_ratio):.4f} | {joint_geo} | {c.joint_proven}/{c.joint_runs} | "
            f"{statistics.median(c.bound_ratio):.4f} | {max(c.bound_ratio):.4f} | "
            f"{statistics.median(c.peak_gib):.1f} | {statistics.median(c.baseline_peak_gib):.1f} | "
            f"{statistics.median(c.cpu_ms):.1f} |"
        )
    errors = [f"{c.family} x {c.num_gpus}: {e}" for c in configs for e in c.joint_errors]
    if errors:
        lines += ["", "Joint MILP runs that found no plan within the limit:", ""]
        lines += [f"- {e}" for e in errors]
    lines += [
        "",
        f"seeds: {args.seeds} per family, links and GPU count; joint: first {args.joint_seeds} "
        f"seeds, {args.joint_time_limit} s limit, 1 thread, warm-started from zellige",
        f"machine: {machine()} (shared with other jobs: CPU times, not wall times)",
        f"versions: zellige {zellige.__version__}, python {platform.python_version()}, "
        f"highspy {importlib.metadata.version('highspy')}, "
        f"{platform.system()} {platform.release()}",
        f"commit: {git_commit()}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--joint-seeds", type=int, default=2)
    parser.add_argument("--joint-time-limit", type=float, default=20.0)
    parser.add_argument("--families", default=",".join(RECIPES + list(SYNTHETIC)))
    parser.add_argument("--out", type=Path, default=None, help="also write the report (markdown)")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    configs = []
    for family in args.families.split(","):
        for num_gpus in HELD_OUT_GPU_COUNTS if family in HELD_OUT_FAMILIES else GPU_COUNTS:
            config = Config(family=family, num_gpus=num_gpus)
            run_config(config, args.seeds, args.joint_seeds, args.joint_time_limit)
            configs.append(config)
            print(f"{family} x {num_gpus}: done", file=sys.stderr)
        if family in PCIE_FAMILIES:
            config = Config(family=family, num_gpus=32, links="pcie")
            run_config(config, args.seeds, 0, args.joint_time_limit)
            configs.append(config)
    text = report(configs, args)
    text += f"\nwall time of the whole run: {time.perf_counter() - started:.0f} s"
    if args.out is not None:
        write_report(args.out, "Planner quality", "planner_quality.py", argv, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
