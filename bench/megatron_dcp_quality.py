"""megatron-dcp against dp-cost, the other baselines and zellige, on planner_quality.py's batches.

Per family and GPU count (the same seeded batches, cost model and baseline list as
bench/planner_quality.py): megatron-dcp / dp-cost (geomean, max; < 1 means megatron-dcp shards
what dp-cost keeps whole), megatron-dcp / best other baseline (geomean), zellige / megatron-dcp
(geomean, max; <= 1 is the never-worse promise), over the seeds megatron-dcp places in memory
(dp-cost ratios only where dp-cost does too; '-': none); how often megatron-dcp is the best
baseline, and its make_plan thread CPU time (median).

    PYTHONPATH=src python bench/megatron_dcp_quality.py [--seeds 3] [--gpus 8,16,32]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import zellige
from _provenance import header, print_header
from planner_quality import (
    PCIE_FAMILIES,
    RECIPES,
    SYNTHETIC,
    geomean,
    historical_baselines,
    priced,
    synthetic_batch,
)
from zellige import _core


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--gpus", default="8,16,32")
    parser.add_argument("--families", default=",".join(RECIPES + list(SYNTHETIC)))
    args = parser.parse_args(argv)
    print_header(header("megatron_dcp_quality.py", argv))
    print(
        "| family | links | GPUs | dcp/dp-cost geo | max | dcp/best other geo | "
        "zellige/dcp geo | max | dcp best | dcp cpu ms |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for family in args.families.split(","):
        configs = [(int(g), "nvlink") for g in args.gpus.split(",")]
        if family in PCIE_FAMILIES:
            configs.append((32, "pcie"))
        for num_gpus, links in configs:
            model = SYNTHETIC.get(family) or zellige.load_recipe(family).model
            cost_model = zellige.make_cost_model(model, num_gpus, 8, links=links)
            vs_dp, vs_other, ours, best_count, cpu_ms = [], [], [], 0, []
            for seed in range(args.seeds):
                if family in SYNTHETIC:
                    batch = synthetic_batch(family, num_gpus, seed)
                else:
                    batch = zellige.generate(zellige.load_recipe(family), num_gpus, seed)
                start = time.thread_time()
                dcp, _ = priced("megatron-dcp", batch, cost_model, seed)
                cpu_ms.append((time.thread_time() - start) * 1e3)
                names = dict.fromkeys(
                    historical_baselines(num_gpus) + _core.covered_baselines(batch, cost_model)
                )
                names.pop("megatron-dcp", None)
                others = {name: priced(name, batch, cost_model, seed)[0] for name in names}
                zellige_s, _ = priced("zellige", batch, cost_model, seed)
                if math.isinf(dcp):  # refused for memory: no ratio to report
                    continue
                if not math.isinf(others["dp-cost"]):
                    vs_dp.append(dcp / others["dp-cost"])
                vs_other.append(dcp / min(others.values()))
                ours.append(zellige_s / dcp)
                best_count += dcp <= min(others.values())

            def stat(values: list[float], how) -> str:
                return f"{how(values):.4f}" if values else "-"

            print(
                f"| {family} | {links} | {num_gpus} | {stat(vs_dp, geomean)} | {stat(vs_dp, max)} "
                f"| {stat(vs_other, geomean)} | {stat(ours, geomean)} | {stat(ours, max)} | "
                f"{best_count}/{args.seeds} | {statistics.median(cpu_ms):.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
