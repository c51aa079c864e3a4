"""Per-model per-token rate tables in a profile (model_matmul_*_flops_per_s): old profiles load,
the tables price only their own model, bad tables are refused, `zellige profile --base` adds a
model's rows on top of a profile."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from zellige.costs import make_cost_model
from zellige.profile import (
    MODEL_TABLES,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _shared_tables_only() -> dict:
    """The built-in profile with no model's own tables (every model priced with the shared
    ones, as profiles before the per-model tables): the reference the tests below change."""
    data = profile_to_dict(load_profile())
    for key in MODEL_TABLES:
        data[key] = []
    return data


def _with_own_tables(model: str, scale: float) -> dict:
    """The built-in profile with `model`'s own per-token tables (the shared ones times scale)
    and no other model's."""
    data = _shared_tables_only()
    models = data["memory_models"]
    if model not in models:
        from zellige.profiler.memory import merge_memory

        data = merge_memory(data, model, {})
        models = data["memory_models"]
    for key, shared in (
        ("model_matmul_forward_flops_per_s", "matmul_forward_flops_per_s"),
        ("model_matmul_backward_flops_per_s", "matmul_backward_flops_per_s"),
    ):
        empty = {"source": "analytic", "x": [], "y": []}
        tables = [dict(empty) for _ in models]
        own = data[shared]
        tables[models.index(model)] = {
            "source": "measured",
            "x": list(own["x"]),
            "y": [y * scale for y in own["y"]],
        }
        data[key] = tables
    return data


def test_a_profile_written_before_the_model_tables_loads_and_prices_as_before():
    old = json.loads((FIXTURES / "wan14b_h200_profile_202611.json").read_text())
    assert "model_matmul_forward_flops_per_s" not in old
    profile = load_profile(FIXTURES / "wan14b_h200_profile_202611.json")
    assert profile.model_matmul_forward_flops_per_s == []
    # without tables of its own, every model is priced with the shared tables: as with an
    # empty table of its own for every memory model
    explicit = profile_to_dict(profile)
    for key in MODEL_TABLES:
        explicit[key] = [
            {"source": "analytic", "x": [], "y": []} for _ in explicit["memory_models"]
        ]
    for model in ("mmdit-11b", "wan-14b"):
        before = make_cost_model(model, gpus=8, profile=profile_from_dict(explicit))
        after = make_cost_model(model, gpus=8, profile=profile)
        assert after.linear_time_s(5000) == before.linear_time_s(5000)


def test_the_shipped_profile_has_mmdit_11b_tables_and_shares_the_others():
    builtin = load_profile()
    models = list(builtin.memory_models)
    row = models.index("mmdit-11b")  # measured and validated (bench/results/mmdit_h200_202612.md)
    for tables in (
        builtin.model_matmul_forward_flops_per_s,
        builtin.model_matmul_backward_flops_per_s,
    ):
        assert len(tables) == len(models)
        assert not tables[row].empty()
        assert all(table.empty() for i, table in enumerate(tables) if i != row)
    # its own tables price it differently from the shared ones
    own = make_cost_model("mmdit-11b", gpus=8)
    shared = make_cost_model("mmdit-11b", gpus=8, profile=profile_from_dict(_shared_tables_only()))
    assert own.linear_time_s(8192) != shared.linear_time_s(8192)


@pytest.mark.parametrize("tokens", [300, 5000, 100_000])
def test_a_models_own_tables_price_that_model_only(tokens):
    own = profile_from_dict(_with_own_tables("mmdit-11b", 0.5))
    builtin = profile_from_dict(_shared_tables_only())
    mmdit_shared = make_cost_model("mmdit-11b", gpus=8, profile=builtin)
    mmdit_own = make_cost_model("mmdit-11b", gpus=8, profile=own)
    # half the GEMM rate: the GEMM part of the per-token time doubles, the elementwise part not
    shared_s, own_s = mmdit_shared.linear_time_s(tokens), mmdit_own.linear_time_s(tokens)
    assert 1.5 * shared_s < own_s < 2.0 * shared_s
    assert (
        mmdit_own.min_linear_time_per_token_s() > 1.5 * mmdit_shared.min_linear_time_per_token_s()
    )
    # the same profile prices other models with the shared tables, exactly as before
    for model in ("wan-14b", "wan-1.3b", "hunyuan-13b"):
        before = make_cost_model(model, gpus=8, profile=builtin)
        after = make_cost_model(model, gpus=8, profile=own)
        assert after.linear_time_s(tokens) == before.linear_time_s(tokens)
        assert after.min_linear_time_per_token_s() == before.min_linear_time_per_token_s()


