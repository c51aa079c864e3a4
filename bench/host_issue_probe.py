"""Where a launch-floor rank's step time goes: host issue, GPU work, syncs and launches, per rank.

    python bench/host_issue_probe.py [--model mmdit-11b] [--layers 3] \
        [--plan-profile bench/results/mmdit_h200_202612_run8_rows.json] [--rounds 4] \
        [--json OUT.json] [--quick]

Runs, in one process on the one GPU (the CPU with --quick: smoke run, numbers mean nothing), the
training step of `zellige validate-profile` (rank_work.train_step on plain blocks, compiled
regions, activation checkpointing on, exchanges as local copies) for:

- the launch-floor ranks of validate-profile's plans 6 and 20 (knapformer-mixed-images on 8
  GPUs under dp-tokens, seeds 0 and 1: 4-5 local sequences of ~250 visual tokens and 5-361 text
  tokens each), re-drawn as validate-profile draws them;
- the same 4-sequence layout as plan 6's rank 4 with every sequence's token counts scaled down
  (so its host work is the same and its GPU work shrinks);
- the profiler's own tiny ranks (measure.profile_launch: 1 and 8 sequences of 32+ visual and 15
  text tokens), whose time the launch rows are fitted on.

Rounds interleave the ranks (A, B, C, ... then again), so a drift of the host's speed over the
run hits every rank alike. For each rank it prints: the host's issue time of a step (median and
interquartile spread over every timed step), the step's time between CUDA events (what
validate-profile reports), the GPU time of the step queued behind heavy GPU work (its kernels
back to back: no host gaps), and from one profiled step (torch.profiler, CPU and CUDA) the number
of kernel launches, synchronizing CUDA calls and allocator calls, with the top host-side ops by
self CPU time. A second pass times every rank with Python's garbage collector off.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch._inductor.async_compile

from zellige import _core
from zellige.costs import make_cost_model
from zellige.model import fused
from zellige.profile import load_profile
from zellige.profiler import rank_work
from zellige.profiler.launch import launch_rows
from zellige.profiler.models import dit_config, model_spec
from zellige.profiler.timing import gpu_time_s, synchronize
from zellige.workload import load_recipe

PLANS = (("knapformer-mixed-images", 8, "dp-tokens", 0, (2, 4)),
         ("knapformer-mixed-images", 8, "dp-tokens", 1, (0, 4)))  # fmt: skip
SCALES = (0.125, 0.25, 0.5)  # plan 6 rank 4's layout with token counts scaled by these
TINY_TEXT, TINY_LENGTHS = 15, ((32,), tuple(32 + i for i in range(8)))
# the same pair of launch ranks at an image's size (256 visual tokens, a caption's text)
IMAGE_TEXT, IMAGE_LENGTHS = 127, ((256,), tuple(256 + i for i in range(8)))
STEPS_PER_ROUND = 12
# CUDA runtime calls that wait for the device (or may: an allocation that misses the cache)
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpyAsync", "cudaStreamWaitEvent")  # fmt: skip
ALLOC_CALLS = ("cudaMalloc", "cudaFree", "cudaHostAlloc")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def local_plan(shapes: list[tuple[int, int]]) -> tuple[_core.Batch, _core.Plan]:
    """Local images of (visual tokens, text tokens) on rank 0 of 1."""
    return rank_work.local_plan(shapes, kind="image")


def ranks_to_probe(plan_profile: str | None) -> list[tuple[str, _core.Batch, _core.Plan, int]]:
    profile = load_profile(plan_profile)
    full = model_spec("mmdit-11b")
    cases, shapes_of = [], {}
    for recipe, gpus, planner, seed, ranks in PLANS:
        batch = _core.generate_batch(load_recipe(recipe), gpus, seed)
        cost = make_cost_model(full, gpus=gpus, profile=profile, activation_checkpointing=True)
        plan = _core.make_plan(planner, batch, cost)
        sequences = {s.id: s for s in batch.sequences}
        number = 6 if seed == 0 else 20
        for rank in ranks:
            shapes = [
                (sequences[p.sequence_id].num_tokens, sequences[p.sequence_id].text_tokens)
                for p in plan.placements
                if rank in p.ranks
            ]
            shapes_of[number, rank] = shapes
            cases.append((f"plan{number}/rank{rank}", batch, plan, rank))
    for scale in SCALES:
        shapes = [(max(2, round(v * scale)), max(2, round(x * scale))) for v, x in shapes_of[6, 4]]
        cases.append((f"plan6/rank4 x{scale}", *local_plan(shapes), 0))
    for lengths in TINY_LENGTHS:
        cases.append(
            (f"tiny {len(lengths)} seq", *local_plan([(n, TINY_TEXT) for n in lengths]), 0)
        )
    for lengths in IMAGE_LENGTHS:
        shapes = [(n, IMAGE_TEXT) for n in lengths]
        cases.append((f"image {len(lengths)} seq", *local_plan(shapes), 0))
    return cases


def launch_fit(one_s: float, many_s: float, layers: int) -> tuple[float, float]:
    """(seconds per layer, per attention call) from steps of 1 and 8 sequences, as
    measure.profile_launch fits them (one joint call per sequence and layer)."""
    return launch_rows(one_s, many_s, 1, 8, layers)


def profiled_step(step, device) -> dict:
    """Counts of one step's launches, synchronizing and allocator calls, and the top host ops."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    synchronize(device)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        synchronize(device)
    events = prof.key_averages()

    def count(names) -> int:
        return sum(e.count for e in events if e.key in names)

    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]
    runtime = sorted(
        (e for e in events if e.key.startswith("cu")), key=lambda e: -e.self_cpu_time_total
    )
    return {
        "launches": count(LAUNCH_CALLS),
        "sync_calls": {e.key: e.count for e in events if e.key in SYNC_CALLS},
        "alloc_calls": {e.key: e.count for e in events if e.key in ALLOC_CALLS},
        "aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
        "cuda_api": [(e.key[:40], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in runtime],
        "top_self_cpu": [
            (e.key[:70], e.count, round(e.self_cpu_time_total / 1e3, 3)) for e in top
        ],  # ms
    }


def sync_warnings(step, device) -> list[str]:
    """Messages of torch's sync debug mode over one step (CUDA only)."""
    if device.type != "cuda":
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    return sorted({str(w.message)[:160] for w in caught})


def time_steps(step, device, count: int, issue: list[float], wall: list[float], split=None):
    """Times `count` steps: host issue seconds (and, with `split`, (forward, backward) issue
    seconds of each) and seconds between CUDA events."""
    synchronize(device)
    for _ in range(count):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        forward_s = step()
        issue.append(time.perf_counter() - t0)
        if split is not None:
            split.append((forward_s, issue[-1] - forward_s))
        if device.type == "cuda":
            end.record()
            end.synchronize()
            wall.append(start.elapsed_time(end) / 1e3)
        else:
            wall.append(time.perf_counter() - t0)


def _pids_below(pid: int) -> list[int]:
    pids, pending = [], [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            pids += children
            pending += children
    return pids


def _cpu_s(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def cpu_seconds() -> tuple[float, float, int]:
    """CPU seconds used so far by this process (all its threads) and by its descendant
    processes (torch.compile's workers among them), and how many descendants there are."""
    below = _pids_below(os.getpid())
    return _cpu_s(os.getpid()), sum(_cpu_s(p) for p in below), len(below)


def spread(values: list[float]) -> float:
    q25, q50, q75 = np.percentile(np.asarray(values), [25, 50, 75])
    return float((q75 - q25) / q50) if q50 > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mmdit-11b")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--plan-profile", default="bench/results/mmdit_h200_202612_run8_rows.json")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--json", default=None)
    parser.add_argument("--eager", action="store_true", help="per-token regions not compiled")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run at tiny widths")
    args = parser.parse_args()
    started = time.monotonic()

    def say(text: str) -> None:
        print(f"[probe {time.monotonic() - started:6.1f} s] {text}", flush=True)

    cases = ranks_to_probe(args.plan_profile)  # before CUDA starts (planners may fork)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dit_config(args.model, num_layers=args.layers)
    if args.quick:
        config = dataclasses.replace(config, width=32, num_heads=4, ffn_width=128)
        cases = [c for c in cases if "x0.125" in c[0] or "plan" not in c[0] or "rank4" in c[0]]
    fused.use_compiled(not args.eager)
    blocks = rank_work.make_blocks(config, args.layers, device, dtype)
    steps = {}
    for name, batch, plan, rank in cases:
        inputs = rank_work.plan_rank_inputs(
            batch=batch, plan=plan, rank=rank, config=config, device=device, dtype=dtype
        )

        def step(inputs=inputs) -> float:
            """rank_work.train_step on plain blocks; returns the forward's issue seconds."""
            t0 = time.perf_counter()
            out = rank_work.forward_blocks(blocks, inputs, True, 0)
            forward_s = time.perf_counter() - t0
            out.backward(inputs.grad_TD)
            rank_work.clear_grads(blocks, inputs)
            return forward_s

        step()  # compiles on the first case: the regions' dynamic graphs
        step()
        steps[name] = (step, inputs.num_tokens, inputs.num_text)
    synchronize(device)
    say(f"{len(steps)} ranks ready (compiled: {not args.eager}, {device})")
    per_step = STEPS_PER_ROUND if not args.quick else 2
    results = {
        name: {"issue": [], "wall": [], "split": [], "issue_nogc": [], "wall_nogc": []}
        for name in steps
    }
    own0, below0, count = cpu_seconds()
    wall0 = time.perf_counter()
    for _ in range(args.rounds):
        for name, (step, _, _) in steps.items():
            r = results[name]
            time_steps(step, device, per_step, r["issue"], r["wall"], r["split"])
    wall_s = time.perf_counter() - wall0
    own1, below1, _ = cpu_seconds()
    say(
        f"timed (gc on): this process used {(own1 - own0) / wall_s:.2f} CPUs over the rounds, "
        f"its {count} descendant processes {(below1 - below0) / wall_s:.2f} CPUs"
    )
    gc.collect()
    gc.disable()
    try:
        for _ in range(max(1, args.rounds // 2)):
            for name, (step, _, _) in steps.items():
                r = results[name]
                time_steps(step, device, per_step, r["issue_nogc"], r["wall_nogc"])
    finally:
        gc.enable()
    say("timed (gc off)")
    if device.type == "cuda":  # the flash kernel in place of cuDNN: its host cost per call
        os.environ["ZELLIGE_ATTENTION_BACKEND"] = "flash"
        try:
            for name, (step, _, _) in steps.items():
                r = results[name]
                r["issue_flash"], r["wall_flash"] = [], []
                step()
                time_steps(step, device, per_step, r["issue_flash"], r["wall_flash"])
        finally:
            del os.environ["ZELLIGE_ATTENTION_BACKEND"]
        say("timed (flash kernel)")
    shutdown = getattr(torch._inductor.async_compile, "shutdown_compile_workers", None)
    if shutdown is not None and not args.eager:  # the compile workers gone: does issue change?
        shutdown()
        say(f"compile workers shut down ({cpu_seconds()[2]} descendant processes left)")
        for name, (step, _, _) in steps.items():
            r = results[name]
            r["issue_noworkers"], r["wall_noworkers"] = [], []
            time_steps(step, device, per_step, r["issue_noworkers"], r["wall_noworkers"])
    for name, (step, tokens, text) in steps.items():
        r = results[name]
        r["tokens"], r["text"] = tokens, text
        r["gpu_s"] = gpu_time_s(step, device, warmup=1, repeats=3 if not args.quick else 1)
    say("GPU-only times done")
    print_table(results, cases, args.layers)
    save(args.json, device, results)
    # one profiled step of each rank (profiler overhead: counts, not times, are the point)
    for name, (step, _, _) in steps.items():
        r = results[name]
        r["profile"] = p = profiled_step(step, device)
        r["sync_warnings"] = sync_warnings(step, device)
        print(
            f"\n{name}: {p['launches']} kernel launches, {p['aten_ops']} aten ops, "
            f"synchronizing calls {p['sync_calls']}, allocator calls {p['alloc_calls']}; "
            "top host ops by self CPU time (name, calls, ms):"
        )
        for key, calls, ms in p["top_self_cpu"]:
            print(f"   {key:<70} {calls:>5} {ms:>8.3f}")
        print("   CUDA runtime calls (name, calls, self CPU ms):", p["cuda_api"][:12])
        for message in r["sync_warnings"]:
            print(f"   sync: {message}")
        save(args.json, device, results)
    say("done")


def print_table(results: dict, cases: list, layers: int) -> None:
    print(
        f"\n{'rank':<20} {'tokens':>6} {'text':>5} {'issue ms':>8} {'spread':>6} {'fwd':>6}"
        f" {'bwd':>6} {'event ms':>8} {'no-gc':>7} {'flash':>7} {'no-wkrs':>7} {'GPU-only':>8}"
    )
    for name, r in results.items():
        forward_ms = 1e3 * statistics.median(f for f, _ in r["split"])
        backward_ms = 1e3 * statistics.median(b for _, b in r["split"])
        flash, no_workers = (
            1e3 * statistics.median(r[key]) if r.get(key) else float("nan")
            for key in ("issue_flash", "issue_noworkers")
        )
        print(
            f"{name:<20} {r['tokens']:>6} {r['text']:>5}"
            f" {1e3 * statistics.median(r['issue']):>8.2f}"
            f" {spread(r['issue']):>6.2f} {forward_ms:>6.2f} {backward_ms:>6.2f}"
            f" {1e3 * statistics.median(r['wall']):>8.2f}"
            f" {1e3 * statistics.median(r['issue_nogc']):>7.2f} {flash:>7.2f} {no_workers:>7.2f}"
            f" {1e3 * r['gpu_s']:>8.2f}"
        )
    print("(ms: host issue median, its spread (IQR / median), of which forward / backward; step")
    print(" time between CUDA events; issue with gc off; with the flash kernel; with the compile")
    print(" workers shut down; GPU time queued behind heavy GPU work)")
    num_seqs = {
        name: sum(rank in p.ranks for p in plan.placements) for name, _, plan, rank in cases
    }
    for label in ("tiny", "image"):
        one, many = (statistics.median(results[f"{label} {n} seq"]["issue"]) for n in (1, 8))
        per_layer, per_call = launch_fit(one, many, layers)
        print(
            f"launch rows from the {label} ranks' issue: {1e3 * per_layer:.2f} ms per layer + "
            f"{1e3 * per_call:.3f} ms per call; predicted issue of the plan ranks: "
            + ", ".join(
                f"{name} {1e3 * layers * (per_layer + num_seqs[name] * per_call):.1f}"
                for name in results
                if name.startswith("plan") and " x" not in name
            )
        )


def save(path: str | None, device, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"device": str(device), "torch": torch.__version__, "ranks": results}, f)


if __name__ == "__main__":
    sys.exit(main())
