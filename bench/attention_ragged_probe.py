"""Why the ragged cuDNN call (kernels.CudnnRaggedKernel) failed on an H200: speed and correctness.

On opensora2-stage1 (34 sequences of 512-8k tokens) one ragged call ran at 74 / 137 TFLOP/s and
its dq / dk were wrong (bench/results/attention_engine_h200_202612.md). Two questions:
  speed   is the cuDNN graph built on every call? Host seconds of the 1st, 2nd and 3rd identical
          call, each synchronized: equal seconds mean a rebuild per call (no graph cache)
  wrong   does the backward disagree with the groups (one dense cuDNN call per length) for the
          pack's lengths, for either lse layout (token- or head-major), and from which length on?
Prints one JSON line per check (so a crash mid-way keeps what came before); --out writes all.
--smoke: the math oracle on the CPU with tiny lengths (the script's logic only).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from zellige.runtime import SegmentTable, coalesced_attention
from zellige.runtime import kernels as K


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def synced_s(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def probe(lengths, heads, head_dim, kernel, device, dtype, tag) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(0)
    total = sum(lengths)
    q, k, v, do = (
        torch.randn(total, heads, head_dim, generator=gen).to(device, dtype) for _ in range(4)
    )
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    longest, scale = max(lengths), head_dim**-0.5
    result: dict = {"check": tag, "sequences": len(lengths), "tokens": total}
    out = {}

    def forward():
        out["o"], out["lse"] = kernel.forward(q, k, v, cu, cu, longest, longest, scale)

    result["forward_s_1st_2nd_3rd"] = [synced_s(forward, device) for _ in range(3)]

    def backward():
        out["grads"] = kernel.backward(
            do, q, k, v, out["o"], out["lse"], cu, cu, longest, longest, scale
        )

    result["backward_s_1st_2nd_3rd"] = [synced_s(backward, device) for _ in range(3)]
    # the groups: one dense call per length (the engine's checked path) as the reference
    table = SegmentTable.packed(bounds, heads, device)
    rows = [t.reshape(-1, head_dim).requires_grad_() for t in (q, k, v)]
    o_ref, lse_ref = coalesced_attention(*rows, table, merge="groups", return_lse=True)
    grads_ref = torch.autograd.grad(o_ref, rows, do.reshape(-1, head_dim))
    got = [out["o"].reshape(-1, head_dim), *(g.reshape(-1, head_dim) for g in out["grads"])]
    pairs = zip(got, [o_ref, *grads_ref], strict=True)
    result["rel_diff_o_dq_dk_dv"] = [rel(a, b) for a, b in pairs]
    result["rel_diff_lse"] = rel(out["lse"].reshape(-1), lse_ref)
    # per sequence: where dq goes wrong (the first few and the worst)
    dq, dq_ref = got[1].view(total, heads, head_dim), grads_ref[0].view(total, heads, head_dim)
    per = [rel(dq[a:b], dq_ref[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    result["dq_rel_by_length"] = sorted(zip(lengths, per, strict=True), key=lambda x: -x[1])[:6]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    heads, head_dim = (2, 16) if args.smoke else (24, 128)
    pack = [  # opensora2-stage1's first pack (bench/attention_engine.py make_pack, seed 0)
        8382, 7112, 5842, 5020, 4902, 4845, 4352, 4352, 4088, 3598, 3528, 3024, 2570, 2307, 2307,
        2268, 1799, 1799, 1792, 1792, 1785, 1785, 1560, 1560, 1542, 1530, 1530, 1518, 1518, 1512,
        1250, 1250, 512, 512,
    ]  # fmt: skip
    cases = [("small", [37, 5, 53]), ("mid", [1250, 512, 1799]), ("pack", pack)]
    if args.smoke:
        cases = [(name, [max(1, x // 64) for x in lengths]) for name, lengths in cases]
    results = []
    for token_major in (True, False):
        if args.smoke:
            kernel = K.MathRaggedKernel()
        else:
            kernel = K.CudnnRaggedKernel()
            kernel.lse_token_major = token_major
        for name, lengths in cases:
            tag = f"{name} lse_token_major={token_major}"
            try:
                results.append(probe(lengths, heads, head_dim, kernel, device, dtype, tag))
            except Exception as exc:  # report and go on: one layout may be refused
                results.append({"check": tag, "failed": f"{type(exc).__name__}: {exc}"[:300]})
            print(json.dumps(results[-1]), flush=True)
        if args.smoke:
            break
    meta = {"torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    print(json.dumps(meta))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
