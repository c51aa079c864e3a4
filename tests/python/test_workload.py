"""Workload: recipes, generators and the Batch JSON format (round trip and every bad input)."""

import json

import pytest

import zellige
from zellige import _core


def test_every_recipe_generates_a_valid_deterministic_batch():
    assert set(zellige.recipe_names()) >= {"opensora2-stage2", "wan-stage3", "knapformer-joint"}
    for name in zellige.recipe_names():
        recipe = zellige.load_recipe(name)
        assert recipe.model in zellige.model_preset_names()
        batch = zellige.generate(name, 16, seed=5)
        zellige.validate_batch(batch, 16)
        assert {s.source_rank for s in batch.sequences} == set(range(16)), name
        assert zellige.generate(name, 16, seed=5) == batch
    a, b = zellige.generate("opensora2-stage2", 64, 1), zellige.generate("opensora2-stage2", 64, 2)
    assert a != b


def test_recipe_forms_parse():
    stage2 = zellige.load_recipe("opensora2-stage2")
    assert stage2.geometry.temporal_stride == 4
    assert stage2.text_tokens == 512 and stage2.text_tokens_min == -1
    first = stage2.buckets[0]
    assert (first.resolution, first.frames, first.batch) == ("256px", 1, 130)
    assert (first.tokens_per_latent_frame_min, first.tokens_per_latent_frame_max) == (250, 260)
    wan = zellige.load_recipe("wan-stage1")
    assert [(e.kind, e.num_tokens, e.frames) for e in wan.mix] == [
        ("image", 256, 1),
        ("video", 0, 81),
    ]
    knap = zellige.load_recipe("knapformer-joint")
    assert (knap.text_tokens_min, knap.text_tokens_max) == (0, 392)
    assert sum(g.ranks for g in knap.per_rank_groups) == 32


def test_wan_stage3_tokens_match_reference_geometry():
    batch = zellige.generate("wan-stage3", 32, seed=0)
    assert {s.num_tokens for s in batch.sequences} == {3600, 75600}
    videos = [s for s in batch.sequences if s.kind == "video"]
    assert all((s.grid_t, s.grid_h, s.grid_w) == (21, 45, 80) for s in videos)


def test_unknown_recipe_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"unknown workload 'nope' \(allowed: .*wan-stage3"):
        zellige.load_recipe("nope")


def test_batch_round_trip_is_exact(tmp_path):
    batch = zellige.generate("knapformer-joint", 32, seed=3)
    path = tmp_path / "batch.json"
    zellige.save_batch(batch, path)
    assert zellige.load_batch(path) == batch
    assert zellige.batch_from_dict(json.loads(json.dumps(zellige.batch_to_dict(batch)))) == batch


def test_design_md_example_with_model_defaults():
    text = json.dumps(
        {
            "sequences": [
                {
                    "id": 0,
                    "kind": "video",
                    "frames": 129,
                    "height": 768,
                    "width": 768,
                    "text_tokens": 512,
                    "source_rank": 3,
                },
                {"id": 1, "kind": "image", "num_tokens": 256},
                {"id": 2, "height": 256, "width": 256},
            ]
        }
    )
    batch = zellige.batch_from_json(text, model="hunyuan-13b")
    video, image, pixels = batch.sequences
    assert (video.num_tokens, video.grid_t, video.source_rank) == (33 * 48 * 48, 33, 3)
    assert video.text_tokens == 512
    assert (image.num_tokens, image.text_tokens, image.source_rank) == (256, 256, 0)
    assert (pixels.num_tokens, pixels.kind) == (256, "image")


