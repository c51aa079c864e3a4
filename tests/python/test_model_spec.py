"""Model spec files: round trip, the same plans as the equivalent preset through the API and every
command that takes a model, one-line errors for bad files, a spec derived from an nn.Module, and
`zellige profile --block` on a user's own block."""

import json
import re
import sys

import pytest

import zellige
from zellige.model_spec import (
    load_model_spec,
    model_spec_from_dict,
    model_spec_to_dict,
    resolve_model,
    save_model_spec,
)

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from test_cli import WORKLOAD, assert_user_error, zellige_cli  # noqa: E402


@pytest.mark.parametrize("preset", zellige.model_preset_names())
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_preset_round_trips_through_a_spec_file(tmp_path, preset, suffix):
    spec = zellige.model_preset(preset)
    path = tmp_path / f"model{suffix}"
    save_model_spec(spec, path)
    assert load_model_spec(path) == spec
    assert resolve_model(path) == spec
    assert resolve_model(str(path)) == spec


@pytest.mark.parametrize("preset", zellige.model_preset_names())
def test_every_core_preset_round_trips_through_its_registry_entry(preset):
    """The model registry holds one entry per planning-core preset; its runnable model has the
    preset's sizes (the spec the planner reads from the module has them too), the blocks of its
    kind, and block weight matrices that are exactly the core's parameter count."""
    import torch

    from zellige.data import model_spec
    from zellige.model import MMDiT, VideoDiT, build_model
    from zellige.model.config import MODELS, model_entry, model_preset

    entry = model_entry(preset)
    assert [e.preset for e in MODELS].count(preset) == 1 and model_entry(entry.name) == entry
    spec, dit = zellige.model_preset(preset), model_preset(entry.name)
    assert dit == entry.dit_config() and dit.name == entry.name
    sizes = ("width", "num_heads", "head_dim", "num_layers", "ffn_width", "text_tokens")
    sizes += ("joint_attention", "num_double_layers")
    back = model_spec(dit, num_params=spec.param_count)
    assert {k: getattr(back, k) for k in sizes} == {k: getattr(spec, k) for k in sizes}
    with torch.device("meta"):
        model = build_model(dit)
    assert isinstance(model, MMDiT if entry.block_kind == "mmdit" else VideoDiT)
    linear = (m for m in model.blocks.modules() if isinstance(m, torch.nn.Linear))
    assert sum(m.weight.numel() for m in linear) == spec.param_count


def test_the_registry_names_every_model_once() -> None:
    from zellige.model.config import MODELS, model_entry, model_preset_names

    assert sorted(e.preset for e in MODELS) == sorted(zellige.model_preset_names())
    assert model_preset_names() == [e.name for e in MODELS]
    with pytest.raises(ValueError, match="unknown model preset 'wan-99b'; allowed: wan-1.3b"):
        model_entry("wan-99b")


def test_a_minimal_spec_file_derives_head_dim_and_parameters(tmp_path):
    path = tmp_path / "wan.toml"
    path.write_text(
        'name = "my-wan"\nwidth = 1536\nnum_heads = 12\nnum_layers = 30\n'
        "ffn_width = 8960\ntext_tokens = 512\n"
    )
    spec = load_model_spec(path)
    preset = zellige.model_preset("wan-1.3b")
    assert spec.name == "my-wan"
    assert (spec.head_dim, spec.param_count, spec.joint_attention) == (
        preset.head_dim,
        preset.param_count,
        False,
    )


def _wan_spec_file(tmp_path, name="wan-1.3b") -> str:
    spec = model_spec_to_dict(zellige.model_preset("wan-1.3b"))
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**spec, "name": name}))
    return str(path)


# A profile's measured memory rows are per model name, so a spec file named as the preset it
# copies gets exactly the preset's costs (another name gets the analytic memory model).


def test_a_spec_gives_the_same_plans_as_its_preset(tmp_path):
    spec = load_model_spec(_wan_spec_file(tmp_path))
    for planner in ("zellige", "dp-cost", "knapformer:g2n4", "static-cp:4"):
        by_preset = zellige.plan("wan-stage2", 8, model="wan-1.3b", planner=planner)
        by_spec = zellige.plan("wan-stage2", 8, model=spec, planner=planner)
        assert (
            zellige.plan_to_dict(by_spec)["placements"]
            == (zellige.plan_to_dict(by_preset)["placements"])
        ), planner
        assert by_spec.predicted.makespan_s == by_preset.predicted.makespan_s


