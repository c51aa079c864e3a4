"""Re-predicts the ranks of a `zellige validate-profile --json` report under other profiles, so
the measured times and peaks of one GPU run can be compared with any profile offline.

    python bench/profile_repredict.py REPORT.json|RANKS.jsonl ... --plan-profile P.json \
        [--profile NAME=FILE ...]

Plans are re-drawn by name (recipe/GPUs/planner/seed) with --plan-profile (the profile the GPU
run drew them with), then every profile predicts the same ranks; prints MAPEs per profile and a
per-rank table, then the time and memory MAPEs by class of rank (token count, mixed
strategies, Ulysses), and the launch-floor ranks with the host's issue time of a step where
the report recorded it (`host_issue_s`).
Reports: a `--json` report, or the per-rank `--results-jsonl` files (several are joined). Every
prediction includes the exchanges' local stand-in copies, as
validate-profile predicts them (validate.local_copy_s); a report without `predicted_copy_s` has
its drift check compare without copies.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from zellige import _core
from zellige.costs import make_cost_model
from zellige.profile import load_profile
from zellige.profiler import fit
from zellige.profiler.models import model_spec
from zellige.profiler.validate import (
    harness_peak_model,
    launch_floor,
    local_copy_s,
    predicted_rank_s,
)
from zellige.workload import load_recipe

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _provenance, also when loaded by path
from _provenance import header, print_header  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report", nargs="+", help="a --json report or --results-jsonl files")
    parser.add_argument("--plan-profile", required=True)
    parser.add_argument("--profile", action="append", default=[], help="NAME=FILE (or NAME=)")
    parser.add_argument("--model", default="wan-14b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument(
        "--with-gradients",
        action="store_true",
        help="predict peaks with training's gradients added over the backward (validate-profile "
        "leaves them out of both sides: harness_peak_model)",
    )
    args = parser.parse_args()
    print_header(header("profile_repredict.py"))
    report = {"ranks": [rank for path in args.report for rank in _ranks(path)]}
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
                else harness_peak_model(reduced, plan.num_ranks, profile, cost.options)
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
    for what, index, measured_key in (
        ("time", 0, "measured_s"),
        ("memory", 1, "measured_peak_bytes"),
    ):
        print(
            f"\n{what} MAPE by class of rank\n{'class':<26} {'ranks':>5}  "
            + "  ".join(f"{p[:12]:>12}" for p in labels)
        )
        for name, member in RANK_CLASSES:
            chosen = [r for r in rows if member(r["rank"])]
            if not chosen:
                continue
            measured = [r["rank"][measured_key] for r in chosen]
            mapes = "  ".join(
                f"{fit.mape_percent([r['predicted'][p][index] for r in chosen], measured):>11.2f}%"
                for p in labels
            )
            print(f"{name:<26} {len(chosen):>5}  {mapes}")
    floor = [
        r["rank"]
        for r in rows
        if launch_floor(r["rank"]["predicted_s"], r["rank"].get("predicted_busy_s", 0.0))
    ]
    if floor:
        print(
            "\nlaunch-floor ranks, as the report predicted them: ms of the floor, predicted, "
            "measured, and the host's issue time of a step (not recorded in older reports)\n"
            f"{'plan':<42} {'rank':>4} {'tokens':>7} {'floor':>8} {'predicted':>10} "
            f"{'measured':>9} {'host issue':>10}"
        )
    for rank in floor:
        issue = rank.get("host_issue_s")
        print(
            f"{rank['plan']:<42} {rank['rank']:>4} {rank['tokens']:>7} "
            f"{rank.get('predicted_launch_floor_s', 0.0) * 1e3:>8.2f} "
            f"{rank['predicted_s'] * 1e3:>10.2f} {rank['measured_s'] * 1e3:>9.2f} "
            + (f"{issue * 1e3:>10.2f}" if issue is not None else f"{'-':>10}")
        )
    print(f"\nmachine: {platform.node()} (CPU, re-prediction only); {len(rows)} ranks")


def _ranks(path: str) -> list[dict]:
    with open(path) as f:
        if path.endswith(".jsonl"):
            return [json.loads(line) for line in f if line.strip()]
        return json.load(f)["ranks"]


def _kinds(rank: dict) -> set[str]:
    """The strategies of a rank's sequences ("local x10, ring x2" -> {local, ring}); reports
    written before they were recorded have none."""
    return {part.split()[0] for part in rank.get("strategies", "").split(",") if part.strip()}


RANK_CLASSES = (
    ("all", lambda rank: True),
    (">= 20k tokens", lambda rank: rank["tokens"] >= 20000),
    ("2k-20k tokens", lambda rank: 2000 <= rank["tokens"] < 20000),
    ("< 2k tokens", lambda rank: rank["tokens"] < 2000),
    ("mixed (local and shards)", lambda rank: len(_kinds(rank)) > 1),
    ("Ulysses (any)", lambda rank: "ulysses" in _kinds(rank)),
    ("Ulysses only", lambda rank: _kinds(rank) == {"ulysses"}),
)


if __name__ == "__main__":
    main()
