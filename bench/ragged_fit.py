"""How a profile's per-head attention tables predict one ragged call over a pack.

Reads measured ragged-call times of the packs of bench/attention_engine.py (make_pack 98304,
seed 0, 24 heads x 128) and prints, per pack, the measured forward and backward time against
the rule the cost model prices a ragged table with (profile attention_ragged): every segment at
the per-head tables, no call's excess. Two inputs are read:
  - a kernel-level probe (a JSON list of rows with "recipe", "joint" and "desc-heuristic-AUTO":
    [forward ms, backward ms, ...], the ragged call as the engine issues it);
  - bench/ragged_pricing.py's JSON (packs with "lengths" and "ragged" {"forward_s",
    "backward_s"}: the step program's local table as one ragged call).

    python bench/ragged_fit.py MEASURED.json [--profile PROFILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

from attention_engine import make_pack
from zellige.profile import load_profile

HEADS, HEAD_DIM = 24, 128


def rows_of(data) -> list[tuple[str, bool, list[int], float, float]]:
    """(recipe, joint, lengths, forward s, backward s) of every pack measured."""
    if isinstance(data, list):  # the kernel-level probe
        return [
            (
                row["recipe"],
                row["joint"],
                make_pack(row["recipe"], 98304, 0, row["joint"]),
                row["desc-heuristic-AUTO"][0] / 1e3,
                row["desc-heuristic-AUTO"][1] / 1e3,
            )
            for row in data
        ]
    rows = []
    for p in data["packs"]:
        ragged = p["ragged"] if "ragged" in p else p["auto"]  # the key of the first runs
        rows.append(
            (p["recipe"], p["joint"], p["lengths"], ragged["forward_s"], ragged["backward_s"])
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("measured")
    parser.add_argument("--profile", help="profile JSON (default: the built-in H200 profile)")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    forward, backward = profile.attention_forward_s_per_head, profile.attention_backward_s_per_head
    scale = HEAD_DIM / profile.attention_head_dim
    with open(args.measured) as f:
        data = json.load(f)
    rows = rows_of(data)
    print("| pack | joint | lengths | fwd ms measured | predicted | error | bwd ms measured "
          "| predicted | error |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    errors: dict[str, list[float]] = {"forward": [], "backward": []}
    for recipe, joint, lengths, fwd_s, bwd_s in rows:
        cells = [recipe, "yes" if joint else "no", str(len(lengths))]
        for name, table, measured_s in (("forward", forward, fwd_s), ("backward", backward, bwd_s)):
            predicted_s = sum(HEADS * scale * table(length) for length in lengths)
            error = predicted_s / measured_s - 1
            errors[name].append(error)
            cells += [f"{measured_s * 1e3:.2f}", f"{predicted_s * 1e3:.2f}", f"{100 * error:+.1f}%"]
        print("| " + " | ".join(cells) + " |")
    for name, values in errors.items():
        print(
            f"{name}: mean error {100 * statistics.mean(values):+.1f}%, MAPE "
            f"{100 * statistics.mean(abs(e) for e in values):.1f}%, largest "
            f"{100 * max(abs(e) for e in values):.1f}%"
        )
    if isinstance(data, dict):
        if data["packs"]:
            host_in_dense_calls(data["packs"])
        launch_in_dense_calls(data.get("launch", {}))


def launch_in_dense_calls(launch: dict) -> None:
    """The profiler's tiny ranks (1 sequence; LAUNCH_SEQUENCES = 8 distinct lengths) under groups
    and ragged: the per-call host time of a step from the groups, and a ragged table (the many-
    length rank's) in those calls. A cross-attention model has two tables (self, cross), an
    MMDiT one (joint); the 1-sequence rank's tables hold one call each, never ragged."""
    for model, runs in launch.items():
        groups, ragged = runs["groups"], runs.get("ragged", runs.get("auto"))
        tables = 1 if model.startswith("mmdit") else 2
        per_call_s = (groups["many_s"] - groups["one_s"]) / (tables * 7)
        equivalent = 1 + (ragged["many_s"] - ragged["one_s"]) / (tables * per_call_s)
        print(
            f"{model}: step host 1 sequence {groups['one_s'] * 1e3:.1f} / "
            f"{ragged['one_s'] * 1e3:.1f} ms, 8 lengths {groups['many_s'] * 1e3:.1f} (groups) / "
            f"{ragged['many_s'] * 1e3:.1f} ms (ragged); {per_call_s * 1e3:.3f} ms per dense call "
            f"a step; a ragged table issues like {equivalent:+.2f} dense calls"
        )


def host_in_dense_calls(packs: list[dict]) -> None:
    """Host issue of the step's attention (forward + backward) by pack: the groups' time is a
    fixed part per table plus a part per dense call (least squares over the packs); a ragged
    table's time, less that of a table of one dense call, in dense calls, plus that one."""
    calls = [len(set(p["lengths"])) for p in packs]
    groups_s = [sum(p["groups"]["host_s"]) for p in packs]
    ragged_s = [sum((p["ragged"] if "ragged" in p else p["auto"])["host_s"]) for p in packs]
    per_call_s, fixed_s = statistics.linear_regression(calls, groups_s)
    one_call_s = fixed_s + per_call_s
    print(
        f"\ngroups host = {fixed_s * 1e3:.2f} ms + {per_call_s * 1e3:.3f} ms per dense call "
        f"(least squares over {len(packs)} packs); a table of one dense call: "
        f"{one_call_s * 1e3:.2f} ms"
    )
    print(
        "| pack | joint | dense calls | groups host ms | ragged host ms | ragged in dense calls |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    equivalents = []
    for p, n, g, r in zip(packs, calls, groups_s, ragged_s, strict=True):
        equivalents.append(1 + (r - one_call_s) / per_call_s)
        print(
            f"| {p['recipe']} | {'yes' if p['joint'] else 'no'} | {n} | {g * 1e3:.2f} | "
            f"{r * 1e3:.2f} | {equivalents[-1]:+.2f} |"
        )
    print(f"a ragged table issues like {statistics.mean(equivalents):+.2f} dense calls on average")


if __name__ == "__main__":
    main()