def test_every_planning_command_takes_a_spec_file(tmp_path):
    spec_file = _wan_spec_file(tmp_path)
    for command in (["compare", "--json"], ["plan", "--planner", "zellige"]):
        by_preset = zellige_cli(*command, *WORKLOAD, "--model", "wan-1.3b")
        by_spec = zellige_cli(*command, *WORKLOAD, "--model-spec", spec_file)
        assert by_preset.returncode == by_spec.returncode == 0, by_spec.stderr
        if command[0] == "compare":
            drop = ("plan_ms",)
            rows = [
                {k: v for k, v in r.items() if k not in drop} for r in json.loads(by_spec.stdout)
            ]
            ref = [
                {k: v for k, v in r.items() if k not in drop} for r in json.loads(by_preset.stdout)
            ]
            assert rows == ref
        else:  # the same summary, but for the planning time

            def untimed(text: str) -> str:
                return re.sub(r"planned in [0-9.]+ ms", "", text)

            assert untimed(by_spec.stdout) == untimed(by_preset.stdout)
    # A plan made with a spec file records the spec, so `show` redraws it without the file.
    spec_file = _wan_spec_file(tmp_path, name="my-wan")
    plan_file = tmp_path / "plan.json"
    made = zellige_cli("plan", *WORKLOAD, "--model-spec", spec_file, "--planner", "zellige",
                       "--out", plan_file)  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert json.loads(plan_file.read_text())["context"]["model_spec"]["name"] == "my-wan"
    shown = zellige_cli("show", plan_file)
    assert shown.returncode == 0, shown.stderr


def test_check_takes_a_spec_file(tmp_path):
    spec = model_spec_to_dict(zellige.model_preset("tiny"))
    path = tmp_path / "tiny.toml"
    save_model_spec(zellige.ModelSpec(**{**spec, "name": "my-tiny"}), path)
    result = zellige_cli(
        "check", "--nproc", "2", "--workload", "opensora2-stage1", "--planner", "zellige",
        "--model-spec", path, "--max-tokens", "512",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "4 heads" in result.stdout and "PASS" in result.stdout


BAD_SPECS = [
    ("bad.toml", "width = [", "not valid TOML"),
    ("bad.json", '{"name": "x", ', "not valid JSON"),
    ("bad.json", "[1, 2]", "expected a table"),
    ("bad.yaml", "name: x", "must end in .toml or .json"),
    ("bad.toml", 'name = "x"\nwidth = 64\n', "missing field 'num_heads'"),
    (
        "bad.toml",
        'name = "x"\nwidth = 64\nnum_heads = 4\nnum_layers = 2\nffn_width = 8\n'
        "text_tokens = 8\nwidht = 3\n",
        "unknown field 'widht'",
    ),
    (
        "bad.toml",
        'name = "x"\nwidth = "64"\nnum_heads = 4\nnum_layers = 2\nffn_width = 8\ntext_tokens = 8\n',
        "'width' must be an integer",
    ),
    (
        "bad.json",
        '{"name": "x", "width": 64, "num_heads": 4, "num_layers": 2, "ffn_width": 8, '
        '"text_tokens": 8, "joint_attention": 1}',
        "'joint_attention' must be true or false",
    ),
    (
        "bad.toml",
        'name = "x"\nwidth = 64\nnum_heads = 5\nhead_dim = 12\nnum_layers = 2\nffn_width = 8\n'
        "text_tokens = 8\n",
        "head_dim * num_heads must equal width",
    ),
    (
        "bad.toml",
        'name = "x"\nwidth = 64\nnum_heads = 4\nnum_layers = 0\nffn_width = 8\ntext_tokens = 8\n',
        "num_layers must be > 0",
    ),
    (
        "bad.toml",
        'name = "x"\nwidth = 64\nnum_heads = 4\nnum_layers = 2\nffn_width = 8\ntext_tokens = 8\n'
        "num_double_layers = 1\n",
        "must be 0 for a cross-attention model",
    ),
    (  # bounded: far above any DiT, and every plan within seconds
        "bad.toml",
        'name = "x"\nwidth = 64\nnum_heads = 4\nnum_layers = 1048576\nffn_width = 8\n'
        "text_tokens = 8\n",
        "num_layers must be at most 256, got 1048576",
    ),
    (  # its parameter count would wrap int64
        "bad.json",
        '{"name": "x", "width": 64, "num_heads": 4, "num_layers": 1099511627776, '
        '"ffn_width": 8, "text_tokens": 8}',
        "num_layers must be at most 256, got 1099511627776",
    ),
    (  # 4 x (2^62 + 1) wraps to 4 = width
        "bad.toml",
        'name = "x"\nwidth = 4\nnum_heads = 4\nhead_dim = 4611686018427387905\nnum_layers = 2\n'
        "ffn_width = 8\ntext_tokens = 8\n",
        "head_dim must be at most 65536",
    ),
    (
        "bad.toml",
        'name = "x"\nwidth = 64\nnum_heads = 4\nnum_layers = 2\nffn_width = 8\ntext_tokens = 8\n'
        "param_count = 4900000000000000000\n",
        "param_count must be at most",
    ),
    (  # beyond the core's int64: a one-line error, not the binding's TypeError
        "bad.toml",
        'name = "x"\nwidth = 99999999999999999999\nnum_heads = 4\nnum_layers = 2\n'
        "ffn_width = 8\ntext_tokens = 8\n",
        "'width' must be in [",
    ),
]


@pytest.mark.parametrize(
    "name,text,needle", BAD_SPECS, ids=[needle.split("'")[0][:30] for _, _, needle in BAD_SPECS]
)
def test_bad_spec_files_get_one_line_errors(tmp_path, name, text, needle):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match="bad"):
        load_model_spec(path)
    assert_user_error(zellige_cli("plan", *WORKLOAD, "--planner", "zellige", "--model-spec", path),
                      needle, "bad.")  # fmt: skip


