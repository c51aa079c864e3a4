"""Does a cuDNN attention call run faster when its token counts are multiples of 128?

The dense reference of bench/attention_engine.py (L = sqrt(sum L_i^2) rounded to 64 tokens) ran
its forward at 619-701 TFLOP/s where L was a multiple of 128 and 576-592 (one run 635) where it
was not, on every pack of the 2026-12 H200 runs (bench/results/attention_engine_h200_202612*.json);
the backward showed no such split. The engine's calls have the packs' own lengths, mostly not
multiples of 128. This probe times one call of 24 heads x 128 (bf16) per (query tokens, key
tokens) at L and at L rounded up to 128 (La): (L, L), (La, L), (L, La), (La, La), forward with
the lse (the engine's call), forward without it (the dense reference's no-grad SDPA call), and
backward; each as calls back to back (--calls per timing, median of --repeat). If (La, L) runs
at the (La, La) rate, padding only the queries (coalesced._aligned_queries, exact, no mask)
buys the aligned rate. Rates count the call's own FLOPs (4 n H Lq Lk, backward 2.5x).
--smoke: the same logic on the CPU kernel with tiny shapes.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from zellige.runtime import kernels as K


def timed_s(fn, calls: int, repeat: int, cuda: bool) -> float:
    """Median seconds of one call, timed over `calls` calls back to back."""
    fn()
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            start_s = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start_s) / calls)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[1799, 2307, 4345, 8382, 19520])
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    cuda = not args.smoke
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.lengths, args.heads, args.head_dim, args.calls, args.repeat = [37, 70], 2, 16, 1, 1
    kernel = K.kernel_for(device, torch.bfloat16, args.head_dim)
    n, head_dim, scale = args.heads, args.head_dim, args.head_dim**-0.5
    gen = torch.Generator(device=device).manual_seed(0)
    print(f"kernel {kernel.name}; {n} heads x {head_dim}, bf16; TFLOP/s of each call's own FLOPs")
    print("| L | Lq | Lk | fwd with lse | fwd no lse (SDPA, no grad) | bwd |")
    print("|---|---|---|---|---|---|")
    backend = SDPBackend.CUDNN_ATTENTION if cuda else SDPBackend.MATH
    for length in args.lengths:
        aligned = -(-length // 128) * 128
        for q_len, k_len in ((length, length), (aligned, length), (length, aligned),
                             (aligned, aligned)):  # fmt: skip
            q, do = (
                torch.randn(1, q_len, n, head_dim, device=device, dtype=torch.bfloat16,
                            generator=gen).transpose(1, 2)
                for _ in range(2)
            )  # fmt: skip
            k, v = (
                torch.randn(1, k_len, n, head_dim, device=device, dtype=torch.bfloat16,
                            generator=gen).transpose(1, 2)
                for _ in range(2)
            )  # fmt: skip
            flops = 4 * n * head_dim * q_len * k_len
            o, lse = kernel.forward(q, k, v, scale)
            fwd = timed_s(lambda q=q, k=k, v=v: kernel.forward(q, k, v, scale), args.calls,
                          args.repeat, cuda)  # fmt: skip

            def sdpa(q=q, k=k, v=v):
                with torch.no_grad(), sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v)

            fwd_plain = timed_s(sdpa, args.calls, args.repeat, cuda)
            bwd = timed_s(
                lambda q=q, k=k, v=v, do=do, o=o, lse=lse: kernel.backward(
                    do, q, k, v, o, lse, scale
                ),
                args.calls, args.repeat, cuda,
            )  # fmt: skip
            print(f"| {length} | {q_len} | {k_len} | {flops / fwd / 1e12:.0f} | "
                  f"{flops / fwd_plain / 1e12:.0f} | {2.5 * flops / bwd / 1e12:.0f} |",
                  flush=True)  # fmt: skip
    if cuda:
        print(torch.cuda.get_device_name(), torch.__version__, torch.backends.cudnn.version())


if __name__ == "__main__":
    main()
