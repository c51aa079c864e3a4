"""The ragged cuDNN call alone (runtime/ragged.py) on the bench's packs, against one dense call.

For each recipe of bench/attention_engine.py (self and --joint packs, the same `make_pack`), the
kernel's forward_into / backward_into on ready row buffers (--variants: segments most work first,
as the engine lays them, or the reverse; or the diagnoses keys-floor128 / all-floor128, see
variant_lengths), against torch SDPA on cuDNN for one sequence of the pack's FLOPs (L = sqrt(sum
L_i^2) rounded to 64, and L + 64: the other parity of 128). Rates are each call's own FLOPs.
Medians of --repeat device timings after a warm-up, as attention_engine.py takes them; the first
call of a shape, which builds its cuDNN graphs, is timed apart (wall ms, "first call"). The
kernel is the engine's, after its check against the math kernel (printed). --length-step N: the
graphs' longest lengths rounded up to a multiple of N instead of the kernel's buckets
(ragged._bucket_length), to see what empty tiles cost. Needs CUDA and `nvidia-cudnn-frontend`.

    python3 bench/attention_ragged_probe.py --out ragged.json [--length-step 128]
    python3 bench/attention_ragged_probe.py --recipes opensora2-stage1 --variants most-work-first \
        keys-floor128 all-floor128
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


VARIANTS = ("most-work-first", "least-work-first", "keys-floor128", "all-floor128")


def variant_lengths(lengths: list[int], variant: str) -> tuple[list[int], list[int]]:
    """(query lengths, key lengths) of a variant, most work first unless it says otherwise. The
    floor128 variants are diagnoses, not the same attention: every key count (and with
    all-floor128 every query count) cut down to a multiple of 128 (at least 128), which shows
    what cuDNN's partial last key tile costs inside one ragged call."""
    ordered = sorted(lengths, reverse=variant != "least-work-first")
    floor = [max(128, length // 128 * 128) for length in ordered]
    if variant == "keys-floor128":
        return ordered, floor
    if variant == "all-floor128":
        return floor, floor
    return ordered, ordered


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="*", default=RECIPES)
    parser.add_argument("--modes", nargs="*", default=["joint", "self"], choices=["joint", "self"])
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS[:1]), choices=VARIANTS)
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
        "| pack | joint | seqs | dense TFLOP/s fwd / bwd (L; L + 64) | variant "
        "| ragged TFLOP/s fwd / bwd | ratio to dense at L | first call ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    unit = 4 * n * head_dim / 1e12  # forward TFLOP of one query-key pair product, all heads
    for joint in (mode == "joint" for mode in args.modes):
        for recipe in args.recipes:
            lengths = make_pack(recipe, 98304, 0, joint)
            # as attention_engine.py: the nearest multiple of 64 (of L and L + 64 one is a multiple
            # of 128, where cuDNN's forward is faster: both are printed, L is the engine's)
            dense_length = max(64, round(math.sqrt(sum(x * x for x in lengths)) / 64) * 64)
            dense = []
            for length in (dense_length, dense_length + 64):
                fwd_s, bwd_s = bench_dense(length, n, head_dim, args.repeat, gen)
                dense.append((unit * length**2 / fwd_s, 2.5 * unit * length**2 / bwd_s))
            tokens = sum(lengths)
            buffers = {
                name: torch.randn(tokens * n, head_dim, device="cuda", dtype=torch.bfloat16)
                for name in ("q", "k", "v", "do", "o", "dq", "dk", "dv")
            }
            buffers["lse"] = torch.empty(tokens * n, device="cuda")
            for variant in args.variants:
                q_lens, k_lens = variant_lengths(lengths, variant)
                starts = [0]
                for length in q_lens[:-1]:
                    starts.append(starts[-1] + length * n)
                layout = RaggedLayout(n, tuple(starts), tuple(starts), tuple(q_lens), tuple(k_lens))
                forward, backward, first = ragged_ms(kernel, buffers, layout, scale, args.repeat)
                work = unit * sum(a * b for a, b in zip(q_lens, k_lens, strict=True))
                rates = (work / forward * 1e3, 2.5 * work / backward * 1e3)
                row = {
                    "recipe": recipe, "joint": joint, "sequences": len(lengths),
                    "variant": variant, "dense_length": dense_length,
                    "dense_tflops": dense[0], "dense_alt_tflops": dense[1],
                    "ragged_ms": [forward, backward], "ragged_tflops": rates,
                    "ratio": [rates[0] / dense[0][0], rates[1] / dense[0][1]],
                    "first_call_ms": first, "length_step": args.length_step,
                }  # fmt: skip
                rows.append(row)
                print(
                    f"| {recipe} | {joint} | {len(lengths)} | {dense[0][0]:.0f} / "
                    f"{dense[0][1]:.0f} ({dense_length}; {dense[1][0]:.0f} / {dense[1][1]:.0f}) | "
                    f"{variant} | {rates[0]:.0f} / {rates[1]:.0f} | "
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
