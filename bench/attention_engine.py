"""Coalesced attention on one GPU: mixed packs from the recipes, forward and backward timed apart.

A pack is what one rank attends in one step when it holds whole sequences: the recipe's batch for
32 ranks dealt longest-first onto packs of about --pack-tokens tokens, first pack taken (it holds
the longest sequence and the fill around it). Methods on the same pack ([T, N, H] bf16):
  dense-cudnn      one sequence with the pack's FLOPs (L = sqrt(sum L_i^2)), torch SDPA on cuDNN:
                   the reference rate the coalesced call should reach (target >= 90%)
  coalesced-auto   zellige.runtime.coalesced_attention as the engine calls it (automatic kernel
                   and merge policy)
  coalesced-groups the same, one dense cuDNN call per group of equal lengths (merge="groups")
  coalesced-ragged the same, one ragged cuDNN call over the whole pack (merge="ragged"; run
                   last per pack: on torch 2.11 it broke the CUDA context on a pack of 8)
  coalesced-Nstreams  groups round-robin on N CUDA streams (--streams)
  coalesced-flash  the grouping with FlashAttention-2 dense kernels (--flash-groups)
  fa2-varlen       packed FlashAttention-2 varlen as shipped in torch (target: auto >= 1.4x)
  flex-document    FlexAttention with a document mask (compiled; first pack only by default)
--joint: MMDiT packs: every sequence attends jointly with its own text of 256-512 tokens (uniform,
seeded), so each attended length is visual + text tokens, as the step program lays joint sequences.
FLOPs: forward 4 N H sum L_i^2, backward 2.5x that. Rates in TFLOP/s; median of --repeat timed
runs after a warm-up, CUDA events. Prints a table last; --out writes every number as JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import zellige
from zellige.runtime import SegmentTable, coalesced_attention
from zellige.runtime import kernels as K
from zellige.runtime.coalesced import RAGGED_MIN_CALLS

aten = torch.ops.aten
DEVICE = "cuda"  # --smoke runs the script's logic on the CPU with tiny shapes
RECIPES = [
    "opensora2-stage1",
    "opensora2-stage2",
    "wan-stage2",
    "wan-stage3",
    "knapformer-joint",
    "knapformer-mixed-images",
]


def make_pack(recipe: str, pack_tokens: int, seed: int, joint: bool = False) -> list[int]:
    batch = zellige.generate(recipe, 32, seed)
    lengths = [s.num_tokens for s in batch.sequences]
    if joint:  # each sequence's own text joins its attention (MMDiT): 256-512 tokens
        text = torch.randint(
            256, 513, (len(lengths),), generator=torch.Generator().manual_seed(seed)
        )
        lengths = [length + int(t) for length, t in zip(lengths, text.tolist(), strict=True)]
    lengths.sort(reverse=True)
    num_packs = max(1, math.ceil(sum(lengths) / pack_tokens))
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    for length in lengths:
        min(packs, key=sum).append(length)
    return packs[0]


def median_time_s(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        if DEVICE == "cpu":
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def fwd_bwd(forward: Callable[[], torch.Tensor], inputs, do, repeat: int) -> tuple[float, float]:
    """(forward s, backward s): forward under no_grad; backward replays one retained graph."""
    with torch.no_grad():
        fwd = median_time_s(forward, repeat)
    out = forward()
    bwd = median_time_s(lambda: torch.autograd.grad(out, inputs, do, retain_graph=True), repeat)
    return fwd, bwd


def leaves(shape, device, gen) -> list[torch.Tensor]:
    return [
        torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
        for _ in range(3)
    ]


def bench_dense(length: int, heads: int, head_dim: int, repeat: int, gen) -> tuple[float, float]:
    q, k, v = leaves((1, heads, length, head_dim), DEVICE, gen)
    do = torch.randn_like(q)

    backend = SDPBackend.CUDNN_ATTENTION if DEVICE == "cuda" else SDPBackend.FLASH_ATTENTION

    def forward():
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v)

    return fwd_bwd(forward, (q, k, v), do, repeat)


def bench_coalesced(q, k, v, do, table, backend, streams=1, merge=None, *, repeat):
    rows = [t.view(-1, t.shape[-1]) for t in (q, k, v)]
    do_rows = do.view(-1, do.shape[-1])

    def forward():
        return coalesced_attention(*rows, table, backend=backend, streams=streams, merge=merge)

    return fwd_bwd(forward, (q, k, v), do_rows, repeat)


class _VarlenFA2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu, max_len, scale):
        out, lse, rng, unused, _ = aten._flash_attention_forward(
            q, k, v, cu, cu, max_len, max_len, 0.0, False, False, scale=scale
        )
        ctx.save_for_backward(q, k, v, out, lse, cu, rng, unused)
        ctx.max_len, ctx.scale = max_len, scale
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse, cu, rng, unused = ctx.saved_tensors
        dq, dk, dv = aten._flash_attention_backward(
            do, q, k, v, out, lse, cu, cu, ctx.max_len, ctx.max_len, 0.0, False, rng, unused,
            scale=ctx.scale,
        )  # fmt: skip
        return dq, dk, dv, None, None, None


def bench_varlen(q, k, v, do, lengths, *, repeat):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(DEVICE)
    scale = q.shape[-1] ** -0.5
    return fwd_bwd(
        lambda: _VarlenFA2.apply(q, k, v, cu, max(lengths), scale), (q, k, v), do, repeat
    )


def bench_flex(q, k, v, do, lengths, *, repeat):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    total = q.shape[0]
    document = torch.repeat_interleave(
        torch.arange(len(lengths), device=DEVICE), torch.tensor(lengths, device=DEVICE)
    )

    def same_document(b, h, q_idx, kv_idx):
        return document[q_idx] == document[kv_idx]

    mask = create_block_mask(same_document, None, None, total, total, device=DEVICE)
    flex = torch.compile(flex_attention, dynamic=False)
    qb, kb, vb = (t.transpose(0, 1)[None] for t in (q, k, v))
    dob = do.transpose(0, 1)[None]
    return fwd_bwd(lambda: flex(qb, kb, vb, block_mask=mask), (q, k, v), dob, repeat)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _kernel_rates(kernel, q, k, v, do, flops, repeat) -> tuple[float, float]:
    scale = q.shape[-1] ** -0.5
    o, lse = kernel.forward(q, k, v, scale)
    fwd = median_time_s(lambda: kernel.forward(q, k, v, scale), repeat)
    bwd = median_time_s(lambda: kernel.backward(do, q, k, v, o, lse, scale), repeat)
    return flops / fwd / 1e12, 2.5 * flops / bwd / 1e12


def length_table(heads, head_dim, repeat, gen) -> list[dict]:
    """Dense batches of one length (64k tokens per call): cuDNN vs flash kernels of the runtime."""
    rows = []
    for length in (256, 1024, 4096, 16384) if DEVICE == "cuda" else (16, 64):
        count = max(1, (65536 if DEVICE == "cuda" else 256) // length)
        q, k, v, do = (
            torch.randn(count, length, heads, head_dim, device=DEVICE, dtype=torch.bfloat16,
                        generator=gen).transpose(1, 2)
            for _ in range(4)
        )  # fmt: skip
        flops = 4 * heads * head_dim * length * length * count
        row = {"length": length, "count": count}
        for name in ("cudnn", "flash"):
            try:
                row[name] = _kernel_rates(K.KERNELS[name](), q, k, v, do, flops, repeat)
            except (RuntimeError, NotImplementedError) as exc:
                row[name] = str(exc).splitlines()[0][:80]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="*", default=RECIPES)
    parser.add_argument("--pack-tokens", type=int, default=98304)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--flex-packs", type=int, default=1, help="packs to run FlexAttention on")
    parser.add_argument("--time-budget-s", type=float, default=240.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--commit", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (no timing)")
    parser.add_argument("--streams", action="store_true", help="also the 2- and 4-stream groups")
    parser.add_argument("--flash-groups", action="store_true", help="also FA2 dense groups")
    parser.add_argument("--ragged", action="store_true", help="also one ragged cuDNN call")
    parser.add_argument(
        "--joint", action="store_true", help="MMDiT packs: each sequence with 256-512 text tokens"
    )
    args = parser.parse_args()
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        args.pack_tokens, args.heads, args.head_dim, args.repeat = 6000, 2, 16, 1
        args.recipes = ["wan-stage1", "knapformer-mixed-images"]
    started = time.perf_counter()
    heads, head_dim = args.heads, args.head_dim
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    device = torch.device(DEVICE)
    names = ("cudnn", "cudnn-bnlh", "flash", "efficient") if DEVICE == "cuda" else ("cpu",)
    verified = {
        name: K._agrees_with_math(K.KERNELS[name](), device, torch.bfloat16, head_dim)
        for name in names
    }
    auto = K.kernel_for(device, torch.bfloat16, head_dim).name
    ragged = K.ragged_kernel_for(device, torch.bfloat16, head_dim)
    ragged_name = None if ragged is None else f"{ragged.name} (lse token-major: "
    if ragged is not None:
        ragged_name += f"{getattr(ragged, 'lse_token_major', True)})"
    print(
        f"kernels passing the check against math (bf16, H={head_dim}): {verified}; auto={auto}; "
        f"ragged: {ragged_name}"
    )
    report = {
        "joint": args.joint,
        "verified": verified,
        "auto": auto,
        "ragged": ragged_name,
        "ragged_min_calls": RAGGED_MIN_CALLS,
        "packs": [],
        "lengths": [],
    }

    for index, recipe in enumerate(args.recipes):
        if time.perf_counter() - started > args.time_budget_s:
            print(f"time budget spent: skipping {recipe} and later packs")
            break
        lengths = make_pack(recipe, args.pack_tokens, args.seed, args.joint)
        total = sum(lengths)
        square_sum = sum(length * length for length in lengths)
        flops = 4 * heads * head_dim * square_sum
        q, k, v = leaves((total, heads, head_dim), DEVICE, gen)
        do = torch.randn_like(q)
        cu = [0, *torch.tensor(lengths).cumsum(0).tolist()]
        table = SegmentTable.packed(cu, heads, DEVICE)
        entry = {
            "recipe": recipe,
            "sequences": len(lengths),
            "tokens": total,
            "distinct_lengths": len(set(lengths)),
            "calls": table.num_calls,
            "forward_flops": flops,
            "rates": {},
        }
        dense_length = max(64, round(math.sqrt(square_sum) / 64) * 64)
        timings = {"dense-cudnn": bench_dense(dense_length, heads, head_dim, args.repeat, gen)}
        dense_flops = 4 * heads * head_dim * dense_length**2
        methods = [
            ("coalesced-auto", bench_coalesced, (table, None)),
            ("coalesced-groups", bench_coalesced, (table, None, 1, "groups")),
            ("fa2-varlen", bench_varlen, (lengths,)),
        ]
        if args.streams:
            methods.append(("coalesced-2streams", bench_coalesced, (table, None, 2, "groups")))
            methods.append(("coalesced-4streams", bench_coalesced, (table, None, 4, "groups")))
        if args.flash_groups:
            methods.append(("coalesced-flash", bench_coalesced, (table, "flash", 1, "groups")))
        if args.ragged:
            methods.append(("coalesced-ragged", bench_coalesced, (table, None, 1, "ragged")))
        if index < args.flex_packs:
            methods.append(("flex-document", bench_flex, (lengths,)))
        for name, run, extra in methods:
            try:
                timings[name] = run(q, k, v, do, *extra, repeat=args.repeat)
            except Exception as exc:  # a backend missing in this torch build: report, go on
                entry["rates"][name] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        for name, (fwd, bwd) in timings.items():
            work = dense_flops if name == "dense-cudnn" else flops
            entry["rates"][name] = (work / fwd / 1e12, 2.5 * work / bwd / 1e12)
        # Same function: each coalesced path vs FA2 varlen, outputs and gradients, on this pack.
        for merge in ("groups", "ragged") if args.ragged else ("groups",):
            try:
                rows = [t.view(-1, head_dim) for t in (q, k, v)]
                o_c = coalesced_attention(*rows, table, merge=merge).view_as(q)
                grads_c = torch.autograd.grad(o_c, (q, k, v), do)
                cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
                o_v = _VarlenFA2.apply(q, k, v, cu_t, max(lengths), head_dim**-0.5)
                grads_v = torch.autograd.grad(o_v, (q, k, v), do)
                entry[f"rel_diff_{merge}_vs_varlen"] = [rel_diff(o_c, o_v)] + [
                    rel_diff(a, b) for a, b in zip(grads_c, grads_v, strict=True)
                ]
            except Exception as exc:
                entry[f"rel_diff_{merge}_vs_varlen"] = f"failed: {exc}"[:160]
        report["packs"].append(entry)
        print(json.dumps(entry), flush=True)
        del q, k, v, do
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    if time.perf_counter() - started < args.time_budget_s + 60:
        report["lengths"] = length_table(heads, head_dim, args.repeat, gen)
    commit = (
        args.commit
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
    )
    report["machine"] = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if DEVICE == "cuda" else None,
        "python": platform.python_version(),
        "commit": commit,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)

    print()
    print("| length | count | cudnn fwd / bwd | flash fwd / bwd |")
    print("| --- | --- | --- | --- |")
    for row in report["lengths"]:
        cells = [
            f"{row[n][0]:.0f} / {row[n][1]:.0f}" if isinstance(row[n], tuple) else row[n]
            for n in ("cudnn", "flash")
        ]
        print(f"| {row['length']} | {row['count']} | {cells[0]} | {cells[1]} |")
    print()
    names = [
        "dense-cudnn",
        "coalesced-auto",
        "coalesced-groups",
        "coalesced-ragged",
        "fa2-varlen",
        "coalesced-2streams",
        "coalesced-4streams",
        "coalesced-flash",
        "flex-document",
    ]
    names = [n for n in names if any(n in e["rates"] for e in report["packs"])] or names[:5]
    print("| pack | seqs | tokens | calls | " + " | ".join(f"{n} fwd / bwd" for n in names)
          + " | auto/dense fwd, bwd | auto/fa2 fwd, bwd | best path |")  # fmt: skip
    print("|" + " --- |" * (len(names) + 7))
    for entry in report["packs"]:
        rates = entry["rates"]
        cells = [
            f"{rates[n][0]:.0f} / {rates[n][1]:.0f}" if isinstance(rates.get(n), tuple) else "-"
            for n in names
        ]

        paths = ("coalesced-groups", "coalesced-ragged")
        coalesced = [n for n in paths if isinstance(rates.get(n), tuple)]
        best = max(coalesced, key=lambda n: rates[n][0] + rates[n][1] / 2.5) if coalesced else "-"

        def ratio(a: str, b: str, rates=rates) -> str:
            if not (isinstance(rates.get(a), tuple) and isinstance(rates.get(b), tuple)):
                return "-"
            return f"{rates[a][0] / rates[b][0]:.2f}, {rates[a][1] / rates[b][1]:.2f}"

        print(
            f"| {entry['recipe']} | {entry['sequences']} | {entry['tokens']} | {entry['calls']} | "
            + " | ".join(cells)
            + f" | {ratio('coalesced-auto', 'dense-cudnn')}"
            + f" | {ratio('coalesced-auto', 'fa2-varlen')} | {best} |"
        )
    m = report["machine"]
    print(
        f"\n{m['device']}, torch {m['torch']}, CUDA {m['cuda']}, cuDNN {m['cudnn']}, "
        f"commit {m['commit']}; {heads} heads x {head_dim}, bf16, TFLOP/s "
        "(backward counted as 2.5x the forward FLOPs)"
    )


if __name__ == "__main__":
    main()
