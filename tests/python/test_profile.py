"""Hardware profile JSON: built-in profile, round trip, bad input; make_cost_model."""

import json
import math

import pytest

import zellige
from zellige.profile import (
    MODEL_ROWS,
    MODEL_TABLES,
    load_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)


def test_builtin_profile_is_a_measured_h200():
    profile = load_profile()
    assert "H200" in profile.device_name and "measured" in profile.created
    assert profile.attention_head_dim == 128
    tables = (
        profile.attention_forward_s_per_head,
        profile.attention_backward_s_per_head,
        profile.matmul_forward_flops_per_s,
        profile.matmul_backward_flops_per_s,
    )
    assert all(table.source == "measured" for table in tables)
    forward = profile.attention_forward_s_per_head
    # Dense cuDNN attention on one H200: 550-700 TFLOP/s from 4k tokens on (DESIGN.md).
    assert 4 * 4096**2 * 128 / forward(4096) == pytest.approx(625e12, rel=0.15)
    # Between samples the table is a power law: time grows about as L^2 at long lengths.
    assert forward(32768) / forward(16384) == pytest.approx(4, rel=0.1)
    assert 300e12 < profile.matmul_forward_flops_per_s(32768) < profile.matmul_flops_per_s
    assert 0 < profile.runtime_reserved_bytes < 3 << 30
    # measured without the cuDNN frontend: dense calls (a run sets what its engine does)
    assert profile.attention_ragged is False


def test_round_trip_is_exact(tmp_path):
    profile = load_profile()
    profile.exchange_group_sizes = [2, 8]
    profile.exchange_intra_node_s = [
        zellige.Table(x=[1e3, 1e8], y=[2e-5, 1e-3], source="measured"),
        zellige.Table(x=[1e3, 1e8], y=[3e-5, 2e-3], source="measured"),
    ]
    for row in (*MODEL_ROWS, *MODEL_TABLES):  # one memory model: every row of the built-in goes
        setattr(profile, row, [])
    profile.memory_models = ["wan-14b"]
    profile.activation_bytes_per_token_layer = [250000.0]
    profile.checkpoint_bytes_per_token_layer = [10240.0]
    profile.attention_call_lengths = [256.0, 8192.0]
    profile.attention_call_forward_s = [
        zellige.Table(x=[1, 40, 2560], y=[3e-5, 4e-5, 4e-4], source="measured"),
        zellige.Table(x=[1, 10, 80], y=[3e-4, 8e-4, 4e-3], source="measured"),
    ]
    profile.attention_call_backward_s = [
        zellige.Table(x=[1, 40, 2560], y=[6e-5, 8e-5, 9e-4], source="measured"),
        zellige.Table(x=[1, 10, 80], y=[8e-4, 2e-3, 1.3e-2], source="measured"),
    ]
    profile.launch_s_per_layer = [4e-3]
    profile.launch_s_per_attention_call = [2e-4]
    profile.attention_ragged = True
    path = tmp_path / "p.json"
    save_profile(profile, path)
    again = load_profile(path)
    assert again == profile and again.attention_ragged is True
    assert profile_to_dict(again) == profile_to_dict(profile)
    assert profile_to_dict(profile_from_dict(json.loads(path.read_text()))) == json.loads(
        path.read_text()
    )


def _builtin_dict():
    return profile_to_dict(load_profile())


