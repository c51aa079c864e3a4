"""Plans on unlike ranks: zellige against every baseline on mixed and throttled clusters.

Predicted step times (the cost model, no GPU) of one step per workload recipe and seed, on 32 and
256 GPUs (8 per node, NVLink) of two kinds of cluster (zellige.cluster_file):
- mixed: half the nodes H100, half H200 (the built-in profiles), priced with the H200 profile;
  each H100 rank at its speed from the profiles (cluster_file.node_speed) and with its 80 GB;
- throttled: H200 nodes, one of them at 0.7x speed;
- and, for reference, like: H200 nodes only (what zellige gains over the baselines anyway).
The baselines plan as on a cluster of like ranks with the smallest memory (they know nothing of
speeds) and are priced on the real one; zellige plans on the real one. Reported per row: the best
baseline (of zellige.api.default_planners, the `zellige compare` set), zellige planned blind (on
the like-rank view, as the baselines plan) and priced on the real cluster, zellige, the speed-up
(best baseline / zellige), zellige over the lower bound of this cluster, and zellige over the
homogeneous lower bound scaled by capacity: the bound on the same GPU count of the planning
device, times GPUs / total speed (what a perfectly balanced plan of the same work would take if
the speeds were spread evenly). Targets: >= 1.2x the best baseline on the mixed
cluster, within 5% of the scaled bound.

    PYTHONPATH=src python bench/heterogeneous.py [--gpus 32,256] [--seeds 2]
        [--out bench/results/heterogeneous_cpu2_202612.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path

from _provenance import header, print_header, write_report
from zellige import _core
from zellige.api import default_planners, make_setup
from zellige.cluster_file import ClusterFile, NodeGroup
from zellige.workload import recipe_names

GPUS_PER_NODE = 8
THROTTLED_SPEED = 0.7


def cluster_files(num_gpus: int) -> dict[str, ClusterFile]:
    """The two clusters of `num_gpus` GPUs, as a cluster file would give them."""
    nodes = num_gpus // GPUS_PER_NODE

    def cluster(name: str, *groups: NodeGroup) -> ClusterFile:
        return ClusterFile(
            path=name,
            gpus_per_node=GPUS_PER_NODE,
            links="nvlink",
            nodes=groups,
            rank_speeds=None,
            rank_memory_gib=None,
        )

    def group(count: int, profile: str, speed: float | None = None) -> NodeGroup:
        return NodeGroup(count=count, profile=profile, memory_gib=None, speed=speed)

    return {
        "like": cluster("like", group(nodes, "h200")),
        "mixed": cluster("mixed", group(nodes // 2, "h100"), group(nodes - nodes // 2, "h200")),
        "throttled": cluster(
            "throttled", group(1, "h200", THROTTLED_SPEED), group(nodes - 1, "h200")
        ),
    }


@dataclasses.dataclass(kw_only=True, slots=True)
class Row:
    cluster: str
    gpus: int
    workload: str
    seed: int
    total_speed: float
    best_baseline: str
    best_baseline_s: float
    blind_s: float  # zellige planned on the like-rank view, priced on this cluster
    zellige_s: float
    bound_s: float  # this cluster's lower bound
    scaled_bound_s: float  # the homogeneous bound x GPUs / total speed
    zellige_ms: float

    @property
    def speedup(self) -> float:
        return self.best_baseline_s / self.zellige_s


def run_one(workload: str, num_gpus: int, seed: int, name: str, spec: ClusterFile) -> Row:
    setup = make_setup(workload, num_gpus, gpus_per_node=GPUS_PER_NODE, seed=seed)
    homogeneous = setup.cost_model
    cluster = spec.to_cluster(homogeneous.model, homogeneous.profile)
    cost_model = _core.CostModel(
        homogeneous.model, homogeneous.profile, cluster, homogeneous.options
    )
    batch = setup.batch
    best_name, best_s = "none", math.inf
    zellige_s, zellige_ms = math.inf, math.nan
    for planner in default_planners(num_gpus, GPUS_PER_NODE):
        try:
            plan = _core.make_plan(planner, batch, cost_model, _core.PlannerOptions(seed=seed))
        except _core.PlanMemoryError:
            continue
        makespan_s = plan.predicted.makespan_s
        if planner == "zellige":
            zellige_s, zellige_ms = makespan_s, plan.plan_ms
        elif makespan_s < best_s:
            best_name, best_s = planner, makespan_s
    options = _core.PlannerOptions(seed=seed)
    blind = _core.make_plan("zellige", batch, cost_model.homogeneous_view(), options)
    blind_s = cost_model.evaluate(batch, blind).makespan_s
    total_speed = cluster.total_speed()
    return Row(
        cluster=name,
        gpus=num_gpus,
        workload=workload,
        seed=seed,
        total_speed=total_speed,
        best_baseline=best_name,
        best_baseline_s=best_s,
        blind_s=blind_s,
        zellige_s=zellige_s,
        bound_s=_core.makespan_lower_bound(batch, cost_model),
        scaled_bound_s=_core.makespan_lower_bound(batch, homogeneous) * num_gpus / total_speed,
        zellige_ms=zellige_ms,
    )


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| cluster | GPUs | total speed | workload | seed | best baseline | baseline s "
        "| zellige blind s | zellige s | speed-up | zellige / bound "
        "| zellige / scaled homogeneous bound | zellige ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row.cluster} | {row.gpus} | {row.total_speed:.2f} | {row.workload} | {row.seed} "
            f"| {row.best_baseline} | {row.best_baseline_s:.3f} | {row.blind_s:.3f} "
            f"| {row.zellige_s:.3f} "
            f"| {row.speedup:.3f} | {row.zellige_s / row.bound_s:.3f} "
            f"| {row.zellige_s / row.scaled_bound_s:.3f} | {row.zellige_ms:.0f} |"
        )
    return lines


def summary(rows: list[Row]) -> list[str]:
    lines = [
        "| cluster | GPUs | speed-up geomean (min, max) | rows >= 1.2x "
        "| blind / zellige geomean (max) | zellige / scaled bound median (max) | rows within 5% |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.cluster, row.gpus), []).append(row)
    for (name, gpus), group in groups.items():
        speedups = [row.speedup for row in group]
        scaled = [row.zellige_s / row.scaled_bound_s for row in group]
        awareness = [row.blind_s / row.zellige_s for row in group]
        lines.append(
            f"| {name} | {gpus} | {statistics.geometric_mean(speedups):.3f} "
            f"({min(speedups):.3f}, {max(speedups):.3f}) "
            f"| {sum(s >= 1.2 for s in speedups)} of {len(group)} "
            f"| {statistics.geometric_mean(awareness):.3f} ({max(awareness):.3f}) "
            f"| {statistics.median(scaled):.3f} ({max(scaled):.3f}) "
            f"| {sum(s <= 1.05 for s in scaled)} of {len(group)} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="32,256", help="GPU counts, comma-separated")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per workload")
    parser.add_argument("--workloads", default=",".join(recipe_names()), help="recipes")
    parser.add_argument("--out", type=Path, help="write the markdown report here")
    args = parser.parse_args(argv)
    provenance = header("heterogeneous.py", argv)
    print_header(provenance)
    rows = []
    for num_gpus in (int(text) for text in args.gpus.split(",")):
        for name, spec in cluster_files(num_gpus).items():
            for workload in args.workloads.split(","):
                for seed in range(args.seeds):
                    start = time.perf_counter()
                    row = run_one(workload, num_gpus, seed, name, spec)
                    rows.append(row)
                    print(
                        f"{name} {num_gpus} {workload} seed {seed}: speed-up {row.speedup:.3f}, "
                        f"zellige / scaled bound {row.zellige_s / row.scaled_bound_s:.3f} "
                        f"({time.perf_counter() - start:.1f} s)",
                        flush=True,
                    )
    lines = ["", *table(rows), "", *summary(rows)]
    for line in lines:
        print(line)
    if args.out is not None:
        text = "\n".join(f"- {key}: {value}" for key, value in provenance.items())
        write_report(
            args.out,
            "Plans on unlike ranks (predicted step times)",
            "heterogeneous.py",
            argv,
            text + "\n" + "\n".join(lines),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
