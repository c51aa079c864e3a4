"""Re-predicts the ranks of a `zellige validate-profile --json` report under other profiles, so
the measured times and peaks of one GPU run can be compared with any profile offline.

    python bench/profile_repredict.py REPORT.json --plan-profile P.json [--profile NAME=FILE ...]
        [--head-sweep DETAILS.json]

Plans are re-drawn by name (recipe/GPUs/planner/seed) with --plan-profile (the profile the GPU
run drew them with), then every profile predicts the same ranks; prints MAPEs per profile and a
per-rank table. Every prediction includes the exchanges' local stand-in copies, as
validate-profile now predicts them (validate.local_copy_s); reports written before that have no
`predicted_copy_s` and their drift check compares without copies.

--head-sweep (a `zellige profile --details` file) adds a WHAT-IF column, "heads": the
plan-profile's prediction with each self-attention call's per-head time rescaled from the heads
the profile's attention table was measured with to the heads the engine puts in one call (it
groups a rank's segments by shape: count x heads of the shape), using the profile's own head
sweep. The planner's cost model does not do this. It is a re-prediction of already-measured
ranks, not a validation.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
from collections import Counter

import numpy as np

from zellige import _core
from zellige.costs import make_cost_model
from zellige.profile import load_profile
from zellige.profiler import fit
from zellige.profiler.models import model_spec
from zellige.profiler.validate import local_copy_s
from zellige.workload import load_recipe


def _log_interp(x: float, xs: list[float], ys: list[float]) -> float:
    """Log-log interpolation, held at the ends (as the cost model's tables)."""
    return math.exp(np.interp(math.log(x), np.log(xs), np.log(ys)))


class HeadSweep:
    """Per-head attention time against the heads of one call, from `profile --details`."""

    def __init__(self, details: dict, table_pack_tokens: int, num_heads: int) -> None:
        self.points: dict[int, dict[int, tuple[float, float]]] = {}
        for key, value in details["attention_head_sweep"].items():
            length, heads = (int(part.split("=")[1]) for part in key.split(","))
            self.points.setdefault(length, {})[heads] = (
                value["forward_s_per_head"],
                value["backward_s_per_head"],
            )
        self.pack_tokens, self.num_heads = table_pack_tokens, num_heads

    def table_heads(self, length: int) -> int:
        """Heads per call the attention table was measured with (measure.heads_per_call)."""
        return self.num_heads * max(1, self.pack_tokens // length)

    def ratio(self, length: int, heads: int, backward: bool) -> float:
        """Per-head time at `heads` per call over per-head time at the table's heads; measured at
        the sweep's lengths, interpolated in log length between them, held outside."""
        logs = []
        for sweep_length in sorted(self.points):
            by_heads = self.points[sweep_length]
            counts = sorted(by_heads)
            per_head = [by_heads[h][int(backward)] for h in counts]
            logs.append(
                math.log(
                    _log_interp(heads, counts, per_head)
                    / _log_interp(self.table_heads(length), counts, per_head)
                )
            )
        lengths = np.log(sorted(self.points))
        return math.exp(np.interp(math.log(length), lengths, logs))


def head_sweep_extra_s(profile, sweep: HeadSweep, batch, plan, rank: int, layers: int) -> float:
    """Seconds to add to a rank's self-attention when its calls' per-head time follows the head
    sweep (forward twice under checkpointing, backward once). Local and Ulysses placements only."""
    forward, backward = profile.attention_forward_s_per_head, profile.attention_backward_s_per_head
    by_id = {s.id: s for s in batch.sequences}
    groups: Counter = Counter()
    for placement in plan.placements:
        if rank not in placement.ranks:
            continue
        if placement.ring_degree != 1:
            raise ValueError("--head-sweep: ring placements are not handled")
        heads = sweep.num_heads // placement.ulysses_degree
        groups[(by_id[placement.sequence_id].num_tokens, heads)] += 1
    extra_s = 0.0
    for (length, heads), count in groups.items():
        call_heads = count * heads
        forward_s = _log_interp(length, forward.x, forward.y)
        backward_s = _log_interp(length, backward.x, backward.y)
        extra_s += (
            layers
            * call_heads
            * (
                2.0 * forward_s * (sweep.ratio(length, call_heads, False) - 1.0)
                + backward_s * (sweep.ratio(length, call_heads, True) - 1.0)
            )
        )
    return extra_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("report")
    parser.add_argument("--plan-profile", required=True)
    parser.add_argument("--profile", action="append", default=[], help="NAME=FILE (or NAME=)")
    parser.add_argument("--model", default="wan-14b")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--head-sweep", help="profile --details JSON: adds the 'heads' what-if")
    args = parser.parse_args()
    report = json.load(open(args.report))
    plan_profile = load_profile(args.plan_profile)
    profiles = {"plan-profile": plan_profile}
    sweep = None
    if args.head_sweep:
        details = json.load(open(args.head_sweep))
        sweep = HeadSweep(details, details["pack_tokens"], model_spec(args.model).num_heads)
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
            row["predicted"][label] = (
                rank_cost.linear_s + rank_cost.attention_s + copy_s,
                rank_cost.peak_bytes,
            )
            if label == "plan-profile":
                row["drift_s"] = rank_cost.linear_s + rank_cost.attention_s
                row["drift_s"] += rank.get("predicted_copy_s", 0.0)
        if sweep is not None:
            time_s, peak = row["predicted"]["plan-profile"]
            extra_s = head_sweep_extra_s(
                plan_profile, sweep, batch, plan, rank["rank"], args.layers
            )
            row["predicted"]["heads"] = (time_s + extra_s, peak)
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
    print(
        f"\n{'plan':<42} {'rank':>4} {'tokens':>7} {'seqs':>4} {'measured ms':>11}  "
        + "  ".join(f"{p[:12]:>12}" for p in labels)
    )
    for r in rows:
        rank = r["rank"]
        errors = "  ".join(
            f"{100 * (r['predicted'][p][0] / rank['measured_s'] - 1):>+11.1f}%" for p in labels
        )
        print(
            f"{rank['plan']:<42} {rank['rank']:>4} {rank['tokens']:>7} {rank['num_sequences']:>4} "
            f"{rank['measured_s'] * 1e3:>11.1f}  {errors}"
        )
    print(f"\nmachine: {platform.node()} (CPU, re-prediction only); {len(rows)} ranks")


if __name__ == "__main__":
    main()
