"""Coalesced attention on one GPU: mixed packs from the recipes, forward and backward timed apart.

A pack is what one rank attends in one step when it holds whole sequences: the recipe's batch for
32 ranks dealt longest-first onto packs of about --pack-tokens tokens, first pack taken (it holds
the longest sequence and the fill around it). Methods on the same pack ([T, N, H] bf16):
  dense-cudnn      one sequence with the pack's FLOPs (L = sqrt(sum L_i^2)), torch SDPA on cuDNN:
                   the reference rate the coalesced call should reach (target >= 90%)
  dense-cudnn-alt  (--dense-alt) the same 64 tokens longer: of L and L + 64 one is a multiple of
                   128, where cuDNN's forward runs 10-20% faster (a call's key count decides:
                   bench/results/attention_engine_h200_202612.md), so the pair shows both readings
  coalesced-auto   zellige.runtime.coalesced_attention as the engine calls it (automatic kernel
                   and merge policy)
  coalesced-groups the same, one dense cuDNN call per group of equal lengths (merge="groups")
  coalesced-ragged the same, one ragged cuDNN call over the whole pack, in place in the rows
                   (merge="ragged": runtime/ragged.py, the cuDNN frontend package)
  coalesced-Nstreams  groups round-robin on N CUDA streams (--streams)
  coalesced-flash  the grouping with FlashAttention-2 dense kernels (--flash-groups)
  fa2-varlen       packed FlashAttention-2 varlen as shipped in torch (target: auto >= 1.4x)
  fa4-varlen       packed FlashAttention-4 varlen (the flash-attn-4 package's CuTe DSL kernels,
                   Hopper and Blackwell), where that package is installed
  flex-document    FlexAttention with a document mask (compiled; first pack only by default)
  kernels-only     (--overhead or --merges) the groups' kernel calls alone, back to back on ready
                   inputs (no row copies): what the engine's copies and host work cost; with it
                   coalesced-2streams (the groups on 2 CUDA streams) and coalesced-overlap (the
                   rows written on a side stream beside the next call, overlap_copies=True)
  pad-auto         (--merges) padded merges of nearby lengths (coalesced.PaddedGroup, key mask on
                   cuDNN) as the engine's priced plan (runtime/merging.py) chooses them
  pad-wX           (--merges) greedy runs of groups, largest first, while padded FLOPs <= (1 + X%)
                   x useful FLOPs (--waste)
  pad-wX-nomask    (--merges) the same without the key mask (NOT exact: what the mask costs)
Every method also reports its host issue time (host ms: the wall time to queue one run).
--rounds N: the method list N times in turn; medians over rounds, and each method's ratio to the
dense reference(s) of the same round, median over rounds ("paired": rates drift over a run).
--call-table PATH: the attention call table (zellige.profiler.attention_calls, as `zellige
profile --attention-calls` measures it): the merge policy's costs (runtime/merging.py).
--joint: MMDiT packs: every sequence attends jointly with its own text of 256-512 tokens (uniform,
seeded), so each attended length is visual + text tokens, as the step program lays joint sequences.
FLOPs: forward 4 N H sum L_i^2, backward 2.5x that. Rates in TFLOP/s; median of --repeat timed
runs after a warm-up, CUDA events around each run queued behind a spin kernel that outlasts its
host issue, so rates are device time (a run timed from an idle device would count the host's
issue as device time and penalise methods with more host work). Prints a table
last; --out writes every number as JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import zellige
from _provenance import header, print_header
from zellige.profiler.attention_calls import measure_call_table
from zellige.runtime import EngineConfig, SegmentTable, coalesced_attention, merging
from zellige.runtime import kernels as K
from zellige.runtime.backends import RAGGED_MIN_CALLS, _ragged_choice, planned_table
from zellige.runtime.coalesced import _dense, _for_each_group, key_split_ok
from zellige.runtime.ragged import ragged_kernel_for

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


def make_pack(
    recipe: str, pack_tokens: int, seed: int, joint: bool = False, shrink: int = 1
) -> list[int]:
    """The pack's attended lengths, longest first; shrink > 1 divides them (the CPU smoke run:
    the same spread of distinct lengths at a size a CPU attends in seconds)."""
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
    return [max(1, length // shrink) for length in packs[0]]


HOST_S: dict[str, list[float]] = {}  # host issue seconds of the last timed runs, by tag
_SLEEP_CYCLES_PER_S: list[float] = []  # torch.cuda._sleep's rate on this device, measured once


def _busy_device(seconds: float) -> None:
    """Queue a spin kernel of about `seconds` on the current stream: the timed calls are issued
    while it runs, so their CUDA-event time is device time, not the host's issue time."""
    if not _SLEEP_CYCLES_PER_S:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S.append(10_000_000 / (start.elapsed_time(end) / 1e3))
    torch.cuda._sleep(int(seconds * _SLEEP_CYCLES_PER_S[0]))


