"""Measured-time feedback (zellige.train.speeds): the per-rank moving averages against a hand
computation, the factors' normalisation and clamps, the loader's channel, and plans made at
speed factors against the cost model's own pricing."""

from __future__ import annotations

import math

import pytest

from zellige.data import StepDataset, make_loader
from zellige.data.loader import StepRequest, _StepRequests
from zellige.pipeline import StepForecast, with_speed_factors
from zellige.train.config import resolve_config, tiny_cpu
from zellige.train.speeds import (
    MAX_SPEED_FACTOR,
    MIN_SPEED_FACTOR,
    SLOW_RANK_ENV,
    RankTimes,
    SlowRank,
    SpeedEstimate,
    imbalance,
)


def _forecast(time_s, layers_s=None) -> StepForecast:
    layers_s = layers_s if layers_s is not None else [t / 2 for t in time_s]
    return StepForecast(
        rank_speed_factors=(), rank_time_s=tuple(time_s), rank_layers_s=tuple(layers_s)
    )


def _times(busy_s, attention_s=None) -> RankTimes:
    attention_s = attention_s if attention_s is not None else [b / 2 for b in busy_s]
    layers = tuple(b - a for b, a in zip(busy_s, attention_s, strict=True))
    return RankTimes(layers_s=layers, attention_s=tuple(attention_s))


def _reference_factors(ratios: list[float]) -> list[float]:
    speeds = [1 / r for r in ratios]
    mean = sum(speeds) / len(speeds)
    return [min(MAX_SPEED_FACTOR, max(MIN_SPEED_FACTOR, s / mean)) for s in speeds]


def test_estimate_follows_the_moving_average_of_measured_over_predicted():
    estimate = SpeedEstimate(3, smoothing=0.25, start_step=1)
    assert estimate.speed_factors() is None
    steps = [([1.0, 2.0, 1.0], [3.0, 2.0, 1.0]), ([2.0, 2.0, 2.0], [2.0, 8.0, 2.0])]
    ratios = None
    for step, (predicted, busy) in enumerate(steps, start=1):
        estimate.update(step, _forecast(predicted), _times(busy))
        newest = [b / p for b, p in zip(busy, predicted, strict=True)]
        if ratios is None:
            ratios = newest
        else:
            ratios = [0.75 * r + 0.25 * n for r, n in zip(ratios, newest, strict=True)]
    assert estimate.speed_factors() == pytest.approx(_reference_factors(ratios), rel=1e-12)
    assert sum(estimate.speed_factors()) / 3 == pytest.approx(1.0, rel=1e-12)


def test_slow_rank_gets_a_low_factor_and_a_recovered_rank_its_share_back():
    estimate = SpeedEstimate(4, smoothing=0.5, start_step=1)
    predicted = [1.0, 1.0, 1.0, 1.0]
    estimate.update(1, _forecast(predicted), _times([1.0, 3.0, 1.0, 1.0]))
    factors = estimate.speed_factors()
    # speeds 1, 1/3, 1, 1 over their mean 10/12
    assert factors == pytest.approx([1.2, 0.4, 1.2, 1.2], rel=1e-12)
    for step in range(2, 9):  # recovered: the excess ratio halves every step
        estimate.update(step, _forecast(predicted), _times([1.0, 1.0, 1.0, 1.0]))
    excess = 2.0 * 0.5**7
    assert estimate.speed_factors() == pytest.approx(
        _reference_factors([1.0, 1.0 + excess, 1.0, 1.0]), rel=1e-12
    )
    assert min(estimate.speed_factors()) > 0.98


def test_steps_before_the_start_are_not_measured():
    estimate = SpeedEstimate(2, smoothing=0.5, start_step=3)
    estimate.update(1, _forecast([1.0, 1.0]), _times([1.0, 9.0]))
    estimate.update(2, _forecast([1.0, 1.0]), _times([1.0, 9.0]))
    assert estimate.speed_factors() is None and not estimate.measured
    estimate.update(3, _forecast([1.0, 1.0]), _times([1.0, 1.0]))
    assert estimate.speed_factors() == (1.0, 1.0)


def test_rank_without_work_keeps_its_average_and_unmeasured_ranks_count_as_the_mean():
    estimate = SpeedEstimate(3, smoothing=1.0, start_step=1)
    estimate.update(1, _forecast([1.0, 1.0, 0.0]), _times([1.0, 2.0, 0.001]))
    # rank 2 had nothing to do: not measured, factor 1 after the others' normalisation
    assert estimate.speed_factors() == pytest.approx([4 / 3, 2 / 3, 1.0], rel=1e-12)
    estimate.update(2, _forecast([0.0, 1.0, 1.0]), _times([0.5, 2.0, 1.0]))
    # rank 0 keeps its ratio 1 from step 1 (smoothing 1 would otherwise replace it)
    assert estimate.speed_factors() == pytest.approx(_reference_factors([1.0, 2.0, 1.0]), rel=1e-12)


