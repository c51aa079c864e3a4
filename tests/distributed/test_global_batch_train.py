"""A global batch at run time (docs/global-batch.md): one optimizer step over K planned
micro-batches with gradient accumulation gives the weights of one single-process step over the
whole global batch, for the Wan (cross-attention) and MMDiT (joint attention) models; and
`zellige.train --global-batch` trains (each run under a timeout, so a hang fails the test)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_train import RELATIVE_BOUND, _max_relative_error, _torchrun, _train

from zellige.train.config import tiny_cpu
from zellige.train.loop import preflight

COUNTS = ["1", "2", "3", "4"]


def _weights_error(got: dict, want: dict) -> float:
    """Largest weight difference over the model's largest weight. Per tensor would be noise: a
    key projection's bias has a zero true gradient (softmax ignores a shift of the keys), so its
    gradient is rounding noise, which AdamW's first step turns into updates of up to the
    learning rate in either direction."""
    scale = max(float(w.abs().max()) for w in want.values())
    return max(float((got[name] - w).abs().max()) for name, w in want.items()) / scale


@pytest.mark.parametrize(
    ("model", "nproc"), [("wan", 2), ("mmdit", 3)], ids=["wan-2ranks", "mmdit-3ranks"]
)
def test_k_micro_batches_give_the_global_batch_step(tmp_path: Path, model: str, nproc: int) -> None:
    out = tmp_path / f"global-{model}.pt"
    worker = str(Path(__file__).with_name("global_batch_worker.py"))
    _torchrun(nproc, worker, str(out), model, *COUNTS)
    results = torch.load(out, weights_only=False)
    reference = results.pop("reference")
    strategies = set()
    for count, result in results.items():
        assert result["micro_batches"] == count
        strategies.update(result["strategies"])
        assert result["loss"] == pytest.approx(reference["loss"], rel=RELATIVE_BOUND)
        # the accumulated gradient (all ranks, all micro-batches) is the global batch's
        assert _max_relative_error(result["grads"], reference["grads"]) < RELATIVE_BOUND
        assert _weights_error(result["weights"], reference["weights"]) < RELATIVE_BOUND
    # whole and sharded (Ulysses or ring) sequences in the micro-batches
    assert "local" in strategies and strategies - {"local"}


def test_train_with_a_global_batch(tmp_path: Path) -> None:
    """Two ranks, a global batch of 24 samples per optimizer step: every step trains that many
    sequences as the planner's micro-batches, logs their count and its predicted step time."""
    records = _train(
        2, tmp_path, "global", "--steps", "2", "--global-batch", "24", "--loader-workers", "1"
    )
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        assert record["sequences"] == 24
        assert record["micro_batches"] >= 1
        assert record["predicted_makespan_s"] > 0
        assert record["loss"] > 0 and record["grad_norm"] > 0
    assert json.dumps(records)  # JSON-ready, as written


def test_default_records_one_micro_batch(tmp_path: Path) -> None:
    records = _train(1, tmp_path, "default", "--steps", "1", "--loader-workers", "0")
    assert records[0]["micro_batches"] == 1


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"global_batch": "lots"}, "global_batch: global batch size 'lots'"),
        ({"global_batch": "8", "planner": "dp-cost"}, "unknown global-batch planner 'dp-cost'"),
        (
            {"global_batch": "8", "compute_dtype_gradients": True},
            "compute_dtype_gradients hands one backward's gradients",
        ),
    ],
    ids=["bad-size", "step-planner", "bf16-gradients"],
)
def test_global_batch_input_is_checked_before_training(changes: dict, message: str) -> None:
    config = dataclasses.replace(tiny_cpu(), **changes)
    with pytest.raises(ValueError, match=message):
        preflight(config, num_ranks=1)
