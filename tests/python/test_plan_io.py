"""Plan JSON: exact round trips and a one-line error for every bad input."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import zellige
from zellige import Strategy


def _plan() -> zellige.Plan:
    placements = [
        zellige.make_placement(0, Strategy.local, [5]),
        zellige.make_placement(1, Strategy.ulysses, [8, 9, 10, 11, 12]),
        zellige.make_placement(2, Strategy.ring, [1, 0]),
        zellige.make_placement(3, Strategy.hybrid, [2, 3, 4, 6, 7, 13], 2),
    ]
    predicted = zellige.PlanPrediction(
        makespan_s=0.1 + 0.2,
        rank_time_s=[1 / 3 + i * 1e-17 for i in range(16)] + [],
        rank_peak_bytes=[float(2**40 + 1), 7.0e10, math.pi] + [0.0] * 13,
    )
    return zellige.Plan(
        planner="knapformer:g4n8",
        num_ranks=16,
        placements=placements,
        predicted=predicted,
        plan_ms=0.8123456789012345,
        note="mip_gap=0.0012",
    )


def test_round_trip_is_exact(tmp_path):
    plan = _plan()
    text = zellige.plan_to_json(plan)
    back = zellige.plan_from_json(text)
    assert back == plan
    assert back.predicted.makespan_s == 0.1 + 0.2
    assert zellige.plan_to_json(back) == text
    path = tmp_path / "plan.json"
    zellige.save_plan(plan, path)
    assert zellige.load_plan(path) == plan


def test_format_matches_design_md():
    data = json.loads(zellige.plan_to_json(_plan()))
    assert data["placements"][0] == {"id": 0, "strategy": "local", "ranks": [5]}
    assert data["placements"][3]["strategy"] == "hybrid(2,3)"
    # rank_checkpointed_layers, rank_full_recompute_layers: optional on reading (plans written
    # before them have none)
    assert set(data["predicted"]) == {
        "makespan_s",
        "rank_time_s",
        "rank_peak_bytes",
        "rank_checkpointed_layers",
        "rank_full_recompute_layers",
    }
    older = zellige.plan_from_dict({**data, "predicted": {"makespan_s": 1.0}})
    assert list(older.predicted.rank_full_recompute_layers) == []


def test_optional_fields_and_spaced_hybrid():
    plan = zellige.plan_from_dict(
        {
            "planner": "manual",
            "num_ranks": 4,
            "placements": [{"id": 0, "strategy": "hybrid( 2 , 2 )", "ranks": [0, 1, 2, 3]}],
        }
    )
    assert plan.placements[0].ulysses_degree == 2 and plan.placements[0].ring_degree == 2
    assert plan.predicted.makespan_s == 0.0 and plan.note == ""


def _with(**changes):
    data = json.loads(zellige.plan_to_json(_plan()))
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return data


def _with_placement(index, **changes):
    data = json.loads(zellige.plan_to_json(_plan()))
    for key, value in changes.items():
        if value is None:
            del data["placements"][index][key]
        else:
            data["placements"][index][key] = value
    return data


BAD_PLANS = {
    "missing-planner": (_with(planner=None), "plan: missing field 'planner'"),
    "float-num-ranks": (_with(num_ranks=16.0), "'num_ranks' must be an integer"),
    "bool-num-ranks": (_with(num_ranks=True), "'num_ranks' must be an integer"),
    "placements-not-list": (_with(placements={}), "'placements' must be a list"),
    "unknown-strategy": (
        _with_placement(1, strategy="tensor"),
        "unknown strategy 'tensor' (allowed: local, ulysses, ring, hybrid(u,r)",
    ),
    "hybrid-mismatch": (
        _with_placement(3, strategy="hybrid(2,2)"),
        "sequence 3: strategy hybrid(2,2) does not match its 6 ranks",
    ),
    "hybrid-indivisible": (_with_placement(3, strategy="hybrid(4,2)"), "sequence 3: hybrid"),
    "local-two-ranks": (_with_placement(0, ranks=[1, 2]), "sequence 0: local placement needs 1"),
    "no-ranks": (_with_placement(1, ranks=[]), "sequence 1: placement has no ranks"),
    "float-rank": (_with_placement(1, ranks=[1.5]), "'ranks' must hold integers"),
    "missing-ranks": (_with_placement(2, ranks=None), "sequence 2: missing field 'ranks'"),
    "missing-id": (_with_placement(2, id=None), "placement #2: missing field 'id'"),
    "unknown-field": (_with(plan_s=1.0), "unknown field 'plan_s'"),
    "string-makespan": (
        _with(predicted={"makespan_s": "1.0"}),
        "field 'makespan_s' must be a number",
    ),
    "bad-rank-times": (
        _with(predicted={"makespan_s": 1.0, "rank_time_s": [None]}),
        "'rank_time_s' must hold numbers",
    ),
}


@pytest.mark.parametrize("case", list(BAD_PLANS), ids=list(BAD_PLANS))
def test_bad_plan_gives_one_line_error(case):
    data, message = BAD_PLANS[case]
    with pytest.raises(ValueError) as info:
        zellige.plan_from_json(json.dumps(data), source="p.json")
    text = str(info.value)
    assert message in text
    assert text.startswith("p.json: ") and "\n" not in text


def test_truncated_and_malformed_plan_files(tmp_path):
    text = zellige.plan_to_json(_plan())
    path = tmp_path / "plan.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="truncated JSON"):
        zellige.load_plan(path)
    path.write_text(text.replace(":", "", 1))
    with pytest.raises(ValueError, match="malformed JSON at line 1, column 12"):
        zellige.load_plan(path)


def test_validate_plan_names_the_sequence():
    batch = zellige.Batch(
        sequences=[zellige.sequence_from_tokens(i, "image", 256, 0, 0) for i in range(4)]
    )
    plan = _plan()
    plan.num_ranks = 16
    zellige.validate_plan(plan, batch, 16, 24)
    with pytest.raises(ValueError, match="sequence 1: ulysses degree 5 exceeds the model's 4"):
        zellige.validate_plan(plan, batch, 16, 4)
    plan.placements = plan.placements[:3]
    with pytest.raises(ValueError, match="sequence 3: not placed"):
        zellige.validate_plan(plan, batch, 16, 24)


def test_strategy_names_round_trip():
    for name in ["local", "ulysses", "ring", "hybrid(2,4)"]:
        strategy, u, r = zellige.parse_strategy(name)
        ranks = list(range(8)) if strategy != Strategy.local else [0]
        placement = zellige.make_placement(0, strategy, ranks, u)
        assert zellige.strategy_name(placement) == name


# Finite only: Infinity and NaN are not JSON, so plan files never hold them (issue 17).
_floats = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def _random_plans(draw) -> zellige.Plan:
    num_ranks = draw(st.integers(1, 12))
    placements = []
    for seq_id in draw(st.lists(st.integers(-(2**62), 2**62), max_size=6, unique=True)):
        ranks = draw(st.permutations(range(num_ranks)))[: draw(st.integers(1, num_ranks))]
        divisors = [u for u in range(2, len(ranks) // 2 + 1) if len(ranks) % u == 0]
        choices = [Strategy.local] if len(ranks) == 1 else [Strategy.ulysses, Strategy.ring]
        if divisors:
            choices.append(Strategy.hybrid)
        strategy = draw(st.sampled_from(choices))
        u = draw(st.sampled_from(divisors)) if strategy == Strategy.hybrid else 0
        placements.append(zellige.make_placement(seq_id, strategy, ranks, u))
    return zellige.Plan(
        planner=draw(st.text()),
        num_ranks=num_ranks,
        placements=placements,
        predicted=zellige.PlanPrediction(
            makespan_s=draw(_floats),
            rank_time_s=draw(st.lists(_floats, max_size=12)),
            rank_peak_bytes=draw(st.lists(_floats, max_size=12)),
            rank_checkpointed_layers=draw(st.lists(st.integers(0, 40), max_size=12)),
        ),
        plan_ms=draw(_floats),
        note=draw(st.text()),
    )


@settings(max_examples=200, deadline=None)
@given(_random_plans())
def test_random_plans_round_trip_exactly(plan):
    assert zellige.plan_from_json(zellige.plan_to_json(plan)) == plan


def test_a_non_finite_plan_is_refused_not_written_as_invalid_json():
    plan = zellige.Plan(planner="p", num_ranks=1, plan_ms=float("inf"))
    with pytest.raises(ValueError, match="not JSON compliant"):
        zellige.plan_to_json(plan)
