"""The ragged cuDNN call alone (runtime/ragged.py) on the bench's packs, against one dense call.

For each recipe of bench/attention_engine.py (self and --joint packs, the same `make_pack`), the
kernel's forward_into / backward_into on ready row buffers, segments in both orders (most work
first, as the engine lays them, and the reverse), against torch SDPA on cuDNN for one sequence of
the pack's FLOPs (L = sqrt(sum L_i^2)). Medians of --repeat device timings after a warm-up, as
attention_engine.py takes them; the first call of a shape, which builds its cuDNN graphs, is
timed apart (wall ms, "first call"). The kernel is the engine's, after its check against the
math kernel (printed). --length-step N: the graphs' longest lengths rounded up to a multiple of
N instead of the kernel's buckets (ragged._bucket_length), to see what empty tiles cost. Needs
CUDA and `nvidia-cudnn-frontend`.

    python3 bench/attention_ragged_probe.py --out ragged.json [--length-step 128]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from attention_engine import RECIPES, bench_dense, make_pack, median_time_s
from zellige.runtime import ragged
from zellige.runtime.ragged import RaggedLayout, ragged_kernel_for


def median_ms(fn, repeat: int) -> float:
    return median_time_s(fn, repeat) * 1e3  # device time, as attention_engine.py measures it


def wall_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def ragged_ms(kernel, buffers: dict, layout: RaggedLayout, scale: float, repeat: int):
    """(forward, backward) device ms, and the first call's (forward, backward) wall ms."""
    q, k, v, do, o, lse, dq, dk, dv = (buffers[name] for name in "q k v do o lse dq dk dv".split())

    def forward():
        kernel.forward_into(q, k, v, o, lse, layout, scale)

    def backward():
        kernel.backward_into(do, q, k, v, o, lse, dq, dk, dv, layout, scale)

    first = (wall_ms(forward), wall_ms(backward))
    return median_ms(forward, repeat), median_ms(backward, repeat), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="*", default=RECIPES)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--length-step", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    n, head_dim, scale = args.heads, args.head_dim, args.head_dim**-0.5
    if args.length_step:
        step = args.length_step
        ragged._bucket_length = lambda tokens: -(-tokens // step) * step
    started = time.perf_counter()
    kernel, rows = ragged_kernel_for(torch.device("cuda"), torch.bfloat16, head_dim), []
    check_s = time.perf_counter() - started
    if kernel is None:
        raise SystemExit("no ragged kernel: nvidia-cudnn-frontend missing or its check failed")
    print(f"ragged kernel {kernel.name}: check against math passed ({check_s:.1f} s, first graphs)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(
        "| pack | joint | seqs | dense ms fwd / bwd | order | ragged ms fwd / bwd | ratio "
        "| first call ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for joint in (True, False):
        for recipe in args.recipes:
            lengths = make_pack(recipe, 98304, 0, joint)
            # as attention_engine.py: the nearest multiple of 64 (of L and L + 64 one is a multiple
            # of 128, where cuDNN's forward is faster: the same reference as the engine's bench)
            dense_length = max(64, round(math.sqrt(sum(x * x for x in lengths)) / 64) * 64)
            dense = tuple(
                1e3 * seconds
                for seconds in bench_dense(dense_length, n, head_dim, args.repeat, gen)
            )
            tokens = sum(lengths)
            buffers = {
                name: torch.randn(tokens * n, head_dim, device="cuda", dtype=torch.bfloat16)
                for name in ("q", "k", "v", "do", "o", "dq", "dk", "dv")
            }
            buffers["lse"] = torch.empty(tokens * n, device="cuda")
            for order in ("most-work-first", "least-work-first"):
                ordered = sorted(lengths, reverse=order == "most-work-first")
                starts = [0]
                for length in ordered[:-1]:
                    starts.append(starts[-1] + length * n)
                layout = RaggedLayout(
                    n, tuple(starts), tuple(starts), tuple(ordered), tuple(ordered)
                )
                forward, backward, first = ragged_ms(kernel, buffers, layout, scale, args.repeat)
                row = {
                    "recipe": recipe, "joint": joint, "sequences": len(lengths), "order": order,
                    "dense_ms": dense, "ragged_ms": [forward, backward],
                    "ratio": [dense[0] / forward, dense[1] / backward],
                    "first_call_ms": first, "length_step": args.length_step,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"| {recipe} | {joint} | {len(lengths)} | {dense[0]:.2f} / {dense[1]:.2f} | "
                    f"{order} | {forward:.2f} / {backward:.2f} | "
                    f"{row['ratio'][0]:.3f} / {row['ratio'][1]:.3f} | "
                    f"{first[0]:.0f} / {first[1]:.0f} |",
                    flush=True,
                )
    if args.out:
        machine = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "cudnn": torch.backends.cudnn.version()}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
