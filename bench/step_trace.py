"""Where one training step's time goes, from a torch.profiler trace (Chrome trace JSON) of it.

bench/train_throughput.py --trace profiles one step and writes this summary next to the trace.
The loop names its phases (zellige.step.setup / forward / backward / optimizer / end) and the
step timer its regions (zellige.block, zellige.block.backward, zellige.attention, ...) as
profiler ranges. A device kernel belongs to the phase whose range holds its launch, and is
inside the blocks when the launching thread was inside a block range, as the step timer counts
it. Reported: the step's window on the host and how much of it the device was busy; device time
of the kernels outside the blocks by phase and kind, the largest of them by name; and the device's
idle gaps, each with what the host was doing when it launched the kernel that ended the gap (a
gap is host time the device waited for: setup, Python, a host sync).
"""

from __future__ import annotations

import bisect
from collections import defaultdict

PHASES = ("setup", "forward", "backward", "optimizer", "end")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
BLOCK_RANGES = ("zellige.block", "zellige.block.backward")


def kernel_kind(name: str, category: str) -> str:
    """A coarse kind of device activity, from its name."""
    lower = name.lower()
    if category == "gpu_memcpy":
        return "memcpy"
    if category == "gpu_memset":
        return "memset"
    if "nccl" in lower:
        return "nccl"
    if any(word in lower for word in ("flash", "fmha", "cudnn", "attention", "sdpa")):
        return "attention"
    if any(word in lower for word in ("adam", "multi_tensor", "foreach")):
        return "optimizer/foreach"
    if any(word in lower for word in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul")):
        return "gemm"
    if lower.startswith("triton"):
        return "triton (compiled)"
    return "other"


class _Spans:
    """Ranges on one host thread, to find the innermost one holding a time."""

    def __init__(self, spans: list[tuple[float, float, str]]) -> None:
        self.spans = sorted(spans)
        self.starts = [s[0] for s in self.spans]

    def innermost(self, t: float) -> str | None:
        # sorted by start: from the right, the first range that holds t started last
        for k in range(bisect.bisect_right(self.starts, t) - 1, -1, -1):
            start, end, name = self.spans[k]
            if start <= t <= end:
                return name
        return None

    def holds(self, t: float) -> bool:
        k = bisect.bisect_right(self.starts, t) - 1
        # spans of one name on one thread may nest (a recomputed block): scan back a little
        for j in range(k, max(k - 64, -1), -1):
            if self.spans[j][0] <= t <= self.spans[j][1]:
                return True
        return False


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def summarise_trace(trace: dict, top: int = 12) -> str:
    """The text summary of one profiled step (times in ms)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    phases = {}
    for e in events:
        name = e.get("name", "")
        if name.startswith("zellige.step.") and e.get("cat") == "user_annotation":
            phase = name.removeprefix("zellige.step.")
            phases[phase] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
    if not phases:
        return "no zellige.step.* ranges in the trace: was a training step profiled?"
    window = (min(a for a, _ in phases.values()), max(b for _, b in phases.values()))
    lines = [f"step window on the host: {(window[1] - window[0]) / 1e3:.2f} ms"]
    lines.append(
        "host time per phase: "
        + ", ".join(f"{p} {(phases[p][1] - phases[p][0]) / 1e3:.2f}" for p in PHASES if p in phases)
    )

    host_ranges: dict[object, list] = defaultdict(list)  # every named host range, per thread
    block_ranges: dict[object, list] = defaultdict(list)
    launches = {}
    for e in events:
        category = e.get("cat", "")
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if category in ("cpu_op", "user_annotation", "python_function"):
            host_ranges[e.get("tid")].append((start, end, e.get("name", "")))
            if e.get("name") in BLOCK_RANGES:
                block_ranges[e.get("tid")].append((start, end, e["name"]))
        elif category in LAUNCH_CATEGORIES and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (start, e.get("tid"))
    host = {tid: _Spans(spans) for tid, spans in host_ranges.items()}
    blocks = {tid: _Spans(spans) for tid, spans in block_ranges.items()}

    def phase_at(t: float) -> str:
        for name in PHASES:
            if name in phases and phases[name][0] <= t <= phases[name][1]:
                return name
        return "between phases"

    device = []  # (start, end, name, kind, phase, in_block, launch)
    for e in events:
        category = e.get("cat", "")
        if category not in DEVICE_CATEGORIES:
            continue
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        launch = launches.get(e.get("args", {}).get("correlation"))
        if launch is None or not (window[0] <= launch[0] <= window[1]):
            continue
        in_block = launch[1] in blocks and blocks[launch[1]].holds(launch[0])
        kind = kernel_kind(e.get("name", ""), category)
        device.append((start, end, e.get("name", ""), kind, phase_at(launch[0]), in_block, launch))
    if not device:
        lines.append("no device activity in the trace (a CPU run): host times only")
        return "\n".join(lines)

    busy = _union([(d[0], d[1]) for d in device])
    busy_ms = sum(b - a for a, b in busy) / 1e3
    first, last = busy[0][0], busy[-1][1]
    span_end = max(last, window[1])
    lines.append(
        f"device busy {busy_ms:.2f} ms of the window; first kernel starts "
        f"{(first - window[0]) / 1e3:.2f} ms into the step, the last ends "
        f"{(last - window[0]) / 1e3:.2f} ms in"
    )
    inside = _union([(d[0], d[1]) for d in device if d[5]])
    outside = [d for d in device if not d[5]]
    inside_ms = sum(b - a for a, b in inside) / 1e3
    outside_ms = sum(b - a for a, b in _union([(d[0], d[1]) for d in outside])) / 1e3
    lines.append(
        f"device time launched inside the blocks {inside_ms:.2f} ms, outside {outside_ms:.2f} ms "
        "(each a union over streams; FSDP's copies and collectives may overlap the blocks)"
    )

    by_phase_kind: dict[tuple[str, str], float] = defaultdict(float)
    by_name: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for start, end, name, kind, phase, _, _ in outside:
        by_phase_kind[(phase, kind)] += (end - start) / 1e3
        by_name[f"{phase} | {name[:90]}"][0] += (end - start) / 1e3
        by_name[f"{phase} | {name[:90]}"][1] += 1
    lines.append("outside the blocks, device ms by phase and kind (summed over streams):")
    for phase in (*PHASES, "between phases"):
        kinds = {k: v for (p, k), v in by_phase_kind.items() if p == phase}
        if kinds:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda x: -x[1]))
            lines.append(f"  {phase}: {sum(kinds.values()):.2f} = {parts}")
    lines.append(f"outside the blocks, the {top} largest by name (ms, count):")
    for name, (ms, count) in sorted(by_name.items(), key=lambda x: -x[1][0])[:top]:
        lines.append(f"  {ms:8.2f} {count:5d}  {name}")

    # idle gaps of the device inside the window: before the first kernel, between, after the last
    starts = sorted(device, key=lambda d: d[0])
    gaps = []  # (length_us, start, the device item that ends it or None)
    cursor, k = window[0], 0
    for a, b in busy:
        if a > cursor:
            while starts[k][0] < a:
                k += 1
            gaps.append((a - cursor, cursor, starts[k]))
        cursor = max(cursor, b)
    if span_end > cursor:
        gaps.append((span_end - cursor, cursor, None))
    idle_ms = sum(g[0] for g in gaps) / 1e3
    by_phase: dict[str, float] = defaultdict(float)
    for length, _, ender in gaps:
        by_phase["after the last kernel" if ender is None else ender[4]] += length / 1e3
    lines.append(
        f"device idle {idle_ms:.2f} ms in {len(gaps)} gaps; by the phase that launched the "
        "kernel ending the gap: "
        + ", ".join(f"{p} {v:.2f}" for p, v in sorted(by_phase.items(), key=lambda x: -x[1]))
    )
    lines.append(f"the {top} longest gaps (ms at, ms long, what the host was in when it launched "
                 "the next kernel):")  # fmt: skip
    for length, start, ender in sorted(gaps, key=lambda g: -g[0])[:top]:
        if ender is None:
            what = "after the last kernel: the host's end of step"
        else:
            launch_t, tid = ender[6]
            held = host[tid].innermost(launch_t) if tid in host else None
            what = f"{ender[4]}: {held or '?'} -> {ender[2][:60]}"
        lines.append(f"  {(start - window[0]) / 1e3:9.2f} {length / 1e3:8.2f}  {what}")
    return "\n".join(lines)
