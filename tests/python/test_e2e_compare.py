"""bench/e2e_compare.py's bookkeeping on synthetic metrics: parsing, means, ratios, the loss and
batch agreement checks and the tuned families' candidates (no training is run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "e2e_compare.py"
_spec = importlib.util.spec_from_file_location("e2e_compare", _PATH)
e2e = importlib.util.module_from_spec(_spec)
sys.modules["e2e_compare"] = e2e  # dataclasses resolve their module by name
_spec.loader.exec_module(e2e)

WARMUP_STEPS = 2


def _record(step: int, *, step_s: float, predicted_s: float, loss: float, tokens: int = 1000):
    return {
        "step": step,
        "loss": loss,
        "step_s": step_s,
        "predicted_makespan_s": predicted_s,
        "tokens": tokens,
        "sequences": 10 + step,
        "mfu": 0.1 * step_s,  # any numbers: the test checks the step-time weighting
        "planned_imbalance": 1.0,
        "measured_imbalance": 1.5,
        "plan_ms": 0.5,
        "data_wait_s_max": 0.0,
        "peak_gib": None,
    }


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _history(step_times_s: list[float], loss_scale: float = 1.0) -> list[dict]:
    return [
        _record(step, step_s=s, predicted_s=0.9 * s, loss=loss_scale * (2.0 - 0.1 * step))
        for step, s in enumerate(step_times_s, start=1)
    ]


def test_read_metrics_orders_steps_and_keeps_the_last_of_a_repeated_step(tmp_path: Path) -> None:
    records = _history([1.0, 2.0, 3.0])
    repeated = dict(records[1], loss=7.0)  # a resumed run wrote step 2 again
    path = _write(tmp_path / "m.jsonl", [records[2], records[0], records[1], repeated])
    got = e2e.read_metrics(path)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert got[1]["loss"] == 7.0


def test_summary_skips_warmup_and_weights_by_step_time() -> None:
    history = _history([10.0, 10.0, 1.0, 3.0])  # two slow warm-up steps
    summary = e2e.summarise("p", history, WARMUP_STEPS)
    assert summary.measured_steps == 2
    assert summary.step_s == pytest.approx(2.0)
    assert summary.tokens_per_s == pytest.approx(2000 / 4.0)
    # per-step MFU 0.1 and 0.3, weighted by 1 s and 3 s
    assert summary.mfu == pytest.approx((0.1 * 1 + 0.3 * 3) / 4)
    assert summary.predicted_step_s == pytest.approx(1.8)
    assert summary.predicted_error == pytest.approx(-0.1)
    assert summary.predicted_abs_error_per_step == pytest.approx(0.1)


def test_summary_without_measured_steps_is_an_error() -> None:
    with pytest.raises(ValueError, match="warm-up"):
        e2e.summarise("p", _history([1.0, 1.0]), WARMUP_STEPS)


def test_ratios_against_best_knapformer_and_dp_cost() -> None:
    summaries = [
        e2e.summarise(name, _history([1.0, 1.0, s, s]), WARMUP_STEPS)
        for name, s in (
            ("zellige", 1.0),
            ("dp-cost", 2.0),
            ("knapformer:g2n4", 1.25),
            ("knapformer:g1n8", 1.6),
        )
    ]
    ratios = e2e.throughput_ratios(summaries)
    assert ratios["zellige"]["vs_dp_cost"] == pytest.approx(2.0)
    assert ratios["zellige"]["vs_best_knapformer"] == pytest.approx(1.25)
    assert ratios["knapformer:g1n8"]["vs_best_knapformer"] == pytest.approx(1.25 / 1.6)
    assert e2e.throughput_ratios(summaries[:1])["zellige"] == {
        "vs_best_knapformer": None,
        "vs_dp_cost": None,
    }


def test_loss_agreement_finds_the_worst_step() -> None:
    reference = _history([1.0] * 4)
    close = _history([1.0] * 4, loss_scale=1 + 1e-6)
    off = [dict(r) for r in reference]
    off[2]["loss"] *= 1.2  # step 3 trained something else
    rows = {
        row.planner: row
        for row in e2e.loss_agreement({"dp-cost": reference, "a": close, "b": off}, "dp-cost")
    }
    assert set(rows) == {"a", "b"}
    assert rows["a"].max_rel_diff == pytest.approx(1e-6)
    assert rows["a"].first_step_rel_diff == pytest.approx(1e-6)
    assert rows["b"].max_rel_diff == pytest.approx(0.2)
    assert rows["b"].worst_step == 3
    assert rows["b"].first_step_rel_diff == 0.0


def test_loss_lines_flag_a_disagreement() -> None:
    reference = _history([1.0] * 3)
    off = [dict(r, loss=r["loss"] * 1.01) for r in reference]
    _, agree = e2e.loss_lines({"dp-cost": reference, "x": reference}, "dp-cost", 1e-4, "float32")
    assert agree
    lines, agree = e2e.loss_lines({"dp-cost": reference, "x": off}, "dp-cost", 1e-4, "float32")
    assert not agree
    assert any("| x |" in line and "NO" in line for line in lines)


def test_same_batches_reports_different_steps_and_counts() -> None:
    reference = _history([1.0] * 3)
    assert e2e.same_batches({"a": reference, "b": [dict(r) for r in reference]}) == []
    other = [dict(r) for r in reference]
    other[1]["tokens"] += 1
    assert "step 2" in e2e.same_batches({"a": reference, "b": other})[0]
    assert "ran steps" in e2e.same_batches({"a": reference, "b": reference[:2]})[0]


def test_results_table_marks_tuned_planners_and_ratios() -> None:
    summaries = [
        e2e.summarise(name, _history([1.0, 1.0, s, s]), WARMUP_STEPS)
        for name, s in (("dp-cost", 2.0), ("knapformer:g2n4", 1.0))
    ]
    lines = e2e.results_table(summaries, {"dp-cost": "dp-cost", "knapformer:g2n4": "knapformer"})
    assert len(lines) == 4
    assert lines[3].startswith("| knapformer:g2n4 (best) |")
    assert "| 2.000x |" in lines[3]  # vs dp-cost


def test_is_complete_counts_steps(tmp_path: Path) -> None:
    path = _write(tmp_path / "m.jsonl", _history([1.0] * 3))
    assert e2e.is_complete(path, 3)
    assert not e2e.is_complete(path, 4)
    assert not e2e.is_complete(tmp_path / "missing.jsonl", 1)


@pytest.mark.parametrize(
    ("num_ranks", "want"),
    [
        (4, ["static-cp:2", "static-cp:4"]),
        (8, ["static-cp:2", "static-cp:4", "static-cp:8"]),
        (6, ["static-cp:2"]),
    ],
    ids=["4-ranks", "8-ranks", "6-ranks"],
)
def test_static_cp_candidates(num_ranks: int, want: list[str]) -> None:
    assert e2e.static_cp_candidates(num_ranks) == want


def test_knapformer_candidates_cover_the_ranks_exactly() -> None:
    specs = e2e.knapformer_candidates(8)
    assert specs[:4] == ["knapformer:g1n8", "knapformer:g2n4", "knapformer:g4n2", "knapformer:g8n1"]
    assert "knapformer:g1n2+g2n1+g4n1" in specs
    assert len(specs) == len(set(specs)) == 10  # partitions of 8 into powers of two
    for spec in specs:
        terms = [term[1:].split("n") for term in spec.split(":")[1].split("+")]
        assert sum(int(g) * int(n) for g, n in terms) == 8


def test_tuned_family_trains_the_smallest_predicted_makespan(monkeypatch) -> None:
    predicted_s = {"static-cp:2": 3.0, "static-cp:4": 2.0, "static-cp:8": 2.5}

    def fake(config, num_ranks, planner):
        if planner == "static-cp:8":
            raise ValueError("does not fit\nmore")
        return predicted_s[planner]

    monkeypatch.setattr(e2e, "first_step_makespan_s", fake)
    choices = e2e.resolve_planners(["dp-cost", "static-cp"], None, 8)
    assert choices[0].planner == "dp-cost" and choices[0].sweep == []
    assert choices[1].planner == "static-cp:4"
    assert choices[1].sweep[2] == ("static-cp:8", None, "does not fit")


def test_expected_run_time_learns_speed_and_startup_from_finished_runs() -> None:
    assert e2e.expected_run_s(2.0, 10, []) == pytest.approx(20.0 + e2e.DEFAULT_STARTUP_S)
    # runs took twice the predicted step time, with 30 s and 50 s around their steps
    finished = [(10.0, 20.0, 50.0), (5.0, 10.0, 60.0)]
    assert e2e.expected_run_s(2.0, 10, finished) == pytest.approx(40.0 + 50.0)


def test_results_table_hides_errors_of_a_profile_from_another_device() -> None:
    history = _history([1.0, 1.0, 2.0, 2.0])
    for record in history:
        record["prediction_comparable"] = False  # a CPU run under the H200 profile
    summary = e2e.summarise("dp-cost", history, WARMUP_STEPS)
    assert not summary.prediction_comparable
    (row,) = e2e.results_table([summary], {"dp-cost": "dp-cost"})[2:]
    assert row.count("- (a)") == 2 and "%" not in row.split("|")[6]
    comparable = e2e.summarise("dp-cost", _history([1.0, 1.0, 2.0, 2.0]), WARMUP_STEPS)
    assert comparable.prediction_comparable
    assert "- (a)" not in e2e.results_table([comparable], {"dp-cost": "dp-cost"})[2]
