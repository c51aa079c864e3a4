"""Single-GPU training throughput of the reference DiTs at realistic mixed lengths.

Runs the real training loop (zellige.train: FSDP2, activation checkpointing, bf16, AdamW, the
loader planning ahead) on one GPU for each (config, recipe) and reports tokens/s, MFU and where
the step time goes: self-attention, cross-attention, per-token layers (the rest of the blocks),
outside the blocks (embeddings, loss, optimizer, FSDP, route), and planning (done in the loader
worker, so off the critical path; shown against the step time).

usage: python bench/train_throughput.py [--runs CONFIG:RECIPE[:VARIANT...],...] [--steps K]
       [--warmup W] [--seed S] [--sync-check] [--trace DIR]
Variants: ":eager" runs the per-token layers without torch.compile (the default on CUDA compiles
them, see zellige.model.fused); ":compiled" compiles them anywhere; ":all-checkpointed"
checkpoints every block (the default checkpoints per step only the blocks the plan's predicted
memory needs); ":no-checkpointing" checkpoints none. One GPU trains without FSDP2 by default
(fp32 master weights, bf16 copies cast once per step): ":fsdp" uses FSDP2 there too (keeping
each block's gathered weights to its backward), ":fsdp:reshard" as on more GPUs (gathered again
in the backward); ":separate-clipping" scales the gradients in a pass of its own before the fused
AdamW (by default its kernel applies the clipping's scale). ":fsdp:reshard:separate-clipping" is
the step as on several GPUs. ":gc-auto" leaves Python's garbage collections as they come (by
default the loop collects and freezes the objects torch.compile made, between steps:
zellige.runtime.collector.QuietCollector). ":eager-outside"
runs the RoPE tables, output head and loss without torch.compile (by default compiled with the
blocks); ":unpadded-rows" leaves the per-token modulation's one-hot GEMM at the sequence count
(by default padded to a multiple of 8: aligned bf16 operands, conditioning.per_token).
":copying-adamw" (one GPU without FSDP2) writes the next forward's bf16 weight copies in the
AdamW update's compiled pass (zellige.train.optimizer) instead of casting them at the forward's
start; ":torch-adamw" is torch's fused AdamW and the cast; ":bf16-grads" (with it) hands the
optimizer the backward's bf16 gradients (no fp32 gradients, their norm taken as they arrive).
":split-modulation" makes each modulation piece (shift, scale, gate) by a one-hot GEMM of its own
(no [T, K, D] stack of their gradients in the backward); ":gathered-head" (the default) has the Wan
output head's compiled region read each token's shift and scale from its sequence's rows (no
[T, 2, D] tensor in the forward), ":one-hot-head" gives them to it from per_token's one-hot GEMM
(a [T, 2, D] tensor). ":stacked-modulation" and ":untuned-update" turn the other two off.
":tuned-update" has inductor time launch configurations of the copying optimizer's kernels when they
compile (the same arithmetic). ":sync-steps" ends every step with a full sync and reads its metrics
then (by default a step's metrics are read during the next step, after its backward is issued: no
idle device between steps; training's metrics_one_step_late). Its step times start after the sync at
each step's start, so they leave out the host's work between steps (the metrics' gather and writes,
the next step's start); the column "wall step s" is the device's time per step from the end of the
warm-up to the last step's end, gaps included, the same measure for both.
Every step's predicted and measured peak are listed, and each step's line its full garbage
collections (count, seconds), those between it and the step before, and torch.compile's events in
it (0 after the warm-up: no recompilation).
--sync-check: the first run warns at every host sync inside its steps
(torch.cuda.set_sync_debug_mode, from step start to the optimizer step) and the summary counts
them per step and by source line; steps after the warm-up should have 0 (the first steps have
one-time work: torch.compile, the attention kernel's check on first use).
--trace DIR: each run trains two steps more; the first of them is profiled by torch.profiler,
both are left out of the means; its Chrome trace (DIR/trace_CONFIG_RECIPE.json.gz) and a
summary of where the step's time goes outside the blocks (DIR/trace_CONFIG_RECIPE.txt,
bench/step_trace.py; printed too).
":groups-attention" runs the attention tables as dense calls per length group (merge policy
"groups"), where the default runs a table of many lengths as one ragged cuDNN call if the cuDNN
frontend is installed (zellige.runtime.ragged); the run's planner prices it so too.
MMDiT configs (mmdit11b-width-h200, hunyuan13b-width-h200) run the same way, e.g.
--runs mmdit11b-width-h200:opensora2-stage2; their cross-attention share is 0 (text joins the
self-attention, counted as attention) and their FLOPs count text tokens as attended tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import gzip
import json
import os
import platform
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from unittest import mock

import torch

import zellige.train.loop
from _provenance import git_commit, header, print_header
from step_trace import summarise_trace
from zellige.profile import load_profile
from zellige.runtime import ragged
from zellige.train.config import get_config
from zellige.train.loop import train

DEFAULT_RUNS = "wan1p3b-h200:wan-stage2,wan14b-width-h200:wan-stage2,wan1p3b-h200:wan-stage3"
VARIANTS = {
    "eager": {"compile_elementwise": False},
    "compiled": {"compile_elementwise": True},
    "all-checkpointed": {"activation_checkpointing": True, "adaptive_checkpointing": False},
    "no-checkpointing": {"activation_checkpointing": False},
    "reshard": {"reshard_after_forward": True},
    "separate-clipping": {"clip_in_optimizer": False},
    "fsdp": {"fsdp_on_one_rank": True},
    "gc-auto": {"freeze_gc": False},
    "eager-outside": {"compile_outside": False},
    "unpadded-rows": {"pad_sequence_rows": False},
    "copying-adamw": {"copying_optimizer": True, "compute_dtype_gradients": False},
    "torch-adamw": {"copying_optimizer": False},
    "bf16-grads": {"copying_optimizer": True, "compute_dtype_gradients": True},
    "sync-steps": {"metrics_one_step_late": False},
    "tuned-update": {"tune_optimizer_kernels": True},
    "split-modulation": {"split_modulation": True},
    "gathered-head": {"gathered_head": True},
    # the three above off, whatever the defaults
    "stacked-modulation": {"split_modulation": False},
    "one-hot-head": {"gathered_head": False},
    "untuned-update": {"tune_optimizer_kernels": False},
    # the attention engine's merge policy, not a config field (entered around the run)
    "groups-attention": {},
}


def summarise(
    name: str,
    recipe: str,
    history: list[dict],
    warmup: int,
    peak: float | None,
    reserved_gib: float = 0.0,
) -> dict:
    steps = history[warmup:]
    step_s = sum(r["step_s"] for r in steps)
    flops = sum(r["train_flops"] for r in steps)
    attention = sum(r["attention_s_max"] for r in steps)
    cross = sum(r["cross_attention_s_max"] for r in steps)
    busy = sum(r["busy_s_max"] for r in steps)
    plan_s = sum(r["plan_ms"] for r in steps) / 1e3
    return {
        "config": name,
        "recipe": recipe,
        "steps": len(steps),
        "tokens": sum(r["tokens"] for r in steps),
        "sequences": sum(r["sequences"] for r in steps),
        "tokens_per_s": sum(r["tokens"] for r in steps) / step_s,
        "mfu": flops / (step_s * peak) if peak else float("nan"),
        "achieved_tflops_per_s": flops / step_s / 1e12,
        "step_s": step_s / len(steps),
        "attention_share": attention / step_s,
        "cross_attention_share": cross / step_s,
        "per_token_share": (busy - attention - cross) / step_s,
        "outside_blocks_share": (step_s - busy) / step_s,
        "plan_share": plan_s / step_s,
        "plan_ms": 1e3 * plan_s / len(steps),
        "data_wait_share": sum(r["data_wait_s_max"] for r in steps) / step_s,
        "peak_gib": max(r["peak_gib"] or 0.0 for r in steps),
        "losses": [round(r["loss"], 4) for r in history],
        "per_step": [
            {
                k: r[k]
                for k in (
                    "step",
                    "tokens",
                    "sequences",
                    "step_s",
                    "attention_s_max",
                    "cross_attention_s_max",
                    "busy_s_max",
                    "peak_gib",
                    "peak_backward_gib",
                    "peak_optimizer_gib",
                    "predicted_peak_gib",
                    "checkpointed_blocks",
                    "full_recompute_blocks",
                    "allocated_start_gib",
                    "alloc_retries",
                    "reserved_gib",
                    "data_wait_s_max",
                    "gc_full",
                    "gc_full_s",
                    "gc_s",
                    "gc_full_before_s",
                    "compile_events",
                    "ragged_graphs",
                )
                if k in r
            }
            for r in history
        ],
        # the plan's peak counts the runtime's reserve outside the allocator; the measured peak
        # is the allocator's
        "peak_error": [
            round((r["predicted_peak_gib"] - reserved_gib) / r["peak_gib"] - 1, 4)
            for r in steps
            if r["peak_gib"]
        ],
    }


def device_wall_s(ends: dict, warmup: int, steps: int) -> float | None:
    """Seconds per step from the end of step `warmup` to the end of step `steps` (printing_steps'
    marks): the device's time, idle gaps between steps included. None without a warm-up."""
    if warmup < 1 or steps <= warmup or warmup not in ends or steps not in ends:
        return None
    first, last = ends[warmup], ends[steps]
    if isinstance(first, float):
        return (last - first) / (steps - warmup)
    return first.elapsed_time(last) / 1e3 / (steps - warmup)


