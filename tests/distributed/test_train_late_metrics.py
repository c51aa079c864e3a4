"""A step's metrics read during the next step (TrainConfig.metrics_one_step_late, the default):
the same records and weights as steps that each end with a full sync, on 2 gloo ranks in float64
with checkpoint steps between late ones; a non-finite step stops the run before the next update
and before any save. Resume with late metrics: test_train.py's resume tests (the default)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train import _torchrun

# measured times (and what is derived from them) differ from run to run; everything else is
# the same number, only reported one step later
TIMED = {
    "step_s",
    "tokens_per_s",
    "mfu",
    "plan_ms",
    "busy_s_max",
    "attention_s_max",
    "cross_attention_s_max",
    "data_wait_s_max",
    "measured_imbalance",
    # measured per-rank times and the speed estimates made from them
    "rank_busy_s",
    "speed_estimate",
    "speed_estimate_layers",
    "speed_estimate_attention",
}


def _run(tmp_path: Path, name: str, mode: str, *nan_step: str) -> dict:
    out = tmp_path / f"{name}.pt"
    worker = str(Path(__file__).with_name("late_metrics_worker.py"))
    _torchrun(2, worker, str(out), str(tmp_path / f"ckpt-{name}"), mode, *nan_step)
    return torch.load(out, weights_only=False)


def test_late_metrics_are_the_synchronized_steps_numbers(tmp_path: Path) -> None:
    late, sync = _run(tmp_path, "late", "late"), _run(tmp_path, "sync", "sync")
    assert late["failure"] is None and sync["failure"] is None
    assert [r["step"] for r in late["history"]] == [1, 2, 3, 4, 5]
    for got, want in zip(late["history"], sync["history"], strict=True):
        assert got.keys() == want.keys()
        assert {k: v for k, v in got.items() if k not in TIMED} == {
            k: v for k, v in want.items() if k not in TIMED
        }
        assert got["step_s"] > 0 and got["busy_s_max"] > 0
    assert late["params"].keys() == sync["params"].keys()
    for name, value in late["params"].items():
        assert torch.equal(value, sync["params"][name]), name
    for name in ("late", "sync"):  # the checkpoints of steps 2, 4 and 5
        saved = sorted(p.name for p in (tmp_path / f"ckpt-{name}").glob("step-*"))
        assert saved == ["step-2", "step-4", "step-5"], saved


@pytest.mark.parametrize("mode", ["late", "sync"])
def test_a_non_finite_step_stops_before_the_next_update(tmp_path: Path, mode: str) -> None:
    # step 3 is late (read during step 4, which would save); step 1 the first, late too
    for nan_step in (3, 1):
        got = _run(tmp_path, f"nan{nan_step}-{mode}", mode, str(nan_step))
        for rank in got["ranks"]:
            assert rank["failure"] is not None, got["ranks"]
            assert rank["failure"].startswith(f"step {nan_step}: the loss is nan"), rank
            # step nan_step's update ran (its weights are never saved), the next one did not
            assert rank["updates"] == nan_step, (mode, rank)
        saved = sorted(p.name for p in (tmp_path / f"ckpt-nan{nan_step}-{mode}").glob("step-*"))
        assert saved == (["step-2"] if nan_step == 3 else []), saved
