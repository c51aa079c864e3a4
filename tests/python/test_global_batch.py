"""The global-batch planner from Python: sizes and draws, the brute-force oracle on tiny global
batches, the baselines, JSON, and `zellige plan/compare --global-batch`."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import zellige
from zellige import _core

# As in tests/cpp/global_batch_test.cc: the planner tries a handful of cuts, the oracle all.
ORACLE_TOLERANCE = 0.02


def tight_cost_model(model: str, tokens_per_rank: int) -> zellige.CostModel:
    """4 GPUs whose room above the training state holds one local sequence of that many tokens."""
    probe = zellige.make_cost_model(model, 4)
    sequence = zellige.sequence_from_tokens(0, "video", tokens_per_rank, 0, 0)
    placement = zellige.make_placement(0, zellige.Strategy.local, [0])
    activation_bytes = max(share.memory_bytes for share in probe.shares(sequence, placement))
    headroom = probe.options.memory_headroom
    memory_bytes = int((probe.fixed_bytes() + activation_bytes) / (1 - headroom))
    return zellige.make_cost_model(model, 4, gpu_memory_bytes=memory_bytes)


def batch_of(tokens: list[int]) -> zellige.Batch:
    batch = zellige.Batch()
    batch.sequences = [
        zellige.sequence_from_tokens(i, "video", count, 0, i % 4) for i, count in enumerate(tokens)
    ]
    return batch


def partitions(count: int, max_parts: int):
    """Every assignment of `count` items to at most `max_parts` unlabeled parts."""

    def extend(prefix: list[int]):
        if len(prefix) == count:
            yield list(prefix)
            return
        for label in range(min(max(prefix, default=-1) + 2, max_parts)):
            yield from extend([*prefix, label])

    yield from extend([])


def brute_force_step_s(batch: zellige.Batch, cost_model: zellige.CostModel) -> float:
    best_s = math.inf
    ids = [sequence.id for sequence in batch.sequences]
    for labels in partitions(len(ids), 3):
        parts = [
            [i for i, label in zip(ids, labels, strict=True) if label == k]
            for k in range(max(labels) + 1)
        ]
        try:
            plan = zellige.place_micro_batches("zellige", batch, parts, cost_model)
        except zellige.PlanMemoryError:
            continue
        best_s = min(best_s, plan.step_time_s)
    return best_s


def check_plan(plan: zellige.GlobalPlan, batch: zellige.Batch, cost_model) -> None:
    """Every sequence once; each micro-batch fits and is priced as the step runs it: holding the
    earlier micro-batches' gradients where there are several."""
    seen = sorted(s.id for mb in plan.micro_batches for s in mb.batch.sequences)
    assert seen == sorted(s.id for s in batch.sequences)
    if len(plan.micro_batches) > 1:
        cost_model = cost_model.accumulating_view()
    total_s = 0.0
    for micro_batch in plan.micro_batches:
        cost = cost_model.evaluate(micro_batch.batch, micro_batch.plan)
        assert cost.fits
        total_s += cost.makespan_s
    assert plan.step_time_s == pytest.approx(total_s, rel=1e-12)


@pytest.mark.parametrize(
    "tokens",
    [[30000, 28000, 9000, 5000, 2000, 40000], [12000, 45000, 3000, 3000, 25000, 8000, 50000]],
    ids=["six", "seven"],
)
def test_no_worse_than_brute_force_and_every_baseline(tokens):
    cost_model = tight_cost_model("wan-1.3b", 24000)
    batch = batch_of(tokens)
    plan = zellige.plan_global_batch("zellige", batch, cost_model)
    check_plan(plan, batch, cost_model)
    assert len(plan.micro_batches) > 1  # the batch does exceed memory
    assert plan.step_time_s <= brute_force_step_s(batch, cost_model) * (1 + ORACLE_TOLERANCE)
    for name in zellige.global_batch_baseline_names():
        try:
            other = zellige.plan_global_batch(name, batch, cost_model)
        except zellige.PlanMemoryError:
            continue
        check_plan(other, batch, cost_model)
        assert plan.step_time_s <= other.step_time_s, name


def test_deterministic_and_json():
    cost_model = tight_cost_model("mmdit-11b", 20000)
    batch = batch_of([30000, 6000, 12000, 2000, 18000])
    options = zellige.GlobalBatchOptions(seed=5)
    first = zellige.plan_global_batch("zellige", batch, cost_model, options)
    second = zellige.plan_global_batch("zellige", batch, cost_model, options)
    first_dict, second_dict = (
        zellige.global_plan_to_dict(first),
        zellige.global_plan_to_dict(second),
    )
    for data in (first_dict, second_dict):
        data.pop("plan_ms")
        for micro_batch in data["micro_batches"]:
            micro_batch["plan"].pop("plan_ms")
    assert first_dict == second_dict
    text = zellige.global_plan_to_json(first)
    assert json.loads(text)["step_time_s"] == first.step_time_s
    ids = [i for mb in json.loads(text)["micro_batches"] for i in mb["sequence_ids"]]
    assert sorted(ids) == [0, 1, 2, 3, 4]
    loaded = zellige.global_plan_from_json(text, batch)
    assert zellige.global_plan_to_dict(loaded) == zellige.global_plan_to_dict(first)


