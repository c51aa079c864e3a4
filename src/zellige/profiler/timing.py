"""Timing and memory probes for the profiler: CUDA events on a GPU, the wall clock on a CPU."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SLOW_RUN_S = 0.1  # past this, a few repeats are enough and more would cost minutes


def median_time_s(
    fn: Callable[[], object],
    device: torch.device,
    *,
    warmup: int = 2,
    repeats: int = 5,
    behind_busy_gpu: bool = False,
    samples: list[float] | None = None,
) -> float:
    """Median seconds of `fn()` over `repeats` runs after `warmup` untimed ones (at least one
    warm-up when warmup > 0; a run slower than SLOW_RUN_S gets one warm-up and at most three
    repeats).

    On CUDA each run is bracketed by events, so host launch overhead that the GPU hides is not
    counted, but a launch-bound run still shows its launch gaps. With `behind_busy_gpu` each run
    is queued behind heavy GPU work lasting longer than the host takes to issue it (see
    gpu_time_s). `samples`, if given, gets the seconds of every timed run."""
    host_s = 0.0
    if warmup > 0:
        synchronize(device)
        start_s = time.perf_counter()
        fn()
        host_s = time.perf_counter() - start_s  # issue time (or more, if fn synchronizes)
        synchronize(device)
        if time.perf_counter() - start_s > SLOW_RUN_S:
            warmup, repeats = 1, min(repeats, 3)
        for _ in range(warmup - 1):
            fn()
    burn_s = max(BURN_S, 2.0 * host_s + 1e-3)
    synchronize(device)
    times_s = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if behind_busy_gpu:
                _burn(burn_s, device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            start_s = time.perf_counter()
            fn()
            times_s.append(time.perf_counter() - start_s)
    if samples is not None:
        samples.extend(times_s)
    return statistics.median(times_s)


BURN_S = 0.02  # at least this much heavy GPU work ahead of each timed run
_BURN: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float] | None = None


def _burn(seconds: float, device: torch.device) -> None:
    """Queues about `seconds` of bf16 GEMMs: work that keeps the GPU busy at the clocks and
    power of a training step (an idle wait, such as torch.cuda._sleep, lets it boost instead)."""
    global _BURN
    if _BURN is None:
        a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        b, c = torch.randn_like(a), torch.empty_like(a)
        for _ in range(20):
            torch.mm(a, b, out=c)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(50):
            torch.mm(a, b, out=c)
        end.record()
        end.synchronize()
        _BURN = (a, b, c, start.elapsed_time(end) / 1e3 / 50)
    a, b, c, each_s = _BURN
    for _ in range(max(1, math.ceil(seconds / each_s))):
        torch.mm(a, b, out=c)


def release_burn() -> None:
    """Frees the burn's GEMM operands (so that they are not counted as the runtime's memory)."""
    global _BURN
    _BURN = None


def gpu_time_s(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeats: int = 5
) -> float:
    """Median GPU seconds of `fn()`: median_time_s with each run queued behind heavy GPU work that
    lasts longer than the host takes to issue the run, so the events bracket its kernels back to
    back and host launch time drops out (the profile measures that apart: its launch floor), at
    the clocks of a busy GPU. On a CPU, the wall clock."""
    return median_time_s(fn, device, warmup=warmup, repeats=repeats, behind_busy_gpu=True)


def reset_peak(device: torch.device) -> int:
    """Resets the allocator's peak and returns the bytes allocated now (0 on CPU)."""
    if device.type != "cuda":
        return 0
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def allocated_bytes(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def peak_allocated_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    synchronize(device)
    return torch.cuda.max_memory_allocated(device)