def test_an_empty_own_table_means_the_shared_one():
    data = _with_own_tables("wan-14b", 0.5)
    data["model_matmul_forward_flops_per_s"][0] = {"source": "analytic", "x": [], "y": []}
    data["model_matmul_backward_flops_per_s"][0] = {"source": "analytic", "x": [], "y": []}
    before = make_cost_model("wan-14b", gpus=8)
    after = make_cost_model("wan-14b", gpus=8, profile=profile_from_dict(data))
    assert after.linear_time_s(4096) == before.linear_time_s(4096)


def test_plans_and_evaluate_use_the_models_tables():
    from zellige import _core

    batch = _core.Batch()
    batch.sequences = [_core.sequence_from_tokens(i, "video", 4000, 512, 0) for i in range(4)]
    plan = _core.Plan()
    plan.planner = "test"
    plan.num_ranks = 2
    plan.placements = [_core.make_placement(i, _core.Strategy.local, [i % 2]) for i in range(4)]
    slow = make_cost_model(
        "mmdit-11b", gpus=2, profile=profile_from_dict(_with_own_tables("mmdit-11b", 0.5))
    )
    fast = make_cost_model("mmdit-11b", gpus=2, profile=profile_from_dict(_shared_tables_only()))
    assert (
        slow.evaluate(batch, plan).ranks[0].linear_s
        > 1.5 * fast.evaluate(batch, plan).ranks[0].linear_s
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["model_matmul_forward_flops_per_s"].pop(), "one table per memory model"),
        (
            lambda d: d["model_matmul_backward_flops_per_s"][-1]["y"].__setitem__(0, 1e30),
            "model_matmul_backward_flops_per_s",
        ),
        (
            lambda d: d["model_matmul_forward_flops_per_s"][-1]["x"].reverse(),
            "model_matmul_forward_flops_per_s",
        ),
        (lambda d: d.__setitem__("model_matmul_forward_flops_per_s", {}), "must be a list"),
    ],
)
def test_bad_model_tables_are_refused_naming_the_field(change, message):
    data = _with_own_tables("mmdit-11b", 0.5)
    change(data)
    with pytest.raises(ValueError, match=message):
        profile_from_dict(data)


def test_model_tables_survive_a_save_and_load(tmp_path):
    profile = profile_from_dict(_with_own_tables("mmdit-11b", 0.5))
    save_profile(profile, tmp_path / "p.json")
    again = load_profile(tmp_path / "p.json")
    row = list(again.memory_models).index("mmdit-11b")
    assert list(again.model_matmul_forward_flops_per_s[row].y) == list(
        profile.model_matmul_forward_flops_per_s[row].y
    )
    assert again.model_matmul_forward_flops_per_s[0].empty()


def test_merge_adds_a_models_tables_and_keeps_the_others():
    from zellige.profiler.memory import merge_memory

    base = _shared_tables_only()
    table = {"source": "measured", "x": [256.0, 4096.0], "y": [1e14, 4e14]}
    tables = {
        "model_matmul_forward_flops_per_s": table,
        "model_matmul_backward_flops_per_s": table,
    }
    merged = merge_memory(base, "mmdit-11b", {"launch_s_per_layer": 0.01}, tables)
    row = merged["memory_models"].index("mmdit-11b")
    assert merged["model_matmul_forward_flops_per_s"][row] == table
    assert all(
        not t["x"] for i, t in enumerate(merged["model_matmul_forward_flops_per_s"]) if i != row
    )
    # memory rows only (--memory-only): the tables already there stay
    again = merge_memory(merged, "mmdit-11b", {"launch_s_per_layer": 0.02})
    assert again["model_matmul_backward_flops_per_s"][row] == table
    assert again["launch_s_per_layer"][row] == 0.02
    # a model added later gets an empty table (the shared one)
    third = merge_memory(again, "hunyuan-13b", {})
    assert third["model_matmul_forward_flops_per_s"][-1]["x"] == []
    profile_from_dict(third)
    # nobody with a table of its own: the fields stay empty, as in older profiles
    assert merge_memory(base, "hunyuan-13b", {})["model_matmul_forward_flops_per_s"] == []


