"""The one step pipeline (zellige.pipeline) against the core's own calls: plan() is make_plan or
the caller's plan predicted, compile() is the plan compiler, prepare() carries both with the
plan's typed record, and everything a loader worker makes pickles."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

import zellige
from zellige import _core
from zellige.pipeline import (
    PreparedStep,
    StepPipeline,
    StepRecord,
    check_planner_name,
    make_step_plan,
)

NUM_RANKS = 2


def _setup() -> tuple[_core.ModelSpec, _core.CostModel, _core.Batch]:
    spec = zellige.resolve_model("tiny")
    cost_model = zellige.make_cost_model(spec, NUM_RANKS, NUM_RANKS)
    sequences = [
        {"id": i, "num_tokens": 64 * (i + 1), "text_tokens": 8, "source_rank": i % NUM_RANKS}
        for i in range(5)
    ]
    batch = zellige.batch_from_dict({"sequences": sequences}, num_ranks=NUM_RANKS)
    return spec, cost_model, batch


def _same_plan(a: _core.Plan, b: _core.Plan) -> None:
    assert zellige.plan_to_dict(a) | {"plan_ms": 0} == zellige.plan_to_dict(b) | {"plan_ms": 0}


@pytest.mark.parametrize("planner", ["zellige", "dp-cost", "static-cp:2"])
def test_plan_is_the_named_planners(planner: str) -> None:
    spec, cost_model, batch = _setup()
    pipeline = StepPipeline(spec, cost_model, planner, seed=3)
    reference = _core.make_plan(planner, batch, cost_model, _core.PlannerOptions(seed=7))
    _same_plan(pipeline.plan(batch, seed=7), reference)
    reference = _core.make_plan(planner, batch, cost_model, _core.PlannerOptions(seed=3))
    _same_plan(pipeline.plan(batch), reference)  # the pipeline's seed by default


def test_a_function_and_a_fixed_plan_are_predicted() -> None:
    spec, cost_model, batch = _setup()
    reference = _core.make_plan("dp-cost", batch, cost_model, _core.PlannerOptions())
    bare = zellige.plan_from_dict(
        {k: v for k, v in zellige.plan_to_dict(reference).items() if k != "predicted"}
    )
    assert list(bare.predicted.rank_time_s) == []
    fixed = StepPipeline(spec, cost_model, bare).plan(batch)
    _same_plan(fixed, reference)
    assert list(bare.predicted.rank_time_s) == []  # the fixed plan itself stays as it was

    def mine(batch_: _core.Batch, cost_model_: _core.CostModel) -> _core.Plan:
        return zellige.plan_from_dict(zellige.plan_to_dict(bare))

    _same_plan(make_step_plan(mine, batch, cost_model, seed=0), reference)


def test_prepare_compiles_and_records_the_plan() -> None:
    spec, cost_model, batch = _setup()
    pipeline = StepPipeline(spec, cost_model, "dp-cost")
    plan = pipeline.plan(batch, seed=5)
    for rank in range(NUM_RANKS):
        prepared = pipeline.prepare(batch, rank, index=4, seed=5)
        assert prepared.error is None and prepared.index == 4 and prepared.rank == rank
        reference = _core.compile_step_program(batch, plan, rank, spec.num_heads, False)
        assert prepared.program.to_bytes() == reference.to_bytes()
        assert prepared.sequence_num_tokens == tuple(s.num_tokens for s in batch.sequences)
        record = prepared.record
        predicted = plan.predicted
        assert replace(record, plan_ms=0.0) == replace(StepRecord.from_plan(plan), plan_ms=0.0)
        assert record.plan_ms >= 0
        assert record.rank_time_s == tuple(predicted.rank_time_s)
        assert record.rank_peak_bytes == tuple(predicted.rank_peak_bytes)
        assert record.rank_checkpointed_layers == tuple(predicted.rank_checkpointed_layers)
        assert record.makespan_s == predicted.makespan_s and record.planner == "dp-cost"
        times = predicted.rank_time_s
        assert record.planned_imbalance == max(times) / (sum(times) / len(times))
        again = pickle.loads(pickle.dumps(prepared))
        assert isinstance(again, PreparedStep) and again.record == record
        assert again.program.to_bytes() == prepared.program.to_bytes()


def test_a_plan_that_does_not_compile_becomes_the_steps_error() -> None:
    """prepare() keeps compile()'s ValueError as the step's error (load() raises it on every
    rank), with the plan's record still there."""
    spec, cost_model, batch = _setup()

    class Refusing(StepPipeline):
        def compile(self, batch_, plan, rank):
            raise ValueError(f"rank {rank}: refused")

    prepared = Refusing(spec, cost_model, "dp-cost").prepare(batch, 1, index=0)
    assert prepared.program is None and prepared.error == "rank 1: refused"
    assert prepared.record.planner == "dp-cost"
    with pytest.raises(ValueError, match="rank 1: refused"):
        StepPipeline.load(prepared.program, "cpu", error=prepared.error)


def test_an_unknown_planner_fails_when_the_pipeline_is_built() -> None:
    spec, cost_model, _ = _setup()
    with pytest.raises(ValueError, match="unknown planner 'zelige'"):
        StepPipeline(spec, cost_model, "zelige")
    check_planner_name("joint")  # the MILP reference is a planner name too