BAD_BATCHES = {
    "not-an-object": ([1, 2], "batch: expected a JSON object"),
    "no-sequences-field": ({}, "missing field 'sequences'"),
    "empty": ({"sequences": []}, "no sequences"),
    "missing-id": ({"sequences": [{"num_tokens": 5}]}, "sequence #0: missing field 'id'"),
    "missing-length": ({"sequences": [{"id": 4}]}, "sequence 4: missing field 'num_tokens'"),
    "missing-height": (
        {"sequences": [{"id": 4, "frames": 5, "width": 256}]},
        "sequence 4: missing field 'height'",
    ),
    "float-tokens": (
        {"sequences": [{"id": 1, "num_tokens": 256.0}]},
        "sequence 1: field 'num_tokens' must be an integer, got 256.0",
    ),
    "bool-id": ({"sequences": [{"id": True, "num_tokens": 5}]}, "'id' must be an integer"),
    "string-rank": (
        {"sequences": [{"id": 1, "num_tokens": 5, "source_rank": "3"}]},
        "'source_rank' must be an integer",
    ),
    "zero-tokens": ({"sequences": [{"id": 2, "num_tokens": 0}]}, "sequence 2: num_tokens must be"),
    "negative-tokens": (
        {"sequences": [{"id": 2, "num_tokens": -5}]},
        "sequence 2: num_tokens must be",
    ),
    "zero-frames": (
        {"sequences": [{"id": 2, "frames": 0, "height": 256, "width": 256}]},
        "sequence 2: frames, height and width must be positive",
    ),
    "negative-text": (
        {"sequences": [{"id": 2, "num_tokens": 5, "text_tokens": -1}]},
        "sequence 2: text_tokens must be in [0, ",
    ),
    "duplicate-id": (
        {"sequences": [{"id": 7, "num_tokens": 5}, {"id": 7, "num_tokens": 6}]},
        "duplicate id 7",
    ),
    "both-forms": (
        {"sequences": [{"id": 1, "num_tokens": 5, "height": 256, "width": 256}]},
        "not both",
    ),
    "unknown-field": (
        {"sequences": [{"id": 1, "num_token": 5}]},
        "sequence 1: unknown field 'num_token'",
    ),
    "bad-kind": ({"sequences": [{"id": 1, "num_tokens": 5, "kind": "audio"}]}, "kind 'audio'"),
    "bad-grid": (
        {"sequences": [{"id": 1, "num_tokens": 6, "grid": [1, 2, 2]}]},
        "sequence 1: grid 1 x 2 x 2 does not multiply",
    ),
    "tiny-image": (
        {"sequences": [{"id": 1, "height": 8, "width": 256}]},
        "height and width must be multiples of 16",
    ),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES), ids=list(BAD_BATCHES))
def test_bad_batch_gives_one_line_error(case):
    data, message = BAD_BATCHES[case]
    with pytest.raises(ValueError) as info:
        zellige.batch_from_json(json.dumps(data), model="wan-14b", source="b.json")
    text = str(info.value)
    assert message in text
    assert text.startswith("b.json: ")
    assert "\n" not in text


def test_missing_text_tokens_without_model():
    with pytest.raises(ValueError, match="sequence 0: missing field 'text_tokens'"):
        zellige.batch_from_dict({"sequences": [{"id": 0, "num_tokens": 5}]})


def test_source_rank_checked_against_num_ranks():
    data = {"sequences": [{"id": 0, "num_tokens": 5, "text_tokens": 0, "source_rank": 8}]}
    zellige.batch_from_dict(data)
    with pytest.raises(ValueError, match="sequence 0: source_rank 8 is outside"):
        zellige.batch_from_dict(data, num_ranks=8)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"sequences": [{"id": 0, "num_tokens": 5}', "truncated JSON"),
        ('{"sequences": [{"id": 0 "num_tokens": 5}]}', "malformed JSON at line 1, column 25"),
        ("", "truncated JSON"),
    ],
    ids=["truncated", "malformed", "empty-file"],
)
def test_bad_json_names_file_and_position(tmp_path, text, message):
    path = tmp_path / "batch.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        zellige.load_batch(path, model="wan-14b")
    assert str(info.value).startswith(str(path))


def test_missing_file():
    with pytest.raises(ValueError, match="cannot read"):
        zellige.load_batch("/nonexistent/batch.json")


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="unknown model 'gpt'.*mmdit-11b"):
        zellige.batch_from_dict({"sequences": [{"id": 0, "num_tokens": 5}]}, model="gpt")


def test_value_types_have_keyword_constructors_and_reprs():
    seq = zellige.Sequence(id=3, num_tokens=256, grid_h=16, grid_w=16)
    assert "Sequence(id=3" in repr(seq)
    assert seq == _core.sequence_from_tokens(3, "video", 256, 0, 0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'tokens'"):
        zellige.Sequence(tokens=5)
    cluster = zellige.make_cluster(16, 8)
    assert cluster.num_ranks() == 16 and cluster.node_of(9) == 1
    with pytest.raises(ValueError, match="--gpus-per-node 16 exceeds --gpus 8"):
        zellige.make_cluster(8, 16)