def test_quick_profile_on_a_base_adds_the_models_own_rows(tmp_path, capsys):
    """`zellige profile --model mmdit-11b --base FILE --quick` (CPU): the model's per-token
    tables (measured on its double and single blocks) and launch row join FILE's rows; the
    attention and exchange rows are FILE's, unchanged."""
    pytest.importorskip("zellige.runtime.coalesced", reason="needs the engine's coalesced call")
    from zellige.cli import main

    base = tmp_path / "base.json"
    save_profile(load_profile(), base)
    out, details = tmp_path / "out.json", tmp_path / "details.json"
    args = ["profile", "--quick", "--model", "mmdit-11b", "--base", str(base), "--out", str(out)]
    assert main([*args, "--details", str(details)]) == 0
    err = capsys.readouterr().err
    assert "double-stream" in err and "single-stream" in err
    before, after = json.loads(base.read_text()), json.loads(out.read_text())
    for key in (
        "attention_forward_s_per_head",
        "attention_call_forward_s",
        "matmul_forward_flops_per_s",
    ):
        assert after[key] == before[key]
    row = after["memory_models"].index("mmdit-tiny")
    own = after["model_matmul_forward_flops_per_s"][row]
    assert own["source"] == "measured" and len(own["x"]) >= 3
    assert after["launch_s_per_layer"][row] + after["launch_s_per_attention_call"][row] > 0
    assert after["activation_bytes_per_token_layer"][row] == 0  # no allocator on a CPU
    assert "per-token layers and launch of mmdit-tiny" in after["created"]
    measured = json.loads(details.read_text())["per_token_layer_seconds"]
    assert {"double-stream", "single-stream"} <= set(next(iter(measured.values())))
    # the cost model of that model reads its own tables; the others keep the shared ones
    profile = load_profile(out)
    tiny = make_cost_model("mmdit-tiny", gpus=1, profile=profile)
    assert list(tiny.profile.matmul_forward_flops_per_s.y) == own["y"]
    wan = make_cost_model("wan-14b", gpus=1, profile=profile)
    assert (
        list(wan.profile.matmul_forward_flops_per_s.y) == before["matmul_forward_flops_per_s"]["y"]
    )


def test_stack_layers_keep_the_models_double_single_split():
    from zellige.profiler.models import block_kinds, stack_layers

    assert stack_layers("wan-14b") == 2
    assert stack_layers("mmdit-11b") == 3  # 19 + 38: 1 double + 2 single
    assert stack_layers("hunyuan-13b") == 3
    assert stack_layers("mmdit-tiny") == 3
    kinds = {
        name: (config.num_layers, config.num_double_layers, share)
        for name, config, share in block_kinds("mmdit-11b")
    }
    assert kinds == {
        "double-stream": (1, 1, pytest.approx(1 / 3)),
        "single-stream": (1, 0, pytest.approx(2 / 3)),
    }
    assert [name for name, _, _ in block_kinds("wan-14b")] == ["block"]


def test_mmdit_per_token_inputs_run_both_streams_of_a_double_block():
    """The per-token timing of an MMDiT block holds text rows (at most half the tokens), so the
    text stream's weights do work and get gradients, as in training."""
    import torch

    from zellige.model.mmdit import TEXT
    from zellige.profiler import rank_work
    from zellige.profiler.measure import per_token_inputs
    from zellige.profiler.models import block_kinds

    (_, double, _), _ = block_kinds("mmdit-tiny")
    device = torch.device("cpu")
    blocks = rank_work.make_blocks(double, 1, device, torch.float32)
    for tokens, text in ((6, 2), (64, 8)):  # under half the tokens, at most mmdit-tiny's 8
        inputs = per_token_inputs(double, tokens, device, torch.float32)
        assert inputs.num_text == text
        assert int((inputs.streams.order[:text] < text).sum()) == text  # text first
        out = rank_work.forward_blocks(blocks, inputs, checkpointing=False)
        out.backward(inputs.grad_TD)
        for stream in (blocks[0].text, blocks[0].visual):
            assert stream.attention_in.qkv.weight.grad.abs().sum() > 0
            assert stream.ffn.up.weight.grad.abs().sum() > 0
        blocks.zero_grad()
    assert TEXT == 1


