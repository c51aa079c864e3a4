"""A global batch at run time (docs/global-batch.md): one optimizer step over K planned
micro-batches with gradient accumulation gives the weights of one single-process step over the
whole global batch, for the Wan (cross-attention) and MMDiT (joint attention) models; and
`zellige.train --global-batch` trains (each run under a timeout, so a hang fails the test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_train import RELATIVE_BOUND, _max_relative_error, _torchrun, _train

import zellige
from zellige import _core
from zellige.data import GlobalStepData, StepDataset
from zellige.global_batch import global_plan_to_dict, parse_global_batch_size
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


def test_resume_replays_the_global_batches(tmp_path: Path) -> None:
    """A run saved after 2 of 3 steps and resumed trains the third global batch as the run
    without a stop does (its draw follows the run's seed and the step)."""
    common = ["--dtype", "float64", "--global-batch", "600", "--loader-workers", "0"]
    straight = _train(2, tmp_path, "straight", "--steps", "3", *common)
    out = tmp_path / "ckpt"
    _train(2, tmp_path, "first", "--steps", "2", "--out", str(out), *common)
    resumed = _train(2, tmp_path, "resumed", "--steps", "3", "--resume", str(out), *common)
    assert [r["step"] for r in resumed] == [3]
    assert resumed[0]["tokens"] == straight[2]["tokens"]
    assert resumed[0]["loss"] == straight[2]["loss"]


def _global_datasets(num_ranks: int, **options) -> list[StepDataset]:
    config = tiny_cpu()
    no_checkpointing = _core.CostOptions()
    no_checkpointing.activation_checkpointing = False
    return [
        StepDataset(
            model=config.model.dit,
            recipe="tiny",
            planner="zellige",
            rank=rank,
            num_ranks=num_ranks,
            gpus_per_node=num_ranks,
            seed=3,
            cost_options=no_checkpointing,
            **options,
        )
        for rank in range(num_ranks)
    ]


def test_the_loader_hands_each_sample_to_one_micro_batch() -> None:
    """A global batch cut into 3 micro-batches: each of the batch's samples is in one of them,
    each rank's micro-batches hold its own samples' rows, each divides by the global count, and
    the record sums the micro-batches' predictions."""
    size = parse_global_batch_size("12")
    (probe,) = _global_datasets(1, global_batch=size)
    batch = probe.batch(0)
    sequences = zellige.batch_to_dict(batch)["sequences"]
    for sequence in sequences:
        sequence["source_rank"] = sequence["id"] % 2
    batch = zellige.batch_from_dict({"sequences": sequences}, num_ranks=2)
    ids = [s.id for s in batch.sequences]
    cut = [ids[k::3] for k in range(3)]
    cost_model = _global_datasets(2)[0].pipeline().cost_model
    fixed = global_plan_to_dict(_core.place_micro_batches("zellige", batch, cut, cost_model))
    items = [
        d[0] for d in _global_datasets(2, sequences=sequences, global_plan=fixed, global_batch=size)
    ]
    total_tokens = sum(s.num_tokens for s in batch.sequences)
    for rank, item in enumerate(items):
        assert isinstance(item, GlobalStepData)
        assert item.num_sequences == len(ids) and item.total_tokens == total_tokens
        assert [m.num_sequences for m in item.micro_batches] == [len(c) for c in cut]
        own = sum(s.num_tokens for s in batch.sequences if s.source_rank == rank)
        assert sum(m.source_noisy_TC.shape[0] for m in item.micro_batches) == own
        for micro in item.micro_batches:
            assert micro.total_tokens == total_tokens  # the loss normaliser: the global batch's
            assert micro.error is None
            assert micro.source_noisy_TC.shape[0] == micro.program.visual_route.num_source
        record = item.record
        assert record.num_micro_batches == 3
        assert record.makespan_s == pytest.approx(
            sum(m.record.makespan_s for m in item.micro_batches)
        )
        assert record.rank_peak_bytes == tuple(
            max(peaks)
            for peaks in zip(*(m.record.rank_peak_bytes for m in item.micro_batches), strict=True)
        )
    assert items[0].train_flops == pytest.approx(
        sum(
            zellige.train_flops(probe.pipeline().spec, s.num_tokens, s.text_tokens)
            for s in batch.sequences
        )
    )


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
    config = tiny_cpu().with_fields(**changes)
    with pytest.raises(ValueError, match=message):
        preflight(config, num_ranks=1)
