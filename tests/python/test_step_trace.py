"""bench/step_trace.py on a hand-made trace: kernels attributed to phases, inside or outside the
blocks, and the device's idle gaps with the host range that ended them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "step_trace.py"
_spec = importlib.util.spec_from_file_location("step_trace", _PATH)
step_trace = importlib.util.module_from_spec(_spec)
sys.modules["step_trace"] = step_trace
_spec.loader.exec_module(step_trace)


def _x(name: str, cat: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "args": args}


def test_summary_attributes_kernels_and_gaps() -> None:
    events = [
        _x("zellige.step.setup", "user_annotation", 0, 100),
        _x("zellige.step.forward", "user_annotation", 100, 400),
        _x("zellige.step.optimizer", "user_annotation", 500, 100),
        _x("zellige.step.end", "user_annotation", 600, 300),
        _x("zellige.block", "user_annotation", 200, 200),
        _x("aten::index_select", "cpu_op", 50, 40),
        # setup: a copy launched at 60 runs 300-310 (the device idled 300 us waiting)
        _x("cudaMemcpyAsync", "cuda_runtime", 60, 5, correlation=1),
        _x("Memcpy HtoD (Pinned -> Device)", "gpu_memcpy", 300, 10, tid=7, correlation=1),
        # forward: an embedding GEMM launched before the block (outside), one inside it
        _x("cudaLaunchKernel", "cuda_runtime", 150, 5, correlation=2),
        _x("sm90_xmma_gemm_bf16", "kernel", 310, 40, tid=7, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 250, 5, correlation=3),
        _x("sm90_xmma_gemm_bf16", "kernel", 350, 200, tid=7, correlation=3),
        # optimizer: fused AdamW after a gap of 50 us
        _x("cudaLaunchKernel", "cuda_runtime", 590, 5, correlation=4),
        _x("fused_adamw_kernel", "kernel", 600, 100, tid=7, correlation=4),
    ]
    text = step_trace.summarise_trace({"traceEvents": events})
    assert "step window on the host: 0.90 ms" in text
    assert "device busy 0.35 ms" in text  # 10 + 40 + 200 + 100 us
    assert "inside the blocks 0.20 ms, outside 0.15 ms" in text
    assert "setup: 0.01 = memcpy 0.01" in text
    assert "forward: 0.04 = gemm 0.04" in text
    assert "optimizer: 0.10 = optimizer/foreach 0.10" in text
    # gaps: 0-300 (ended by the setup copy, launched inside aten::index_select), 550-600, 700-900
    assert "device idle 0.55 ms in 3 gaps" in text
    assert "setup: aten::index_select -> Memcpy HtoD" in text
    assert "after the last kernel" in text


def test_summary_without_device_activity() -> None:
    events = [_x("zellige.step.setup", "user_annotation", 0, 100)]
    assert "host times only" in step_trace.summarise_trace({"traceEvents": events})
    assert "no zellige.step" in step_trace.summarise_trace({"traceEvents": []})
