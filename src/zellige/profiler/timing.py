"""Timing and memory probes for the profiler: CUDA events on a GPU, the wall clock on a CPU."""

from __future__ import annotations

import gc
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

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
    issue_samples: list[float] | None = None,
) -> float:
    """Median seconds of `fn()` over `repeats` runs after `warmup` untimed ones (at least one
    warm-up when warmup > 0; a run slower than SLOW_RUN_S gets one warm-up and at most three
    repeats).

    On CUDA each run is bracketed by events, so host launch overhead that the GPU hides is not
    counted, but a launch-bound run still shows its launch gaps. With `behind_busy_gpu` each run
    is queued behind heavy GPU work lasting longer than the host takes to issue it (see
    gpu_time_s). `samples`, if given, gets the seconds of every timed run; `issue_samples` the
    host's wall seconds of each from its start until `fn()` returned, i.e. every kernel queued,
    before the run's final synchronize (on a CPU, where the device is the host, about the run's
    time). A run that synchronizes inside `fn()` counts that wait as issue time."""
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
    times_s, issues_s = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if behind_busy_gpu:
                _burn(burn_s, device)
            start.record()
        start_s = time.perf_counter()
        fn()
        issues_s.append(time.perf_counter() - start_s)  # before the synchronize: issue only
        if device.type == "cuda":
            end.record()
            end.synchronize()
            times_s.append(start.elapsed_time(end) / 1e3)
        else:
            synchronize(device)
            times_s.append(time.perf_counter() - start_s)
    if samples is not None:
        samples.extend(times_s)
    if issue_samples is not None:
        issue_samples.extend(issues_s)
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


def host_facts() -> dict:
    """What this process's host side looks like now: facts that can slow Python issuing kernels
    (a rank bound by its launch floor runs at the host's speed). Standard library and /proc,
    /sys only; a fact this machine does not expose is None. cpu_mhz is the current clock of the
    CPU the process last ran on; descendant_processes counts children and theirs (torch.compile's
    compile workers are grandchildren); gc_collections are the collections of each generation
    since the process started."""
    tasks = _listdir("/proc/self/task")
    cpu = _last_cpu()
    freq = f"/sys/devices/system/cpu/cpu{cpu}/cpufreq" if cpu is not None else None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "python_threads": threading.active_count(),
        "os_threads": len(tasks) if tasks is not None else None,
        "descendant_processes": _descendants(os.getpid()),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average_1min": round(load[0], 2) if load else None,
        "gc_enabled": gc.isenabled(),
        "gc_counts": list(gc.get_count()),
        "gc_collections": gc_collections(),
        "gc_frozen_objects": gc.get_freeze_count(),
        "cpu": cpu,
        "cpu_mhz": _cpu_mhz(freq, cpu),
        "cpu_max_mhz": _khz_as_mhz(_read(f"{freq}/cpuinfo_max_freq")) if freq else None,
        "cpu_governor": _read(f"{freq}/scaling_governor") if freq else None,
    }


def gc_collections() -> list[int]:
    """Python's garbage collections of each generation since the process started."""
    return [generation["collections"] for generation in gc.get_stats()]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except (OSError, ValueError):
        return None


def _listdir(path: str) -> list[str] | None:
    try:
        return os.listdir(path)
    except OSError:
        return None


def _last_cpu() -> int | None:
    """The CPU this process last ran on: field 39 of /proc/self/stat (after the command's
    parenthesised name, which may hold spaces)."""
    stat = _read("/proc/self/stat")
    if stat is None:
        return None
    fields = stat.rpartition(")")[2].split()
    return int(fields[36]) if len(fields) > 36 and fields[36].isdigit() else None


def _khz_as_mhz(text: str | None) -> float | None:
    return int(text) / 1e3 if text is not None and text.isdigit() else None


def _cpu_mhz(freq: str | None, cpu: int | None) -> float | None:
    """The CPU's current clock: cpufreq's scaling_cur_freq, else its "cpu MHz" in /proc/cpuinfo
    (virtual machines often expose only that, and it may be the nominal clock)."""
    mhz = _khz_as_mhz(_read(f"{freq}/scaling_cur_freq")) if freq else None
    if mhz is not None or cpu is None:
        return mhz
    processor = None
    for line in (_read("/proc/cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "processor":
            processor = value.strip()
        elif key.strip() == "cpu MHz" and processor == str(cpu):
            try:
                return float(value)
            except ValueError:
                return None
    return None


def _descendants(pid: int) -> int | None:
    """Processes below `pid` (children, theirs, ...) from /proc/<pid>/task/*/children; None where
    the kernel does not expose those files."""
    count, pending = 0, [pid]
    while pending:
        parent = pending.pop()
        tasks = _listdir(f"/proc/{parent}/task")
        if tasks is None:
            if parent == pid:
                return None
            continue  # it ended meanwhile
        for task in tasks:
            children = _read(f"/proc/{parent}/task/{task}/children")
            if children is None:
                if parent == pid:
                    return None
                continue
            for child in children.split():
                count += 1
                pending.append(int(child))
    return count


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
