"""The joint MILP reference against brute force over the same candidates on tiny batches."""

from __future__ import annotations

import itertools
import math
import time

import pytest

import zellige
from zellige import _core, joint


def tiny_cost_model(model: str = "tiny", gpus: int = 4, gpus_per_node: int = 2, gib: int = 0):
    """A small cluster with slow links, so that sharding is not free; `gib` shrinks the GPUs."""
    cluster = zellige.make_cluster(gpus, gpus_per_node)
    cluster.intra_node_bytes_per_s = 1e10
    cluster.inter_node_bytes_per_s = 1e9
    if gib:
        cluster.gpu_memory_bytes = gib << 30
    return _core.CostModel(zellige.model_preset(model), zellige.load_profile(), cluster)


def tokens_batch(num_tokens: list[int], text_tokens: int = 16) -> zellige.Batch:
    batch = zellige.Batch()
    batch.sequences = [
        zellige.sequence_from_tokens(i, "video", n, text_tokens, i % 2)
        for i, n in enumerate(num_tokens)
    ]
    return batch


def brute_force(candidates, num_ranks: int, free_bytes: float) -> float:
    """The smallest linearised makespan over every combination that fits in memory."""
    best = math.inf
    for combination in itertools.product(*candidates):
        load = [0.0] * num_ranks
        memory = [0.0] * num_ranks
        for cand in combination:
            for r, t, m in zip(cand.ranks, cand.load_s, cand.memory_bytes, strict=True):
                load[r] += t
                memory[r] += m
        if max(memory) <= free_bytes:
            best = min(best, max(load))
    return best


CASES = {
    "one-long": ("tiny", [30000], 0),
    "two-mid": ("tiny", [5000, 7000], 0),
    "long-and-short": ("wan-1.3b", [40000, 2000, 1500], 0),
    "three-equal": ("tiny", [3000, 3000, 3000], 0),
    "pairs": ("wan-1.3b", [20000, 20000, 4000, 4000], 0),
    "memory-bound": ("wan-1.3b", [60000, 20000, 3000], 24),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_joint_equals_brute_force_on_tiny_batches(case: str) -> None:
    model, lengths, gib = CASES[case]
    cost_model = tiny_cost_model(model, gib=gib)
    batch = tokens_batch(lengths, 512 if model != "tiny" else 16)
    num_ranks = cost_model.cluster.num_ranks()
    problem = joint.joint_problem(
        batch, cost_model, max_windows_per_shape=100, max_degree=num_ranks, all_strategies=True
    )
    candidates = problem.per_sequence(len(batch.sequences))
    expected = brute_force(candidates, num_ranks, problem.free_bytes)
    result = joint.solve_joint(batch, cost_model, problem, time_limit_s=30, seed=0)
    assert result.optimal
    assert result.mip_gap == 0
    assert result.objective_s == pytest.approx(expected, rel=1e-6)
    # The plan is the MILP's choice, priced exactly by the cost model.
    cost = cost_model.evaluate(batch, result.plan)
    assert result.plan.predicted.makespan_s == pytest.approx(cost.makespan_s)
    assert cost.fits
    zellige.validate_plan(result.plan, batch, num_ranks, cost_model.model.num_heads)


def test_memory_bound_case_needs_sharding() -> None:
    """The memory-bound case above is one: its long video fits on no single rank."""
    model, lengths, gib = CASES["memory-bound"]
    cost_model = tiny_cost_model(model, gib=gib)
    batch = tokens_batch(lengths, 512)
    plan = joint.plan_joint(batch, cost_model, time_limit_s=30)
    assert plan.placements[0].degree() >= 2
    assert cost_model.evaluate(batch, plan).fits


def test_plan_joint_reports_gap_and_optimality() -> None:
    cost_model = zellige.make_cost_model("mmdit-11b", 8)
    batch = zellige.generate("knapformer-joint", 8, 0)
    plan = joint.plan_joint(batch, cost_model, time_limit_s=5, seed=1)
    assert plan.planner == "joint"
    fields = dict(item.split("=", 1) for item in plan.note.split())
    assert float(fields["mip_gap"]) >= 0
    assert fields["optimal"] in ("true", "false")
    assert float(fields["dual_bound_s"]) <= float(fields["milp_makespan_s"]) * (1 + 1e-9)
    assert plan.plan_ms > 0
    zellige.validate_plan(plan, batch, 8, cost_model.model.num_heads)
    # Any plan, the joint one included, is bounded below.
    bound = zellige.makespan_lower_bound(batch, cost_model)
    assert plan.predicted.makespan_s >= bound * (1 - 1e-9)


def test_candidates_prune_short_sequences_to_local() -> None:
    cost_model = zellige.make_cost_model("wan-14b", 16)
    batch = zellige.generate("wan-stage2", 16, 0)
    problem = joint.joint_problem(batch, cost_model)
    assert len(problem.groups) == 2  # wan-stage2: one image size, one video size
    candidates = problem.per_sequence(len(batch.sequences))
    for sequence, options in zip(batch.sequences, candidates, strict=True):
        degrees = {len(c.ranks) for c in options}
        assert 1 in degrees
        if sequence.num_tokens < 2000:  # images: a few % of a rank's load
            assert degrees == {1}
        else:  # videos: sharding options on node windows
            assert max(degrees) >= 2
    assert all(len([c for c in options if len(c.ranks) == 1]) == 16 for options in candidates)


def test_time_limit_covers_candidate_construction() -> None:
    """17.6: the limit stops the construction too, with a message naming the stage."""
    cost_model = zellige.make_cost_model("wan-14b", 64)
    batch = zellige.generate("opensora2-stage2", 64, 0)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"time limit ran out while .*"):
        joint.plan_joint(batch, cost_model, time_limit_s=1e-3, warm_start=False)
    assert time.perf_counter() - start < 5.0