@contextlib.contextmanager
def marking_steps(caught: list, step_marks: list[int]):
    """While inside, the loop's torch.cuda.set_sync_debug_mode("warn") at each step's start
    appends len(caught) to step_marks: where each step's warnings begin."""
    set_mode = torch.cuda.set_sync_debug_mode

    def marking(mode) -> None:
        if mode == "warn":
            step_marks.append(len(caught))
        set_mode(mode)

    torch.cuda.set_sync_debug_mode = marking
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode = set_mode


def sync_readout(caught: list, step_marks: list[int], warmup: int) -> dict:
    """Host syncs per step (the warnings between one step's start and the next's) and by source
    line, all steps and the steps after the warm-up."""
    bounds = [*step_marks, len(caught)]
    per_step, steady = [], Counter()
    for k in range(len(step_marks)):
        lines = [
            f"{Path(w.filename).name}:{w.lineno}"
            for w in caught[bounds[k] : bounds[k + 1]]
            if "synchroniz" in str(w.message)
        ]
        per_step.append(len(lines))
        if k >= warmup:
            steady.update(lines)
    every = Counter(
        f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)
    )
    return {
        "host_syncs_by_step": per_step,
        "host_syncs_after_warmup": sum(steady.values()),
        "host_syncs_after_warmup_sources": dict(steady),
        "host_syncs": dict(every),
    }


