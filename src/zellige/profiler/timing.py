"""Timing and memory probes for the profiler: CUDA events on a GPU, the wall clock on a CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


SLOW_RUN_S = 0.1  # past this, a few repeats are enough and more would cost minutes


def median_time_s(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeats: int = 5
) -> float:
    """Median seconds of `fn()` over `repeats` runs after `warmup` untimed ones (at least one
    warm-up when warmup > 0; a run slower than SLOW_RUN_S gets one warm-up and at most three
    repeats).

    On CUDA each run is bracketed by events, so host launch overhead that the GPU hides is not
    counted, but a launch-bound run still shows its launch gaps."""
    if warmup > 0:
        synchronize(device)
        start_s = time.perf_counter()
        fn()
        synchronize(device)
        if time.perf_counter() - start_s > SLOW_RUN_S:
            warmup, repeats = 1, min(repeats, 3)
        for _ in range(warmup - 1):
            fn()
    synchronize(device)
    times_s = []
    if device.type == "cuda":
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
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
    return statistics.median(times_s)


_SLEEP_CYCLES_PER_S: float | None = None
MAX_SLEEP_S = 0.2


def _sleep_cycles_per_s() -> float:
    """GPU clock cycles per second of torch.cuda._sleep, measured once."""
    global _SLEEP_CYCLES_PER_S
    if _SLEEP_CYCLES_PER_S is None:
        cycles = 20_000_000
        torch.cuda._sleep(cycles // 10)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _SLEEP_CYCLES_PER_S = cycles / (start.elapsed_time(end) / 1e3)
    return _SLEEP_CYCLES_PER_S


def gpu_time_s(
    fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeats: int = 5
) -> float:
    """Median GPU seconds of `fn()`: as median_time_s, but each run is queued behind a GPU sleep
    longer than the host takes to issue it, so the events bracket its kernels back to back and
    host launch time drops out (the profile measures that apart: its launch floor). On a CPU,
    the wall clock."""
    if device.type != "cuda":
        return median_time_s(fn, device, warmup=warmup, repeats=repeats)
    synchronize(device)
    start_s = time.perf_counter()
    fn()
    host_s = time.perf_counter() - start_s  # issue time (or more, if fn synchronizes)
    synchronize(device)
    if time.perf_counter() - start_s > SLOW_RUN_S:
        warmup, repeats = 1, min(repeats, 3)
    for _ in range(warmup - 1):
        fn()
    sleep_cycles = int(min(MAX_SLEEP_S, 2.0 * host_s + 1e-3) * _sleep_cycles_per_s())
    synchronize(device)
    times_s = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(sleep_cycles)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times_s.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times_s)


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