def test_warm_start_skipped_when_it_would_take_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """17.6: the zellige warm start cannot be interrupted, so plan_joint skips it when its
    estimate exceeds a quarter of the limit (and runs it otherwise)."""
    cost_model = zellige.make_cost_model("mmdit-11b", 8)
    batch = zellige.generate("knapformer-joint", 8, 0)
    calls = []
    real_make_plan = joint._core.make_plan

    def recording_make_plan(*args, **kwargs):
        calls.append(args[0])
        return real_make_plan(*args, **kwargs)

    monkeypatch.setattr(joint._core, "make_plan", recording_make_plan)
    plan = joint.plan_joint(batch, cost_model, time_limit_s=5, seed=1)
    assert calls == ["zellige"] and "warm_start=skipped" not in plan.note
    # The same batch as if the planner took a second per sequence: 5 s is not enough.
    monkeypatch.setattr(joint, "_WARM_START_S_PER_SEQUENCE", 1.0)
    assert joint.warm_start_estimate_s(batch, cost_model) > 5 * 0.25
    calls.clear()
    plan = joint.plan_joint(batch, cost_model, time_limit_s=5, seed=1)
    assert calls == [] and "warm_start=skipped" in plan.note
    assert cost_model.evaluate(batch, plan).fits


def test_warm_start_is_the_planners_plan() -> None:
    """zellige's placements are candidates and the MILP's first incumbent, so the reference's
    linearised makespan is never above that of zellige's plan."""
    cost_model = zellige.make_cost_model("mmdit-11b", 16)
    batch = zellige.generate("knapformer-joint", 16, 2)
    warm = zellige.make_plan("zellige", batch, cost_model)
    problem = joint.joint_problem(batch, cost_model, warm_plan=warm)
    assert problem.warm_counts is not None
    chosen = {}
    for members, options, counts in zip(
        problem.groups, problem.candidates, problem.warm_counts, strict=True
    ):
        assert sum(counts) == len(members)
        for cand, count in zip(options, counts, strict=True):
            if count:
                key = (tuple(cand.ranks), cand.placement.strategy.name)
                chosen[key] = chosen.get(key, 0) + count
    expected = {}
    for p in warm.placements:
        key = (tuple(p.ranks), p.strategy.name)
        expected[key] = expected.get(key, 0) + 1
    assert chosen == expected
    result = joint.solve_joint(batch, cost_model, problem, time_limit_s=5)
    loads = [0.0] * problem.num_ranks
    for options, counts in zip(problem.candidates, problem.warm_counts, strict=True):
        for cand, count in zip(options, counts, strict=True):
            for r, t in zip(cand.ranks, cand.load_s, strict=True):
                loads[r] += count * t
    assert result.objective_s <= max(loads) * (1 + 1e-9)
