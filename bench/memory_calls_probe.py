"""Step peaks of one rank whose attention runs as one call, as several calls, or in phases (local
calls, then a ring's steps), at equal held tokens: what the per-token memory rows (measured on
packs of one call) charge a rank of many calls, and the Ulysses shard over 2 and 8 ranks.

    python bench/memory_calls_probe.py --model mmdit-11b --out probes.json [--quick]

Each probe is profiler.measure.pack_probe (the profiler's memory probe: FSDP blocks of the
model's stack, compiled regions on a GPU, exchanges replaced by local copies of their sizes).
The JSON is rewritten after every probe (a run stopped by a timeout keeps what it measured):
per probe its held tokens, its attention calls (query token-heads per call / heads, from the
rank's step program) and its step peak. The rows come from it through
`zellige.profiler.measure.attention_phase_rows` (see there); this script prints them too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

import torch

from zellige.profiler import measure, rank_work
from zellige.profiler.models import dit_config, model_to_run, stack_layers


def probes_for(quick: bool, text: int, heads: int) -> list[tuple[str, list]]:
    """The probes, most needed first (a run cut by its timeout keeps the first ones): a pack of
    two sequences in one call against the same attended tokens in 8 calls and in 2 (per-call
    buffers); shards of n held tokens, alone and beside a local sequence of n, against one shard
    of 2n (per-phase buffers: the local calls, the exchanged ones and the ring steps run one
    phase after another); the Ulysses shard over 2 and over 8 ranks; more packs of one call
    between the profiler's (points of its backward_peak_bytes table); the 64k pack."""
    scale = 1 / 64 if quick else 1
    n = int(16384 * scale)
    wide = min(measure.ULYSSES_WIDE_DEGREE, heads)
    attended = n + 2 * text  # the n pack's attended tokens
    eight = measure._distinct_lengths(attended - 8 * text)
    big = int(65536 * scale)
    eight_big = measure._distinct_lengths(big + 2 * text - 8 * text)
    local = (n, 0, "local", [0])
    return [
        ("one_call", [(n // 2, text, "local", [0]), (n // 2, text, "local", [0])]),
        ("eight_calls", [(m, text, "local", [0]) for m in eight]),
        ("local_shard", [local]),
        ("ring_shard_2", [(2 * n, 0, "ring", [0, 1])]),
        ("ring_beside_local", [(2 * n, 0, "ring", [0, 1]), local]),
        ("ring_shard_2_double", [(4 * n, 0, "ring", [0, 1])]),
        ("ulysses_shard_2", [(2 * n, 0, "ulysses", [0, 1])]),
        (f"ulysses_shard_{wide}", [(wide * n, 0, "ulysses", list(range(wide)))]),
        ("ulysses_beside_local", [(2 * n, 0, "ulysses", [0, 1]), local]),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mmdit-11b")
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--only", nargs="*", help="probe names to run (default all)")
    args = parser.parse_args()
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
            batch, plan = measure.rank_plan(sequences)
            held, calls = measure.rank_attention_calls(
                batch, plan, config.num_heads, config.joint_attention
            )
            p = measure.pack_probe(blocks, batch, plan, config, device, dtype)
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
    rows = measure.attention_phase_rows(result["probes"])
    result["rows"] = rows
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