def test_json_refuses_a_plan_that_does_not_cover_the_batch():
    cost_model = tight_cost_model("wan-1.3b", 24000)
    batch = batch_of([30000, 6000, 12000, 40000])
    data = zellige.global_plan_to_dict(zellige.plan_global_batch("zellige", batch, cost_model))
    assert len(data["micro_batches"]) > 1
    twice = json.loads(json.dumps(data))
    twice["micro_batches"][1]["sequence_ids"].append(twice["micro_batches"][0]["sequence_ids"][0])
    with pytest.raises(ValueError, match="more than one micro-batch"):
        zellige.global_plan_from_dict(twice, batch)
    dropped = json.loads(json.dumps(data))
    del dropped["micro_batches"][0]
    with pytest.raises(ValueError, match="in no micro-batch"):
        zellige.global_plan_from_dict(dropped, batch)
    with pytest.raises(ValueError, match="global plan"):
        zellige.global_plan_from_json("[]", batch)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1024", zellige.GlobalBatchSize(samples=1024)),
        ("50M", zellige.GlobalBatchSize(tokens=50_000_000)),
        ("2.5B", zellige.GlobalBatchSize(tokens=2_500_000_000)),
        ("800k", zellige.GlobalBatchSize(tokens=800_000)),
    ],
)
def test_parse_sizes(text, expected):
    assert zellige.parse_global_batch_size(text) == expected


@pytest.mark.parametrize("text", ["", "0", "1.5", "-3", "12X", "M"])
def test_parse_sizes_rejects(text):
    with pytest.raises(ValueError, match="global batch size"):
        zellige.parse_global_batch_size(text)


def test_draws_are_exact_and_deterministic():
    by_samples = zellige.draw_global_batch("wan-stage2", 8, zellige.GlobalBatchSize(samples=500))
    assert len(by_samples.sequences) == 500
    assert [s.id for s in by_samples.sequences] == list(range(500))
    assert all(0 <= s.source_rank < 8 for s in by_samples.sequences)
    budget = 3_000_000
    by_tokens = zellige.draw_global_batch("wan-stage2", 8, zellige.GlobalBatchSize(tokens=budget))
    tokens = [s.num_tokens for s in by_tokens.sequences]
    assert sum(tokens) >= budget > sum(tokens[:-1])
    again = zellige.draw_global_batch("wan-stage2", 8, zellige.GlobalBatchSize(tokens=budget))
    assert zellige.batch_to_dict(again) == zellige.batch_to_dict(by_tokens)


def test_bad_planner_and_cut():
    cost_model = tight_cost_model("wan-1.3b", 24000)
    batch = batch_of([4096, 8192])
    with pytest.raises(ValueError, match="allowed"):
        zellige.plan_global_batch("nope", batch, cost_model)
    with pytest.raises(ValueError, match="no micro-batch"):
        zellige.place_micro_batches("zellige", batch, [[0]], cost_model)


def zellige_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zellige.cli", *args], capture_output=True, text=True, check=False
    )


def test_cli_plan_and_compare_a_global_batch(tmp_path):
    out = tmp_path / "global.json"
    common = ["--workload", "wan-stage2", "--gpus", "8", "--global-batch", "2M"]
    result = zellige_cli("plan", *common, "--planner", "zellige", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "micro-batch 0:" in result.stdout and "step:" in result.stdout
    data = json.loads(out.read_text())
    assert data["planner"] == "zellige" and data["micro_batches"]
    result = zellige_cli("compare", *common, "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["planner"]: row for row in json.loads(result.stdout)}
    assert set(rows) == set(_core.global_batch_planner_names())
    ours = rows["zellige"]["step_time_s"]
    assert all(ours <= row["step_time_s"] for row in rows.values() if row["error"] is None)
    result = zellige_cli("plan", *common[:4], "--global-batch", "lots", "--planner", "zellige")
    assert result.returncode != 0 and "global batch size" in result.stderr


def test_cli_global_batch_from_a_batch_file(tmp_path):
    path = tmp_path / "global.json"
    zellige.save_batch(batch_of([30000, 28000, 9000, 5000, 2000, 40000]), path)
    common = ["--batch", str(path), "--model", "wan-1.3b", "--gpus", "4", "--gpu-memory-gib", "24"]
    result = zellige_cli("plan", *common, "--global-batch", "all", "--planner", "zellige")
    assert result.returncode == 0, result.stderr
    assert "global batch: 6 sequences" in result.stdout
    result = zellige_cli("plan", *common, "--global-batch", "3", "--planner", "wlb-llm")
    assert result.returncode == 0, result.stderr
    assert "global batch: 3 sequences" in result.stdout
    result = zellige_cli("plan", *common, "--global-batch", "10", "--planner", "zellige")
    assert result.returncode != 0 and "below 10 samples" in result.stderr
    workload = ["--workload", "wan-stage2", "--gpus", "8", "--global-batch", "all"]
    result = zellige_cli("compare", *workload)
    assert result.returncode != 0 and "takes a --batch file" in result.stderr