def test_validate_names_each_ranks_strategies_and_reads_older_results():
    import dataclasses

    from zellige import _core
    from zellige.profiler.validate import RankResult, rank_strategies, summarise

    plan = _core.Plan()
    plan.num_ranks = 2
    plan.placements = [
        _core.make_placement(0, _core.Strategy.local, [0]),
        _core.make_placement(1, _core.Strategy.local, [0]),
        _core.make_placement(2, _core.Strategy.ring, [1, 0]),
    ]
    assert rank_strategies(plan, 0) == "local x2, ring x1"
    assert rank_strategies(plan, 1) == "ring x1"
    # a results line written before predicted_busy_s and strategies existed still loads
    old = {
        field.name: 1.0
        for field in dataclasses.fields(RankResult)
        if field.name not in ("predicted_busy_s", "strategies")
    }
    old.update(plan="p", rank=0, tokens=10, num_sequences=1, modelled_state_bytes=0.5)
    assert summarise([RankResult(**old)], gamma=0.0).time_mape_percent == 0.0


def test_validate_measures_the_models_rows_then_validates_them_in_one_run(tmp_path):
    """validate-profile --measure-rows FILE: the plans are drawn first, the model's own rows are
    measured on top of --profile and written to FILE, and the ranks are predicted with them."""
    from zellige import _core

    if not hasattr(_core, "make_plan"):
        pytest.skip("needs the planners (make_plan)")
    from zellige.cli import main

    rows, details, report = tmp_path / "rows.json", tmp_path / "d.json", tmp_path / "r.json"
    args = ["validate-profile", "--quick", "--model", "mmdit-11b", "--plans", "1"]
    args += ["--repeats", "1", "--measure-rows", str(rows), "--rows-details", str(details)]
    assert main([*args, "--json", str(report)]) == 0
    data = json.loads(rows.read_text())
    row = data["memory_models"].index("mmdit-tiny")
    assert data["model_matmul_backward_flops_per_s"][row]["source"] == "measured"
    assert "launch" in json.loads(details.read_text())
    notes = json.loads(report.read_text())["notes"]
    assert any("rows measured in this run" in note for note in notes)
    # --rows-details alone is refused before anything runs
    assert main(["validate-profile", "--quick", "--rows-details", str(details)]) == 2


def test_a_model_rows_run_hands_over_each_part_as_it_is_measured():
    """profile_memory_into's `save` gets the per-token tables before the (slower) rest, with the
    rows still to come as in the base: a run stopped later keeps them."""
    pytest.importorskip("zellige.runtime.coalesced", reason="needs the engine's coalesced call")
    from zellige.profiler.measure import ProfileOptions, profile_memory_into

    base = profile_to_dict(load_profile())
    saved = []
    options = ProfileOptions(model="mmdit-tiny", quick=True, device="cpu", repeats=1)
    result = profile_memory_into(base, options, lambda line: None, saved.append, per_token=True)
    assert len(saved) == 1  # the per-token tables (no memory part on a CPU)
    row = saved[0]["memory_models"].index("mmdit-tiny")
    assert saved[0]["model_matmul_forward_flops_per_s"][row]["x"]
    assert saved[0]["launch_s_per_layer"][row] == 0.0  # not measured yet
    assert "per-token layers (the rest as before)" in saved[0]["created"]
    final = result.profile
    assert (
        final["model_matmul_forward_flops_per_s"][row]
        == (saved[0]["model_matmul_forward_flops_per_s"][row])
    )
    assert final["launch_s_per_layer"][row] + final["launch_s_per_attention_call"][row] > 0
    profile_from_dict(saved[0])
    profile_from_dict(final)