def test_factors_are_clamped():
    estimate = SpeedEstimate(3, smoothing=1.0, start_step=1)
    estimate.update(1, _forecast([1.0, 1.0, 1.0]), _times([1.0, 1.0, 1000.0]))
    factors = estimate.speed_factors()
    assert factors[2] == MIN_SPEED_FACTOR
    assert factors[0] == factors[1] == pytest.approx(1 / ((2 + 1e-3) / 3), rel=1e-12)


def test_layers_and_attention_are_averaged_apart():
    estimate = SpeedEstimate(2, smoothing=1.0, start_step=1)
    forecast = _forecast([2.0, 2.0], layers_s=[1.0, 1.0])
    # rank 1: per-token layers as predicted (x1), attention with its exchanges 3x slower
    estimate.update(1, forecast, RankTimes(layers_s=(1.0, 1.0), attention_s=(1.0, 3.0)))
    assert estimate.layers_speed_factors() == (1.0, 1.0)
    assert estimate.attention_speed_factors() == pytest.approx([1.5, 0.5], rel=1e-12)
    assert estimate.speed_factors() == pytest.approx(_reference_factors([1.0, 2.0]), rel=1e-12)


@pytest.mark.parametrize(
    "smoothing,start",
    [(0.0, 1), (1.5, 1), (math.nan, 1), (0.5, 0)],
    ids=["zero", "above-1", "nan", "start-0"],
)
def test_estimate_refuses_bad_options(smoothing, start):
    with pytest.raises(ValueError):
        SpeedEstimate(2, smoothing=smoothing, start_step=start)


def test_imbalance():
    assert imbalance([1.0, 1.0, 1.0]) == 1.0
    assert imbalance([3.0, 1.0, 1.0, 1.0]) == pytest.approx(2.0)


def test_slow_rank_hook_parses_one_variable(monkeypatch):
    monkeypatch.delenv(SLOW_RANK_ENV, raising=False)
    assert SlowRank.from_env(4) is None
    monkeypatch.setenv(SLOW_RANK_ENV, "2:3")
    hook = SlowRank.from_env(4)
    assert hook == SlowRank(rank=2, factor=3.0)
    forecast = _forecast([0.1, 0.2, 0.3, 0.4])
    assert hook.delay_s(2, 0.5, forecast) == pytest.approx(1.0)
    assert hook.delay_s(1, 0.5, forecast) == 0.0
    monkeypatch.setenv(SLOW_RANK_ENV, "1:2:10")
    hook = SlowRank.from_env(4)
    assert hook.delay_s(1, 0.5, forecast) == pytest.approx(4.0)  # 10 x 2 x 0.2
    assert hook.delay_s(3, 0.5, forecast) == pytest.approx(4.0)  # 10 x 0.4
    for bad in ("1", "x:2", "4:2", "-1:2", "1:0.5", "1:2:-1", "1:2:3:4", "1:inf"):
        monkeypatch.setenv(SLOW_RANK_ENV, bad)
        with pytest.raises(ValueError, match=SLOW_RANK_ENV):
            SlowRank.from_env(4)


def test_sampler_reads_the_speed_factors_when_each_step_is_drawn():
    current = [None]
    requests = iter(_StepRequests(5, 3, lambda: current[0]))
    assert next(requests) == StepRequest(step=5, speed_factors=None)
    current[0] = (0.5, 1.5)
    assert next(requests) == StepRequest(step=6, speed_factors=(0.5, 1.5))
    current[0] = (1.0, 1.0)
    assert next(requests) == StepRequest(step=7, speed_factors=(1.0, 1.0))
    assert list(_StepRequests(0, 2, None)) == [StepRequest(0), StepRequest(1)]


def _dataset(num_ranks: int) -> StepDataset:
    config = tiny_cpu()
    return StepDataset(
        model=config.model,
        recipe="tiny",
        planner="zellige",
        rank=0,
        num_ranks=num_ranks,
        gpus_per_node=num_ranks,
        seed=0,
        activation_checkpointing=False,
    )