def median_time_s(fn: Callable[[], object], repeat: int, tag: str | None = None) -> float:
    """Median device seconds of fn over `repeat` runs after a warm-up and one run that times its
    host issue. On CUDA each run is queued behind a spin kernel longer than that host issue
    time (_busy_device), so host time (reported apart, HOST_S) does not count as device time; a
    method whose host issue is longer than its device time is host-bound, and the host ms column
    shows it."""
    fn()  # warm-up: one-time work (graph builds, checks) stays out of issue_s
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start_s = time.perf_counter()
    fn()
    issue_s = time.perf_counter() - start_s
    times, host = [], []
    for _ in range(repeat):
        if DEVICE == "cpu":
            start_s = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start_s)
            host.append(times[-1])
            continue
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _busy_device(max(2 * issue_s, 2e-3))
        start.record()
        start_s = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start_s)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    if tag is not None:
        HOST_S[tag] = sorted(host)
    return sorted(times)[len(times) // 2]


def fwd_bwd(forward: Callable[[], torch.Tensor], inputs, do, repeat: int) -> tuple[float, float]:
    """(forward s, backward s): forward under no_grad; backward replays one retained graph."""
    with torch.no_grad():
        fwd = median_time_s(forward, repeat, "fwd")
    out = forward()
    grad = lambda: torch.autograd.grad(out, inputs, do, retain_graph=True)  # noqa: E731
    bwd = median_time_s(grad, repeat, "bwd")
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


def bench_dense_again(q, k, v, do, length: int, gen, *, repeat) -> tuple[float, float]:
    """bench_dense at the pack's head shape (a method of the --rounds list)."""
    return bench_dense(length, q.shape[1], q.shape[2], max(5, repeat), gen)


def bench_kernels_only(q, k, v, do, table, streams=1, *, repeat):
    """The table's kernel calls alone on ready inputs (views as the engine makes them), on
    `streams` CUDA streams as the engine spreads them (coalesced._for_each_group)."""
    kernel = K.kernel_for(q.device, q.dtype, q.shape[-1])
    scale = q.shape[-1] ** -0.5
    rows = [t.view(-1, t.shape[-1]) for t in (q, k, v, do)]
    calls = {}
    for g in table.groups:
        qd, dod = (_dense(r, g.q_index, g, g.q_len) for r in (rows[0], rows[3]))
        kd, vd = (_dense(r, g.k_index, g, g.k_len) for r in (rows[1], rows[2]))
        o, lse = kernel.forward(qd, kd, vd, scale)
        calls[id(g)] = (qd, kd, vd, dod, o, lse)

    def forward():
        def one(g):
            qd, kd, vd, _, _, _ = calls[id(g)]
            kernel.forward(qd, kd, vd, scale)

        _for_each_group(table, one, q.device, streams)

    def backward():
        def one(g):
            qd, kd, vd, dod, o, lse = calls[id(g)]
            kernel.backward(dod, qd, kd, vd, o, lse, scale)

        _for_each_group(table, one, q.device, streams)

    return median_time_s(forward, repeat, "fwd"), median_time_s(backward, repeat, "bwd")


def threshold_buckets(groups, max_waste: float) -> list[list[int]]:
    """Greedy runs of groups in order (largest first) while padded FLOPs <= (1 + max_waste) x
    the useful ones; runs of one group are left out."""
    buckets, run = [], []

    def waste(members) -> float:
        count = sum(groups[i].count for i in members)
        padded = (
            count * max(groups[i].q_len for i in members) * max(groups[i].k_len for i in members)
        )
        return padded / sum(groups[i].count * groups[i].q_len * groups[i].k_len for i in members)

    for i in range(len(groups)):
        same_heads = not run or groups[run[0]].num_heads == groups[i].num_heads
        if same_heads and waste([*run, i]) <= 1.0 + max_waste:
            run.append(i)
            continue
        if len(run) >= 2:
            buckets.append(run)
        run = [i]
    if len(run) >= 2:
        buckets.append(run)
    return buckets


def auto_buckets(table, head_dim: int) -> tuple[list[list[int]], str]:
    """The engine's automatic plan (coalesced.merge_plan), and where its costs came from."""
    costs = merging.costs_for_device(torch.device(DEVICE), EngineConfig.from_env().call_table)
    if costs is None:
        return [], "no measured costs for this device"
    buckets, planned, alone = merging.plan_padded_merges(table.groups, costs, head_dim, 2)
    return buckets, f"{costs.source}: planned {planned * 1e3:.2f} ms vs {alone * 1e3:.2f} ms"


def bench_coalesced(
    q, k, v, do, table, backend, streams=None, merge=None, overlap=False, key_split=None, *, repeat
):
    rows = [t.view(-1, t.shape[-1]) for t in (q, k, v)]
    do_rows = do.view(-1, do.shape[-1])

    def forward():
        return coalesced_attention(
            *rows, table, backend=backend, streams=streams, merge=merge, overlap_copies=overlap,
            key_split=key_split,
        )  # fmt: skip

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


def fa4_installed() -> bool:
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ModuleNotFoundError:  # no flash_attn package at all
        return False


def fa4_varlen(q, k, v, cu, longest: int) -> torch.Tensor:
    """FlashAttention-4's varlen call over the packed rows (cu: int32 offsets on the device)."""
    from flash_attn.cute import flash_attn_varlen_func

    out, _ = flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest, max_seqlen_k=longest,
        softmax_scale=q.shape[-1] ** -0.5,
    )  # fmt: skip
    return out