def test_cli_spec_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n')
    for command in (["validate-profile", "--quick"], ["profile", "--quick", "--out", "p.json"]):
        assert_user_error(
            zellige_cli(*command, "--model-spec", bad, cwd=tmp_path), "missing field 'width'"
        )
    assert_user_error(
        zellige_cli("compare", *WORKLOAD, "--model-spec", tmp_path / "missing.toml"),
        "cannot read model spec",
    )
    assert_user_error(
        zellige_cli("compare", *WORKLOAD, "--model", "tiny", "--model-spec", "x.toml"),
        "not allowed with",
    )
    with pytest.raises(ValueError, match="or a .toml/.json spec file"):
        resolve_model("wan-2b")


def test_spec_from_dict_needs_every_required_field():
    with pytest.raises(ValueError, match="missing field 'ffn_width'"):
        model_spec_from_dict({"name": "x", "width": 8, "num_heads": 2, "num_layers": 1})


def test_spec_from_a_users_module():
    torch = pytest.importorskip("torch")
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, width, heads):
            super().__init__()
            self.num_heads = heads
            self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)

    class Block(nn.Module):
        def __init__(self, width, heads, ffn):
            super().__init__()
            self.attention = Attention(width, heads)
            self.up, self.down = nn.Linear(width, ffn), nn.Linear(ffn, width)

    class MyDiT(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(16, 96)
            self.blocks = nn.ModuleList(Block(96, 6, 384) for _ in range(5))

    model = MyDiT()
    spec = zellige.model_spec_from_module(model, text_tokens=77, joint_attention=False)
    assert (spec.name, spec.width, spec.num_heads, spec.head_dim) == ("MyDiT", 96, 6, 16)
    assert (spec.num_layers, spec.ffn_width, spec.text_tokens) == (5, 384, 77)
    assert spec.param_count == sum(p.numel() for p in model.parameters())

    # joint: two block lists, the first double-stream
    model.single = nn.ModuleList(Block(96, 6, 384) for _ in range(3))
    joint = zellige.model_spec_from_module(model, text_tokens=77, joint_attention=True)
    assert (joint.num_layers, joint.num_double_layers) == (8, 5)

    class NoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 8)))

    with pytest.raises(ValueError, match="cannot derive num_heads from NoHeads: pass num_heads="):
        zellige.model_spec_from_module(NoHeads(), text_tokens=0, joint_attention=False)
    given = zellige.model_spec_from_module(
        NoHeads(), text_tokens=0, joint_attention=False, num_heads=2
    )
    assert (given.width, given.ffn_width, given.head_dim) == (8, 32, 4)
    del torch


BLOCK_MODULE = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width, heads, ffn):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.up = nn.Linear(width, ffn)
        self.down = nn.Linear(ffn, width)

    def forward(self, x, attention):
        q, k, v = self.qkv(x).unflatten(1, (3, self.heads, -1)).unbind(1)
        x = x + self.out(attention(q, k, v).flatten(1))
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


def make_block(spec):
    return Block(spec.width, spec.num_heads, spec.ffn_width)
"""


def test_profile_measures_a_users_block(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "my_block.py").write_text(BLOCK_MODULE)
    spec = tmp_path / "tiny.json"
    save_model_spec(zellige.model_preset("tiny"), spec)
    out = tmp_path / "profile.json"
    bad = zellige_cli("profile", "--quick", "--block", "my_block:nope", "--out", out, cwd=tmp_path)
    assert_user_error(bad, "my_block has no callable 'nope'")
    assert_user_error(
        zellige_cli("profile", "--quick", "--block", "my_block", "--out", out, cwd=tmp_path),
        "module:factory",
    )
    result = zellige_cli(
        "profile", "--quick", "--repeats", "1", "--model-spec", spec, "--block",
        "my_block:make_block", "--out", out, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "the user's block my_block:make_block" in result.stderr
    data = json.loads(out.read_text())
    assert "--block my_block:make_block" in data["created"]
    assert data["matmul_forward_flops_per_s"]["source"] == "measured"
    assert zellige.load_profile(out).matmul_flops_per_s > 0