def test_loader_plans_each_step_with_the_factors_of_its_request():
    dataset = _dataset(4)
    factors = (0.5, 1.0, 1.25, 1.25)
    loader = make_loader(dataset, 0, 2, num_workers=0, cuda=False, speed_factors=lambda: factors)
    for step, data in enumerate(loader):
        assert data.forecast.rank_speed_factors == factors
        batch = dataset.batch(step)
        plan = dataset.pipeline().plan(batch, seed=None, speed_factors=factors)
        # the record's times are at the factors; the forecast's at the cluster's own speeds
        nominal = dataset.pipeline().cost_model.evaluate(batch, plan)
        assert data.forecast.rank_time_s == pytest.approx([r.time_s for r in nominal.ranks])
        assert data.record.rank_time_s == pytest.approx(
            [r.time_s / f for r, f in zip(nominal.ranks, factors, strict=True)], rel=1e-12
        )


def test_forecast_without_factors_is_the_plans_own_prediction():
    dataset = _dataset(4)
    data = dataset[1]
    assert data.forecast.rank_speed_factors == ()
    assert data.forecast.rank_time_s == pytest.approx(data.record.rank_time_s, rel=1e-12)


def test_speed_factors_of_one_price_as_the_cost_model_itself():
    dataset = _dataset(4)
    pipeline = dataset.pipeline()
    batch = dataset.batch(0)
    plan = pipeline.plan(batch)
    same = with_speed_factors(pipeline.cost_model, [1.0] * 4)
    assert list(same.evaluate(batch, plan).ranks[r].time_s for r in range(4)) == list(
        pipeline.cost_model.evaluate(batch, plan).ranks[r].time_s for r in range(4)
    )
    with pytest.raises(ValueError, match="3 speed factors for a cluster of 4 ranks"):
        with_speed_factors(pipeline.cost_model, [1.0] * 3)


def test_config_fields_of_the_feedback():
    config = resolve_config(
        "tiny-cpu",
        {},
        {"adapt_speeds": True, "adapt_speeds_start_step": 2, "speed_smoothing": 0.3},
        "",
    )
    assert (
        config.parallelism.adapt_speeds,
        config.parallelism.adapt_speeds_start_step,
        config.parallelism.speed_smoothing,
    ) == (
        True,
        2,
        0.3,
    )
    for key, value in (
        ("adapt_speeds_start_step", 0),
        ("speed_smoothing", 0.0),
        ("speed_smoothing", 2.0),
    ):
        with pytest.raises(ValueError, match=key):
            resolve_config("tiny-cpu", {}, {key: value}, "")


def _cluster_file(tmp_path, slow_speed: float = 0.5):
    path = tmp_path / "cluster.toml"
    path.write_text(
        "gpus_per_node = 1\n"
        '[[nodes]]\nprofile = "h200"\n'
        f'[[nodes]]\nprofile = "h200"\nspeed = {slow_speed}\n'
    )
    return path


def test_cluster_file_prices_each_rank_and_factors_multiply_its_speeds(tmp_path):
    path = _cluster_file(tmp_path)
    config = tiny_cpu()
    dataset = StepDataset(
        model=config.model,
        recipe="tiny",
        planner="zellige",
        rank=0,
        num_ranks=2,
        gpus_per_node=8,  # the file's node size wins
        seed=0,
        activation_checkpointing=False,
        cluster=str(path),
    )
    pipeline = dataset.pipeline()
    assert pipeline.cost_model.cluster.rank_speeds == [1.0, 0.5]
    assert pipeline.cost_model.cluster.gpus_per_node == 1
    assert with_speed_factors(pipeline.cost_model, [0.5, 2.0]).cluster.rank_speeds == [0.5, 1.0]
    assert pipeline.cost_model.cluster.rank_speeds == [1.0, 0.5]  # its own cluster unchanged
    data = dataset[0]
    # the forecast is at the file's speeds: the slow rank's time is its nominal time doubled
    batch = dataset.batch(0)
    plan = pipeline.plan(batch, seed=None)
    ranks = pipeline.cost_model.evaluate(batch, plan).ranks
    assert data.forecast.rank_time_s == pytest.approx([r.time_s for r in ranks], rel=1e-12)


def test_train_refuses_a_cluster_file_of_another_size(tmp_path):
    from zellige.train.loop import preflight

    path = _cluster_file(tmp_path)
    config = resolve_config("tiny-cpu", {}, {"cluster": str(path)}, "")
    assert preflight(config, num_ranks=2).first_step == 0
    with pytest.raises(ValueError, match="its nodes hold 2 GPUs, this run has 4 ranks"):
        preflight(config, num_ranks=4)
    (tmp_path / "bad.toml").write_text('gpus_per_node = 1\n[[nodes]]\nprofile = "nope"\n')
    bad = resolve_config("tiny-cpu", {}, {"cluster": str(tmp_path / "bad.toml")}, "")
    with pytest.raises(ValueError, match="nodes\\[0\\]"):
        preflight(bad, num_ranks=1)