def bench_fa4_varlen(q, k, v, do, lengths, *, repeat):
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu = cu.to(DEVICE)
    return fwd_bwd(lambda: fa4_varlen(q, k, v, cu, max(lengths)), (q, k, v), do, repeat)


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


def write_report(report: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


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
    parser.add_argument(
        "--stream-counts", type=int, nargs="*", default=[],
        help="also the groups on each N CUDA streams (N > 1) and their kernels alone on N streams",
    )  # fmt: skip
    parser.add_argument(
        "--methods", nargs="*", default=None,
        help="run only these methods (names as printed; the dense reference always runs)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=1,
        help="run the method list this many times in turn (dense reference included), keep the "
        "median per method (and each round's ratio to that round's dense reference, "
        "paired_vs_dense): spreads clock drift over all methods",
    )  # fmt: skip
    parser.add_argument("--flash-groups", action="store_true", help="also FA2 dense groups")
    parser.add_argument("--ragged", action="store_true", help="also one ragged cuDNN call")
    parser.add_argument(
        "--merges", action="store_true", help="also padded merges, kernels-only and 2 streams"
    )
    parser.add_argument(
        "--overhead", action="store_true", help="also kernels-only, 2 streams, overlapped copies"
    )
    parser.add_argument(
        "--waste", type=float, nargs="*", default=[5, 15, 30], help="pad-wX thresholds, percent"
    )
    parser.add_argument(
        "--key-split", type=int, nargs="*", default=[],
        help="also the engine's automatic path with the forward of each group of >= N keys split "
        "at a multiple of 128 keys (coalesced-ksplitN; key_split=N; 0 = never split)",
    )  # fmt: skip
    parser.add_argument(
        "--dense-alt", action="store_true",
        help="also the dense reference 64 tokens longer (dense-cudnn-alt: the other parity of "
        "128; the reference's rate depends on it), not used in the ratios",
    )  # fmt: skip
    parser.add_argument("--call-table", default=None, help="measure the call table into PATH")
    parser.add_argument("--call-table-first", action="store_true", help="before the packs")
    parser.add_argument("--no-length-table", action="store_true")
    parser.add_argument(
        "--method-budget-s", type=float, default=None, help="skip methods started past this"
    )
    parser.add_argument(
        "--joint", action="store_true", help="MMDiT packs: each sequence with 256-512 text tokens"
    )
    args = parser.parse_args()
    provenance = header("attention_engine.py")
    if args.commit:
        provenance["commit"] = args.commit
    print_header(provenance)
    if args.smoke:
        global DEVICE
        DEVICE = "cpu"
        args.heads, args.head_dim, args.repeat = 2, 16, 1
        args.recipes = ["opensora2-stage1"]
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
    masked = K.masked_kernel_for(K.kernel_for(device, torch.bfloat16, head_dim), device,
                                 torch.bfloat16, head_dim)  # fmt: skip
    masked_name = None if masked is None else getattr(masked, "bias_layout", masked.name)
    print(f"key-mask kernel (padded merges): {auto} with mask passed as {masked_name}")
    split_ok = key_split_ok(K.kernel_for(device, torch.bfloat16, head_dim), device,
                            torch.bfloat16, head_dim)  # fmt: skip
    print(f"split forward (--key-split) passes its check against math on {auto}: {split_ok}")
    ragged = ragged_kernel_for(device, torch.bfloat16, head_dim)
    ragged_name = None if ragged is None else ragged.name
    print(
        f"kernels passing the check against math (bf16, H={head_dim}): {verified}; auto={auto}; "
        f"ragged: {ragged_name}"
    )
    report = {
        "provenance": provenance,
        "joint": args.joint,
        "verified": verified,
        "auto": auto,
        "masked": masked_name,
        "ragged": ragged_name,
        "ragged_min_calls": RAGGED_MIN_CALLS,
        "packs": [],
        "lengths": [],
    }

    commit = provenance["commit"]
    report["machine"] = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if DEVICE == "cuda" else None,
        "python": platform.python_version(),
        "commit": commit,
    }
    if args.call_table and args.call_table_first:
        report["call_table"] = measure_call_table(
            device, head_dim=head_dim, quick=args.smoke, repeats=args.repeat,
            out_path=args.call_table, progress=print,
        )  # fmt: skip
    for index, recipe in enumerate(args.recipes):
        if time.perf_counter() - started > args.time_budget_s:
            print(f"time budget spent: skipping {recipe} and later packs")
            break
        lengths = make_pack(
            recipe, args.pack_tokens, args.seed, args.joint, 64 if args.smoke else 1
        )
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
        auto_table = planned_table(table, q.view(-1, head_dim))
        costs = merging.costs_for_device(torch.device(DEVICE), EngineConfig.from_env().call_table)
        rows = q.view(-1, head_dim)
        ragged = _ragged_choice(table, rows, rows, None, "auto")
        entry["auto_plan"] = {
            "calls": 1 if ragged else auto_table.num_calls,
            "ragged": None if ragged is None else ragged[0].name,
            "padded": [[q for q, _ in p.member_shapes] for p in auto_table.padded],
            "costs": None if costs is None else costs.source,
        }
        plan = entry["auto_plan"]
        if ragged is not None:
            print(f"{recipe}: auto runs one ragged call ({plan['ragged']})", flush=True)
        else:
            print(f"{recipe}: auto runs {plan['calls']} calls (padded: {plan['padded']}); "
                  f"costs: {plan['costs']}", flush=True)  # fmt: skip
        dense_length = max(64, round(math.sqrt(square_sum) / 64) * 64)
        dense_repeat = max(5, args.repeat)  # the reference of every ratio: a steadier median
        timings = {"dense-cudnn": bench_dense(dense_length, heads, head_dim, dense_repeat, gen)}
        dense_flops = 4 * heads * head_dim * dense_length**2
        alt_flops = 4 * heads * head_dim * (dense_length + 64) ** 2
        fwd_s, bwd_s = timings["dense-cudnn"]
        print(f"{recipe} dense-cudnn L={dense_length}: {dense_flops / fwd_s / 1e12:.0f} / "
              f"{2.5 * dense_flops / bwd_s / 1e12:.0f} TFLOP/s", flush=True)  # fmt: skip
        entry["auto_streams"] = (
            merging.streams_for_device(device, EngineConfig.from_env())
            if DEVICE == "cuda" and table.num_calls > 1
            else 1
        )
        methods = [
            ("coalesced-auto", bench_coalesced, (table, None)),
            ("coalesced-groups", bench_coalesced, (table, None, 1, "groups")),
            ("fa2-varlen", bench_varlen, (lengths,)),
        ]
        if DEVICE == "cuda" and fa4_installed():
            methods.append(("fa4-varlen", bench_fa4_varlen, (lengths,)))
        for count in args.stream_counts:  # the groups on N streams, and their kernels alone
            if count > 1:
                methods.append(
                    (f"coalesced-{count}streams", bench_coalesced, (table, None, count, "groups"))
                )
            methods.append((f"kernels-only-{count}s", bench_kernels_only, (table, count)))
        for key_split in args.key_split:
            extra = (table, None, None, None, False, key_split)
            methods.append((f"coalesced-ksplit{key_split}", bench_coalesced, extra))
        if args.dense_alt:
            methods.append(("dense-cudnn-alt", bench_dense_again, (dense_length + 64, gen)))
        if args.rounds > 1:  # the dense reference again between rounds (see --rounds)
            methods.insert(0, ("dense-cudnn", bench_dense_again, (dense_length, gen)))
        if args.streams:
            methods.append(("coalesced-2streams", bench_coalesced, (table, None, 2, "groups")))
            methods.append(("coalesced-4streams", bench_coalesced, (table, None, 4, "groups")))
        if args.flash_groups:
            methods.append(("coalesced-flash", bench_coalesced, (table, "flash", 1, "groups")))
        if args.merges or args.overhead:
            methods.append(("kernels-only", bench_kernels_only, (table,)))
            if not args.streams:
                methods.append(("coalesced-2streams", bench_coalesced, (table, None, 2, "groups")))
            methods.append(("coalesced-overlap", bench_coalesced, (table, None, 1, "groups", True)))
        if args.merges:
            buckets, why = auto_buckets(table, head_dim)
            entry["merges"] = {"pad-auto": {"buckets": buckets, "why": why}}
            variants = [("pad-auto", buckets, True)]
            for waste in args.waste:
                chosen = threshold_buckets(table.groups, waste / 100)
                variants.append((f"pad-w{waste:g}", chosen, True))
            middle = args.waste[len(args.waste) // 2] if args.waste else 15
            variants.append(
                (f"pad-w{middle:g}-nomask", threshold_buckets(table.groups, middle / 100), False)
            )
            for name, chosen, masked in variants:
                merged = table.merge_padded(chosen, DEVICE, masked=masked) if chosen else table
                entry["merges"].setdefault(name, {})
                entry["merges"][name].update({
                    "calls": merged.num_calls,
                    "buckets": [[table.groups[i].q_len for i in b] for b in chosen],
                    "extra_flops": sum(
                        (p.padded_flops_factor - 1) * sum(a * b for a, b in p.member_shapes)
                        for p in merged.padded
                    ) / square_sum,
                })  # fmt: skip
                methods.append((name, bench_coalesced, (merged, None, 1, "groups")))
        if args.ragged:
            methods.append(("coalesced-ragged", bench_coalesced, (table, None, 1, "ragged")))
        if index < args.flex_packs:
            methods.append(("flex-document", bench_flex, (lengths,)))
        if args.methods:
            methods = [m for m in methods if m[0] in args.methods or m[0] == "dense-cudnn"]
        entry["host_ms"] = {}
        # --rounds: every method's (forward, backward) seconds per round; the median is kept
        rounds: dict[str, list[tuple[float, float]]] = {"dense-cudnn": [timings["dense-cudnn"]]}
        for name, run, extra in [m for _ in range(args.rounds) for m in methods]:
            if args.method_budget_s and time.perf_counter() - started > args.method_budget_s:
                entry["rates"].setdefault(name, "skipped: --method-budget-s")
                continue
            try:
                rounds.setdefault(name, []).append(run(q, k, v, do, *extra, repeat=args.repeat))
                timings[name] = tuple(statistics.median(t[i] for t in rounds[name]) for i in (0, 1))
                entry["host_ms"][name] = [
                    round(HOST_S[tag][len(HOST_S[tag]) // 2] * 1e3, 3) for tag in ("fwd", "bwd")
                ]
                fwd_s, bwd_s = rounds[name][-1]
                work = {"dense-cudnn": dense_flops, "dense-cudnn-alt": alt_flops}.get(name, flops)
                rates = f"{work / fwd_s / 1e12:.0f} / {2.5 * work / bwd_s / 1e12:.0f}"
                print(f"{recipe} {name}: {rates} TFLOP/s, host ms {entry['host_ms'][name]}",
                      flush=True)  # fmt: skip
            except Exception as exc:  # a backend missing in this torch build: report, go on
                entry["rates"][name] = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
        for name, (fwd, bwd) in timings.items():
            work = {"dense-cudnn": dense_flops, "dense-cudnn-alt": alt_flops}.get(name, flops)
            entry["rates"][name] = (work / fwd / 1e12, 2.5 * work / bwd / 1e12)
        # Paired ratios (--rounds > 1): each round's rate over the dense reference (and, with
        # --dense-alt, over the one 64 tokens longer) measured in the same round, median over
        # rounds: rates drift by up to 10% over a run (a later round ran slower), which this
        # cancels where a median of each side alone does not.
        references = {
            "dense": (rounds["dense-cudnn"][1:], dense_flops),
            "dense_alt": (rounds.get("dense-cudnn-alt", []), alt_flops),
        }
        for ref, (ref_rounds, ref_flops) in references.items():
            entry[f"paired_vs_{ref}"] = {}
            for name, times in rounds.items():
                if name.startswith("dense-cudnn") or not ref_rounds or not times:
                    continue
                pairs = list(zip(times, ref_rounds, strict=False))
                entry[f"paired_vs_{ref}"][name] = [
                    statistics.median(flops / t[i] / (ref_flops / d[i]) for t, d in pairs)
                    for i in (0, 1)
                ]
                fwd_ratio, bwd_ratio = entry[f"paired_vs_{ref}"][name]
                print(f"{recipe} {name} / {ref}, paired by round (median of {len(pairs)}): "
                      f"{fwd_ratio:.3f} / {bwd_ratio:.3f}", flush=True)  # fmt: skip
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
        if isinstance(entry["rates"].get("fa4-varlen"), tuple):  # FA4 vs FA2: same function
            cu_t = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
            o_4 = fa4_varlen(q, k, v, cu_t, max(lengths))
            o_2 = _VarlenFA2.apply(q, k, v, cu_t, max(lengths), head_dim**-0.5)
            outs = [[o, *torch.autograd.grad(o, (q, k, v), do)] for o in (o_4, o_2)]
            entry["rel_diff_fa4_vs_varlen"] = [
                rel_diff(a, b) for a, b in zip(outs[0], outs[1], strict=True)
            ]
        if args.merges:  # the merged path vs the groups, outputs and gradients (same function)
            chosen = threshold_buckets(table.groups, max(args.waste or [15]) / 100)
            if chosen:
                merged = table.merge_padded(chosen, DEVICE)
                rows = [t.view(-1, head_dim) for t in (q, k, v)]
                outs = []
                for tab in (table, merged):
                    o_c = coalesced_attention(*rows, tab, merge="groups").view_as(q)
                    outs.append([o_c, *torch.autograd.grad(o_c, (q, k, v), do)])
                entry["rel_diff_padded_vs_groups"] = [
                    rel_diff(a, b) for a, b in zip(outs[1], outs[0], strict=True)
                ]
        if max(args.stream_counts, default=1) > 1:  # N streams: the same calls, same results
            rows = [t.view(-1, head_dim) for t in (q, k, v)]
            outs = []
            for count in (1, max(args.stream_counts)):
                o_c = coalesced_attention(*rows, table, merge="groups", streams=count)
                outs.append([o_c.view_as(q), *torch.autograd.grad(o_c.view_as(q), (q, k, v), do)])
            entry["rel_diff_streams_vs_groups"] = [
                rel_diff(a, b) for a, b in zip(outs[1], outs[0], strict=True)
            ]
            entry["streams_o_identical"] = bool(torch.equal(outs[1][0], outs[0][0]))
        for key_split in [n for n in args.key_split if n > 0]:  # split forward: same function
            rows = [t.view(-1, head_dim) for t in (q, k, v)]
            outs = []
            for split in (0, key_split):
                o_c, lse_c = coalesced_attention(
                    *rows, table, merge="groups", key_split=split, return_lse=True
                )
                grads = torch.autograd.grad(o_c.view_as(q), (q, k, v), do)
                outs.append([o_c.view_as(q), lse_c, *grads])
            diffs = [rel_diff(a, b) for a, b in zip(outs[1], outs[0], strict=True)]
            entry[f"rel_diff_ksplit{key_split}_vs_groups"] = diffs
            print(f"{recipe} ksplit{key_split} vs groups (o, lse, dq, dk, dv rel. diff): "
                  f"{[f'{x:.1e}' for x in diffs]}", flush=True)  # fmt: skip
        if args.overhead or args.merges:  # copies on a side stream: the same results
            rows = [t.view(-1, head_dim) for t in (q, k, v)]
            outs = []
            for overlap in (False, True):
                o_c = coalesced_attention(*rows, table, merge="groups", overlap_copies=overlap)
                outs.append([o_c.view_as(q), *torch.autograd.grad(o_c.view_as(q), (q, k, v), do)])
            entry["rel_diff_overlap_vs_groups"] = [
                rel_diff(a, b) for a, b in zip(outs[1], outs[0], strict=True)
            ]
        report["packs"].append(entry)
        if args.out:  # after every pack: a run cut short by a timeout keeps what it measured
            write_report(report, args.out)
        print(json.dumps(entry), flush=True)
        del q, k, v, do
        if DEVICE == "cuda":
            torch.cuda.empty_cache()

    if args.call_table and not args.call_table_first:
        report["call_table"] = measure_call_table(
            device, head_dim=head_dim, quick=args.smoke, repeats=args.repeat,
            out_path=args.call_table, progress=print,
        )  # fmt: skip
    if not args.no_length_table and time.perf_counter() - started < args.time_budget_s + 60:
        report["lengths"] = length_table(heads, head_dim, args.repeat, gen)
    if args.out:
        write_report(report, args.out)

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
        "fa4-varlen",
        "coalesced-2streams",
        "coalesced-4streams",
        "coalesced-flash",
        "flex-document",
    ]
    for entry in report["packs"]:  # merge variants, in the order measured
        names += [n for n in entry["rates"] if n not in names]
    names = [n for n in names if any(n in e["rates"] for e in report["packs"])] or names[:5]
    tail = (
        " | auto/dense fwd, bwd | auto/dense paired | auto/dense-alt paired | auto/fa2 fwd, bwd"
        " | best path |"
    )
    print("| pack | seqs | tokens | calls (auto) | " + " | ".join(f"{n} fwd / bwd" for n in names)
          + tail)  # fmt: skip
    print("|" + " --- |" * (len(names) + 9))
    for entry in report["packs"]:
        rates = entry["rates"]
        cells = [
            f"{rates[n][0]:.0f} / {rates[n][1]:.0f}" if isinstance(rates.get(n), tuple) else "-"
            for n in names
        ]

        coalesced = [
            n
            for n, r in rates.items()
            if n.startswith(("coalesced", "pad-")) and "nomask" not in n and isinstance(r, tuple)
        ]
        best = max(coalesced, key=lambda n: rates[n][0] + rates[n][1] / 2.5) if coalesced else "-"

        def ratio(a: str, b: str, rates=rates) -> str:
            if not (isinstance(rates.get(a), tuple) and isinstance(rates.get(b), tuple)):
                return "-"
            return f"{rates[a][0] / rates[b][0]:.2f}, {rates[a][1] / rates[b][1]:.2f}"

        paired = [
            entry.get(f"paired_vs_{ref}", {}).get("coalesced-auto")
            for ref in ("dense", "dense_alt")
        ]
        paired = ["-" if p is None else f"{p[0]:.2f}, {p[1]:.2f}" for p in paired]
        print(
            f"| {entry['recipe']} | {entry['sequences']} | {entry['tokens']} | {entry['calls']} "
            f"({entry['auto_plan']['calls']}) | "
            + " | ".join(cells)
            + f" | {ratio('coalesced-auto', 'dense-cudnn')}"
            + f" | {paired[0]} | {paired[1]}"
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
