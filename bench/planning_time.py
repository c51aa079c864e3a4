"""Planning time of every planner at 8, 32, 128 and 1024 GPUs on recipe batches.

For each GPU count and seed, one step's batch is generated from the recipe (a bucketed loader on
every rank) and each planner plans it. The table reports the median over seeds of the planner's
own wall time (`plan_ms`, the policy alone) and of the whole `make_plan` call (name parsing,
memory check, validation and prediction included), plus the makespan over the lower bound so a
fast planner cannot hide a bad plan.

    PYTHONPATH=src python bench/planning_time.py [--gpus 8,32,128,1024] [--seeds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
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
            start = time.perf_counter()
            try:
                plan = zellige.make_plan(name, batch, cost_model, zellige.PlannerOptions(seed=seed))
            except ValueError as error:  # not built yet, or a memory refusal: say so in the row
                row.note = str(error).splitlines()[0]
                continue
            row.call_ms.append((time.perf_counter() - start) * 1e3)
            row.plan_ms.append(plan.plan_ms)
            row.num_sequences.append(len(batch.sequences))
            row.ratio_to_bound.append(plan.predicted.makespan_s / lower_bound_s)
    return list(rows.values())


def table(rows: list[Row], workload: str, seeds: int) -> str:
    lines = [
        f"Planning time on {workload} batches, median over {seeds} seeds",
        "",
        "| GPUs | sequences | planner | plan_ms | make_plan ms | makespan / lower bound |",
        "| ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        if row.note:
            lines.append(f"| {row.num_gpus} | | {row.planner} | - | - | {row.note} |")
            continue
        lines.append(
            f"| {row.num_gpus} | {statistics.median(row.num_sequences):.0f} | {row.planner} | "
            f"{statistics.median(row.plan_ms):.3f} | {statistics.median(row.call_ms):.3f} | "
            f"{statistics.median(row.ratio_to_bound):.3f} |"
        )
    lines += [
        "",
        f"machine: {machine()}",
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
    parser.add_argument("--out", type=Path, default=None, help="also write the table (markdown)")
    args = parser.parse_args(argv)

    rows: list[Row] = []
    for num_gpus in (int(n) for n in args.gpus.split(",")):
        rows += measure(args.workload, args.model, num_gpus, args.seeds)
        print(f"measured {num_gpus} GPUs", file=sys.stderr)
    text = table(rows, args.workload, args.seeds)
    if args.out is not None:
        write_report(args.out, "Planning time", "planning_time.py", argv, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
