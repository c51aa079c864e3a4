"""Step peaks of one rank whose attention runs as one call, as several calls, or in phases (local
calls, then a ring's steps), at equal held tokens: what the per-token memory rows (measured on
packs of one call) charge a rank of many calls, and the Ulysses shard over 2 and 8 ranks.

    python bench/memory_calls_probe.py --model mmdit-11b --out probes.json [--quick]

Each probe is profiler.memory.pack_probe (the profiler's memory probe: FSDP blocks of the
model's stack, compiled regions on a GPU, exchanges replaced by local copies of their sizes).
The JSON is rewritten after every probe (a run stopped by a timeout keeps what it measured):
per probe its held tokens, its attention calls (query token-heads per call / heads, from the
rank's step program) and its step peak. The rows come from it through
`zellige.profiler.memory.attention_phase_rows` (see there); this script prints them too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import torch

from zellige.profiler import measure, memory, rank_work
from zellige.profiler.models import dit_config, model_to_run, stack_layers


def probes_for(quick: bool, text: int, heads: int) -> list[tuple[str, list]]:
    """The probes, most needed first (a run cut by its timeout keeps the first ones): a pack of
    two sequences in one call against the same attended tokens in 8 calls and in 2 (per-call
    buffers); the profiler's shard probes (memory.shard_probe_plans: shards of n held tokens,
    alone and beside a local sequence of n: the phases; the Ulysses shard over 2 and over 8
    ranks) and, as a check of the shard rows' linearity, one shard of 2n; more packs of one call
    between the profiler's (points of its backward_peak_bytes table); the 64k pack."""
    scale = 1 / 64 if quick else 1
    n = int(16384 * scale)
    wide = min(memory.ULYSSES_WIDE_DEGREE, heads)
    attended = n + 2 * text  # the n pack's attended tokens
    eight = memory._distinct_lengths(attended - 8 * text)
    big = int(65536 * scale)
    eight_big = memory._distinct_lengths(big + 2 * text - 8 * text)
    shard = memory.shard_probe_plans(n, 0, wide)  # the profiler's (a joint model: no text)
    return [
        ("one_call", [(n // 2, text, "local", [0]), (n // 2, text, "local", [0])]),
        ("eight_calls", [(m, text, "local", [0]) for m in eight]),
        *((name, shard[name]) for name in ("local_shard", "ring_shard_2", "ring_beside_local")),
        ("ring_shard_2_double", [(4 * n, 0, "ring", [0, 1])]),
        *(
            (name, shard[name])
            for name in ("ulysses_shard_2", f"ulysses_shard_{wide}", "ulysses_beside_local")
        ),
        *(
            (f"pack_{m}", [(m // 2, text, "local", [0]), (m // 2, text, "local", [0])])
            for m in (int(24576 * scale), int(9216 * scale))
        ),
        ("ulysses_shard_2_double", [(4 * n, 0, "ulysses", [0, 1])]),
        ("two_calls", [(3 * n // 4, text, "local", [0]), (n // 4, text, "local", [0])]),
        (f"pack_{int(49152 * scale)}", [(int(24576 * scale), text, "local", [0])] * 2),
        ("one_call_64k", [(big // 2, text, "local", [0]), (big // 2, text, "local", [0])]),
        ("eight_calls_64k", [(m, text, "local", [0]) for m in eight_big]),
    ]


ONE_CALL_PACKS = ("one_call", "one_call_64k")  # packs of one call, besides the pack_<tokens>


def rows_into(probes_path: str, base_path: str, out_path: str, model: str, table: bool) -> None:
    """A profile: `base_path` with `model`'s shard rows, Ulysses share row and phase row from the
    probes (memory.attention_phase_rows) and, with `table`, the packs of one call as points of
    its backward_peak_bytes table (memory.backward_peak_table with the base's kept rows; a point
    at a token count the base has replaces it)."""
    from zellige.profile import (
        MODEL_ROWS,
        load_profile,
        profile_from_dict,
        profile_to_dict,
        save_profile,
    )

    with open(probes_path) as f:
        probes = json.load(f)["probes"]
    base = profile_to_dict(load_profile(base_path))
    row = base["memory_models"].index(model)
    kept = {key: base[key][row] for key in MODEL_ROWS if base.get(key)}
    layers = stack_layers(model)
    kept_per_token = (layers - 1) * kept["checkpoint_bytes_per_token_layer"] + kept[
        "activation_bytes_per_token_layer"
    ]
    # the one-phase peaks the cost model will read: its table's packs (and these probes' packs)
    old = base["backward_peak_bytes"][row]
    points = {x: y + kept_per_token * x for x, y in zip(old["x"], old["y"], strict=True)}
    packs = {
        p["held_tokens"]: memory.MemoryProbe(**p["probe"])
        for name, p in probes.items()
        if name.startswith("pack_") or name in ONE_CALL_PACKS
    }
    if table:
        points.update({float(x): float(p.step_peak) for x, p in packs.items()})
    rows = memory.attention_phase_rows(probes, memory.linear_peaks(points))
    tables = {}
    added = []
    if table:
        new = memory.backward_peak_table(
            packs,
            kept,
            num_layers=layers,
            attended_text_tokens=0,  # held_tokens count the text
            text_bytes=0.0,
        )
        merged_points = dict(zip(old["x"], old["y"], strict=True))
        merged_points.update(zip(new["x"], new["y"], strict=True))
        x = sorted(merged_points)
        tables["backward_peak_bytes"] = {
            "source": "measured",
            "x": x,
            "y": [merged_points[v] for v in x],
        }
        added = new["x"]
    merged = memory.merge_memory(
        base, model, {k: v for k, v in rows.items() if k in MODEL_ROWS}, tables
    )
    merged["created"] += (
        f"; {model}: "
        + ", ".join(sorted(k for k in rows if k in MODEL_ROWS))
        + (f" and backward_peak_bytes points at {[int(v) for v in added]}" if added else "")
        + f" from bench/memory_calls_probe.py ({probes_path})"
    )
    save_profile(profile_from_dict(merged), out_path)
    print(json.dumps({k: v for k, v in rows.items()}, indent=1))
    print(f"wrote {out_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mmdit-11b")
    parser.add_argument("--out", help="the probes' JSON to write")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--only", nargs="*", help="probe names to run (default all)")
    parser.add_argument(
        "--rows-from",
        metavar="PROBES_JSON",
        help="measure nothing: write --rows-out, --base with the rows from these probes",
    )
    parser.add_argument("--base", help="with --rows-from: the profile the rows are added to")
    parser.add_argument("--rows-out", help="with --rows-from: the profile to write")
    parser.add_argument(
        "--table-points",
        action="store_true",
        help="with --rows-from: the packs of one call become backward_peak_bytes points too",
    )
    args = parser.parse_args()
    if args.rows_from:
        if not args.base or not args.rows_out:
            sys.exit("memory_calls_probe: error: --rows-from needs --base and --rows-out")
        rows_into(args.rows_from, args.base, args.rows_out, args.model, args.table_points)
        return
    if not args.out:
        sys.exit("memory_calls_probe: error: --out is required (or --rows-from)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.quick:
        sys.exit("memory_calls_probe: error: needs a GPU (or --quick for a CPU smoke run)")
    from zellige.model import fused

    fused.use_compiled(device.type == "cuda")  # as training and `zellige profile` run them
    model = model_to_run(args.model, args.quick, "memory_calls_probe")
    config = dit_config(model)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.time()
    result = {"model": args.model, "device": measure._device_name(device), "probes": {}}
    with rank_work.process_group_of_one(device):
        blocks = rank_work.make_fsdp_blocks(config, stack_layers(model), device, dtype)
        for name, sequences in probes_for(args.quick, config.text_tokens, config.num_heads):
            if args.only and name not in args.only:
                continue
            batch, plan = memory.rank_plan(sequences)
            held, calls = memory.rank_attention_calls(
                batch, plan, config.num_heads, config.joint_attention
            )
            p = memory.pack_probe(blocks, batch, plan, config, device, dtype)
            result["probes"][name] = {
                "sequences": [
                    [*s[:3], len(s[3])] for s in sequences
                ],  # tokens, text, strategy, degree
                "held_tokens": held,
                "calls": calls,
                "step_peak": p.step_peak,
                "probe": asdict(p),
                "at_s": round(time.time() - started, 1),
            }
            print(
                f"{name:<18} held {held:>6} calls {len(calls):>2} largest {max(calls):>8.0f} "
                f"step peak {p.step_peak / 2**20:9.1f} MiB ({time.time() - started:5.1f} s)",
                flush=True,
            )
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    rows = memory.attention_phase_rows(result["probes"])
    result["rows"] = rows
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
