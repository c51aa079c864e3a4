"""Re-predicts the ranks of a `zellige validate-profile --json` report under other profiles, so
the measured times and peaks of one GPU run can be compared with any profile offline.

    python bench/profile_repredict.py REPORT.json [MORE.jsonl ...] --plan-profile P.json \
        [--profile NAME=FILE ...]

REPORT: a `--json` report, or `--results-jsonl` files (one rank a line; several are joined).
Plans are re-drawn by name (recipe/GPUs/planner/seed) with --plan-profile (the profile the GPU
run drew them with), then every profile predicts the same ranks; prints MAPEs per profile and a
per-rank table. Every prediction includes the exchanges' local stand-in copies, as
validate-profile now predicts them (validate.local_copy_s); reports written before that have no
`predicted_copy_s` and their drift check compares without copies.
"""

from __future__ import annotations

import argparse
import json
import platform

from zellige import _core
from zellige.costs import make_cost_model
from zellige.profile import load_profile
from zellige.profiler import fit
from zellige.profiler.models import model_spec
from zellige.profiler.validate import (
    SIZE_CLASSES,
    harness_peak_model,
    local_copy_s,
    predicted_rank_s,
)
from zellige.workload import load_recipe


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="+")
    parser.add_argument("--plan-profile", required=True)
    parser.add_argument("--profile", action="append", default=[], help="NAME=FILE (or NAME=)")
    parser.add_argument("--model", default="wan-14b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--with-gradients",
        action="store_true",
        help="predict peaks with training's gradients added over the backward, as "
        "validate-profile did before it left them out of both sides (harness_peak_model)",
    )
    args = parser.parse_args()
    report = {"ranks": []}
    for path in args.report:
        with open(path) as f:
            if path.endswith(".jsonl"):
                report["ranks"] += [json.loads(line) for line in f if line.strip()]
            else:
                report["ranks"] += json.load(f)["ranks"]
    plan_profile = load_profile(args.plan_profile)
    profiles = {"plan-profile": plan_profile}
    for item in args.profile:
        name, _, path = item.partition("=")
        profiles[name] = load_profile(path or None)
    full, reduced = model_spec(args.model), model_spec(args.model, args.layers)
    plans = {}
    rows = []
    for rank in report["ranks"]:
        name = rank["plan"]
        if name not in plans:
            recipe, gpus, planner, seed = name.split("/")
            batch = _core.generate_batch(load_recipe(recipe), int(gpus), int(seed))
            cost = make_cost_model(full, gpus=int(gpus), profile=plan_profile)
            plans[name] = (batch, _core.make_plan(planner, batch, cost))
        batch, plan = plans[name]
        row = {"rank": rank, "predicted": {}}
        for label, profile in profiles.items():
            cost = make_cost_model(reduced, gpus=plan.num_ranks, profile=profile)
            rank_cost = cost.evaluate(batch, plan).ranks[rank["rank"]]
            copy_s = local_copy_s(cost, batch, plan, rank["rank"], profile.memory_bytes_per_s)
            peak_model = (
                cost
                if args.with_gradients
                else harness_peak_model(reduced, plan.num_ranks, profile, True)
            )
            peak_bytes = peak_model.evaluate(batch, plan).ranks[rank["rank"]].peak_bytes
            row["predicted"][label] = (predicted_rank_s(rank_cost, copy_s), peak_bytes)
            if label == "plan-profile":
                row["drift_s"] = predicted_rank_s(rank_cost, rank.get("predicted_copy_s", 0.0))
        rows.append(row)
    measured_s = [r["rank"]["measured_s"] for r in rows]
    measured_b = [r["rank"]["measured_peak_bytes"] for r in rows]
    drift = max(abs(r["drift_s"] / r["rank"]["predicted_s"] - 1) for r in rows)
    labels = list(rows[0]["predicted"])
    print(f"re-drawn plans reproduce the report's predictions within {drift:.1e} (relative)")
    print(f"{'profile':<14} {'time MAPE':>10} {'memory MAPE':>12}")
    for label in labels:
        time_mape = fit.mape_percent([r["predicted"][label][0] for r in rows], measured_s)
        memory_mape = fit.mape_percent([r["predicted"][label][1] for r in rows], measured_b)
        print(f"{label:<14} {time_mape:>9.2f}% {memory_mape:>11.2f}%")
    for label in labels:  # by rank size (validate.SIZE_CLASSES)
        parts = []
        for size, least in SIZE_CLASSES:
            upper = min([b for _, b in SIZE_CLASSES if b > least], default=None)
            members = [
                r for r in rows
                if r["rank"]["tokens"] >= least and (upper is None or r["rank"]["tokens"] < upper)
            ]  # fmt: skip
            if members:
                time_mape = fit.mape_percent(
                    [r["predicted"][label][0] for r in members],
                    [r["rank"]["measured_s"] for r in members],
                )
                parts.append(f"{size} ({len(members)}): {time_mape:.2f}%")
        print(f"{label:<14} time MAPE by size: " + ", ".join(parts))
    for what, index, measured_key, unit, scale in (
        ("time", 0, "measured_s", "ms", 1e3),
        ("peak memory", 1, "measured_peak_bytes", "GiB", 2**-30),
    ):
        print(
            f"\n{what}: predicted / measured - 1\n{'plan':<42} {'rank':>4} {'tokens':>7} "
            f"{'seqs':>4} {'measured ' + unit:>12}  " + "  ".join(f"{p[:12]:>12}" for p in labels)
        )
        for r in rows:
            rank = r["rank"]
            errors = "  ".join(
                f"{100 * (r['predicted'][p][index] / rank[measured_key] - 1):>+11.1f}%"
                for p in labels
            )
            print(
                f"{rank['plan']:<42} {rank['rank']:>4} {rank['tokens']:>7} "
                f"{rank['num_sequences']:>4} {rank[measured_key] * scale:>12.2f}  {errors}"
            )
    print(f"\nmachine: {platform.node()} (CPU, re-prediction only); {len(rows)} ranks")


if __name__ == "__main__":
    main()