BAD_PROFILES = {
    "not-an-object": [],
    "unknown-key": {**_builtin_dict(), "colour": "blue"},
    "missing-rate": {k: v for k, v in _builtin_dict().items() if k != "matmul_flops_per_s"},
    "zero-rate": {**_builtin_dict(), "memory_bytes_per_s": 0},
    "string-rate": {**_builtin_dict(), "attention_flops_per_s": "fast"},
    "bool-head-dim": {**_builtin_dict(), "attention_head_dim": True},
    "unsorted-table": {
        **_builtin_dict(),
        "matmul_forward_flops_per_s": {"source": "measured", "x": [2, 1], "y": [1, 1]},
    },
    "ragged-table": {
        **_builtin_dict(),
        "attention_forward_s_per_head": {"source": "measured", "x": [1, 2], "y": [1]},
    },
    "bad-source": {
        **_builtin_dict(),
        "attention_forward_s_per_head": {"source": "guess", "x": [1, 2], "y": [1, 2]},
    },
    "table-not-object": {**_builtin_dict(), "matmul_backward_flops_per_s": [1, 2]},
    "exchange-length-mismatch": {**_builtin_dict(), "exchange_group_sizes": [4]},
    "overlap-one": {**_builtin_dict(), "exchange_overlap": 1.0},
    "call-tables-without-lengths": {
        **_builtin_dict(),
        "attention_call_lengths": [],
        "attention_call_forward_s": [{"source": "measured", "x": [1, 2], "y": [1, 2]}],
    },
    "call-lengths-decreasing": {
        **_builtin_dict(),
        "attention_call_lengths": [512, 256],
        "attention_call_forward_s": [{"source": "measured", "x": [1], "y": [1]}] * 2,
        "attention_call_backward_s": [{"source": "measured", "x": [1], "y": [1]}] * 2,
    },
    "ragged-not-a-bool": {**_builtin_dict(), "attention_ragged": 1},
    "ragged-a-string": {**_builtin_dict(), "attention_ragged": "true"},
    "negative-launch": {**_builtin_dict(), "launch_s_per_layer": [-1e-3]},
    "launch-not-a-row": {**_builtin_dict(), "launch_s_per_layer": 1e-3},
    "launch-row-too-long": {
        **_builtin_dict(),
        "launch_s_per_layer": [1e-3] * (len(_builtin_dict()["memory_models"]) + 1),
    },
}


@pytest.mark.parametrize("data", BAD_PROFILES.values(), ids=BAD_PROFILES.keys())
def test_bad_profile_raises_one_line_value_error(data):
    with pytest.raises(ValueError) as error:
        profile_from_dict(data)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "text", ['{"device_name": "x", ', "not json", ""], ids=["truncated", "garbage", "empty"]
)
def test_malformed_file_raises_value_error(tmp_path, text):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=r"profile .*bad\.json: (malformed|truncated) JSON"):
        load_profile(path)


def test_missing_file_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_profile(tmp_path / "nope.json")


def test_make_cost_model_from_names():
    cost_model = zellige.make_cost_model("wan-14b", gpus=16)
    assert cost_model.cluster.num_ranks() == 16 and cost_model.cluster.gpus_per_node == 8
    assert cost_model.model.name == "wan-14b"
    assert cost_model.options.activation_checkpointing
    no_checkpointing = zellige.CostOptions()
    no_checkpointing.activation_checkpointing = False
    small = zellige.make_cost_model("tiny", gpus=4, options=no_checkpointing)
    assert small.cluster.gpus_per_node == 4 and not small.options.activation_checkpointing
    analytic = zellige.analytic_profile("a", 1e15, 1e15, 1e13)
    assert zellige.make_cost_model(profile=analytic).profile == analytic
    with pytest.raises(ValueError, match="unknown model"):
        zellige.make_cost_model("gpt-5")
    with pytest.raises(ValueError):
        zellige.make_cost_model(gpus=12, gpus_per_node=8)


def test_cost_model_sanity_wan14b():
    cost_model = zellige.make_cost_model("wan-14b", gpus=8)
    sequence = zellige._core.sequence_from_tokens(0, "video", 75600, 512, 0)
    local = cost_model.shares(
        sequence, zellige._core.make_placement(0, zellige._core.Strategy.local, [0])
    )
    split = cost_model.shares(
        sequence, zellige._core.make_placement(0, zellige._core.Strategy.ulysses, list(range(8)))
    )

    def time_s(share):
        return cost_model.rank_time_s(share.tokens, share.attention_s, share.exchange_s)

    local_s = time_s(local[0])
    split_s = max(time_s(share) for share in split)
    # One 5 s 720p clip: tens of seconds alone, ~8x less on 8 GPUs minus the all-to-alls.
    assert 20 < local_s < 100
    assert local_s / 8 < split_s < local_s / 6
    assert math.isclose(sum(share.tokens for share in split), 75600)


def test_table_lookup_rejects_bad_points():
    table = zellige.Table(x=[1.0, 10.0], y=[1.0, 100.0], source="measured")
    assert table(3.0) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        table(0.0)
    with pytest.raises(ValueError):
        zellige.Table()(1.0)