@contextlib.contextmanager
def tracing_step(step: int, path: Path):
    """While inside, the training loop's step `step` (1-based) runs under torch.profiler; its
    trace goes to `path` (.json.gz) and the summary to `path` with .txt, and is printed."""
    loop = zellige.train.loop
    run_step = loop.train_step

    def traced(*args):
        config, device, index = args[0], args[5], args[7]
        if index + 1 != step:
            return run_step(*args)
        print(f"step {step}: profiling", file=sys.stderr, flush=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as profiler:
            records, pending = run_step(*args)
            # a late step's work is still queued: the trace waits for it (the next step then
            # starts on an idle device; it is not measured)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        raw = path.with_suffix("")  # .json
        profiler.export_chrome_trace(str(raw))
        try:
            trace = json.loads(raw.read_text())
            summary = summarise_trace(trace)
        except Exception as error:  # the numbers of the run matter more than this summary
            summary = f"trace summary failed: {type(error).__name__}: {error}"
        try:
            summary += "\n\n" + profiler.key_averages().table(
                sort_by="self_device_time_total"
                if device.type == "cuda"
                else "self_cpu_time_total",
                row_limit=30,
                max_name_column_width=70,
            )
        except Exception as error:
            summary += f"\n(no key_averages table: {error})"
        # the profiled step's record (a late step's is made again, the same, by the next step)
        record = records[-1] if pending is None else loop.finish_step(config, pending, device)
        header = (
            f"step {record['step']}: {record['tokens']} tokens, {record['sequences']} sequences, "
            f"step {record['step_s'] * 1e3:.1f} ms, blocks {record['busy_s_max'] * 1e3:.1f} ms, "
            f"outside {(record['step_s'] - record['busy_s_max']) * 1e3:.1f} ms (profiled: the "
            "profiler slows the host)"
        )
        with gzip.open(path, "wt") as out:
            out.write(raw.read_text())
        raw.unlink()
        path.with_suffix("").with_suffix(".txt").write_text(header + "\n" + summary + "\n")
        print(f"\n== trace of {path.name}\n{header}\n{summary}\n", flush=True)
        return records, pending

    loop.train_step = traced
    try:
        yield
    finally:
        loop.train_step = run_step


class GcPauses:
    """Python's garbage collections by the clock, through gc.callbacks: the full ones (generation
    2, which traverse every long-lived object) and all of them, as (count, seconds)."""

    def __init__(self) -> None:
        self.full = [0, 0.0]
        self.all = [0, 0.0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        seconds = time.perf_counter() - self._start
        self.all[0] += 1
        self.all[1] += seconds
        if info["generation"] == 2:
            self.full[0] += 1
            self.full[1] += seconds

    def totals(self) -> tuple[int, float, int, float]:
        return (*self.full, *self.all)


@contextlib.contextmanager
def printing_steps(label: str, ends: dict):
    """While inside, each training step prints one line on stderr as it ends (a run cut by a
    time limit still says how far it got and what each step took), with what could stall it
    once outside the blocks: Python's full garbage collections in the step (count and seconds),
    the graphs torch.compile captured or compiled in it, and the full collections between this
    step and the previous one (the loop's own, after a step that compiled). The same numbers go
    into the step's record (gc_full, gc_full_s, gc_s, compile_events, gc_full_before_s), with
    the cuDNN graphs the ragged attention kernel built in it (ragged_graphs).
    `ends` gets, per step (1-based), a mark queued after each step's call returns: a CUDA event
    (behind the step's work where it is still running, so device time, idle time included) or
    the host's clock on CPU; device_wall_s between two of them is the run's time over those
    steps, whatever the loop counts as a step's time."""
    loop = zellige.train.loop
    run_step = loop.train_step
    pauses = GcPauses()
    last_end = [pauses.totals()]

    issued = {}  # step -> its call's counts, until its record is made (a late step's: next call)

    def printed(*args):
        before = pauses.totals()
        compiles, graphs = zellige.runtime.collector.compile_events(), ragged.graphs_built()
        records, pending = run_step(*args)
        ends[args[7] + 1] = loop.time_mark(args[5])
        after = pauses.totals()
        issued[args[7] + 1] = {
            "gc_full": after[0] - before[0],
            "gc_full_s": after[1] - before[1],
            "gc_s": after[3] - before[3],
            "gc_full_before_s": before[1] - last_end[0][1],
            "compile_events": zellige.runtime.collector.compile_events() - compiles,
            "ragged_graphs": ragged.graphs_built() - graphs,
        }
        last_end[0] = after
        for record in records:
            record.update(issued.pop(record["step"]))
            print(
                f"{label} step {record['step']}: {record['tokens']} tokens, "
                f"{record['sequences']} sequences, {record['step_s']:.3f} s (blocks "
                f"{record['busy_s_max']:.3f} s, data wait {record['data_wait_s_max']:.3f} s), "
                f"allocator retries {record['alloc_retries']}, full GC {record['gc_full']} "
                f"({record['gc_full_s']:.3f} s; all GC {record['gc_s']:.3f} s; before the step "
                f"{record['gc_full_before_s']:.3f} s), compile events {record['compile_events']}, "
                f"ragged attention graphs built {record['ragged_graphs']}",
                file=sys.stderr,
                flush=True,
            )
        return records, pending

    loop.train_step = printed
    gc.callbacks.append(pauses)
    try:
        yield
    finally:
        loop.train_step = run_step
        gc.callbacks.remove(pauses)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="CONFIG:RECIPE pairs, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    parser.add_argument("--planner", default="dp-cost", help="on one GPU every plan is local")
    parser.add_argument("--seed", type=int, default=1, help="data seed (1: images and videos)")
    parser.add_argument("--json", help="write the summaries here")
    parser.add_argument("--sync-check", action="store_true", help="count host syncs (first run)")
    parser.add_argument("--profile", help="hardware profile JSON the plans use (default: built-in)")
    parser.add_argument("--trace", help="directory: profile one more step of each run (see above)")
    args = parser.parse_args()
    provenance = header("train_throughput.py")
    print_header(provenance)

    rows = []
    for index, run in enumerate(args.runs.split(",")):
        name, recipe, *variants = run.split(":")
        unknown = set(variants) - set(VARIANTS)
        if unknown:
            print(f"zellige: error: unknown variant(s) {sorted(unknown)} in {run}; allowed: "
                  f"{', '.join(VARIANTS)}", file=sys.stderr)  # fmt: skip
            return 2
        changes = {k: v for variant in variants for k, v in VARIANTS[variant].items()}
        sync_check = args.sync_check and index == 0
        config = get_config(name).with_fields(
            recipe=recipe,
            # traced: one step more, and one after it (a step makes the next one's inputs)
            steps=args.steps + (2 if args.trace else 0),
            planner=args.planner,
            seed=args.seed,
            sync_debug=sync_check,
            profile=args.profile,
            **changes,
        )
        start = time.perf_counter()
        step_marks: list[int] = []
        ends: dict = {}
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with contextlib.ExitStack() as stack:
                    if sync_check:
                        stack.enter_context(marking_steps(caught, step_marks))
                    stack.enter_context(printing_steps(run, ends))
                    if "groups-attention" in variants:
                        stack.enter_context(
                            mock.patch.dict(os.environ, {"ZELLIGE_ATTENTION_MERGE": "groups"})
                        )
                    if args.trace:
                        Path(args.trace).mkdir(parents=True, exist_ok=True)
                        label = "_".join([name, recipe, *variants])
                        path = Path(args.trace) / f"trace_{label}.json.gz"
                        stack.enter_context(tracing_step(args.steps + 1, path))
                    history = train(config, progress=False)
                history = history[: args.steps]  # the profiled step is not measured
        except Exception as error:  # keep measuring the other runs; say what failed
            print(f"{run}: FAILED {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            continue
        finally:
            gc.collect()  # the last run's model and optimizer (FSDP holds reference cycles)
            torch.cuda.empty_cache()
        # the cost model reserves 3 GiB where the profile measured no reserve
        reserved_gib = (load_profile(args.profile).runtime_reserved_bytes or 3 * 2**30) / 2**30
        peak = config.metrics.peak_flops_per_s
        row = summarise(name, recipe, history, args.warmup, peak, reserved_gib)
        row["variants"] = variants
        if sync_check:
            row.update(sync_readout(caught, step_marks, args.warmup))
        row["wall_s"] = time.perf_counter() - start
        row["device_wall_step_s"] = device_wall_s(ends, args.warmup, args.steps)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": provenance, "runs": rows}, indent=1))

    commit = git_commit()  # "-dirty" where the tree differs (a device's copy of it may)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor()
    print(
        f"\n{device}, torch {torch.__version__}, python {platform.python_version()}, "
        f"commit {commit}; means over steps {args.warmup + 1}..{args.steps}"
    )
    columns = (
        "config",
        "recipe",
        "tok/s",
        "MFU",
        "step s",
        "wall step s",
        "self-attn",
        "cross-attn",
        "per-token",
        "outside",
        "plan",
        "peak GiB",
        "ckpt blocks",
        "peak err max (allocator)",
    )
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for r in rows:
        cells = (
            ":".join([r["config"], *r["variants"]]),
            r["recipe"],
            f"{r['tokens_per_s']:,.0f}",
            f"{100 * r['mfu']:.1f}%",
            f"{r['step_s']:.3f}",
            "-" if r["device_wall_step_s"] is None else f"{r['device_wall_step_s']:.3f}",
            f"{100 * r['attention_share']:.1f}%",
            f"{100 * r['cross_attention_share']:.1f}%",
            f"{100 * r['per_token_share']:.1f}%",
            f"{100 * r['outside_blocks_share']:.1f}%",
            f"{r['plan_ms']:.2f} ms ({100 * r['plan_share']:.2f}%)",
            f"{r['peak_gib']:.1f}",
            "/".join(str(s["checkpointed_blocks"]) for s in r["per_step"][args.warmup :]),
            f"{100 * max(r['peak_error'], key=abs, default=0):+.1f}%",
        )
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        if "host_syncs_by_step" in r:
            sources = r["host_syncs_after_warmup_sources"] or "none"
            print(
                f"\nsync-check, {r['config']}:{r['recipe']}: host syncs per step "
                f"{r['host_syncs_by_step']}; after the warm-up (steps {args.warmup + 1}.."
                f"{args.steps}): {r['host_syncs_after_warmup']} (0 expected), at {sources}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
