"""Plans fit the GPU they run on: the built-in profile by device, and the memory capacity from
the profile's device or an explicit override (a smaller running device)."""

from __future__ import annotations

import pytest

import zellige
from zellige.costs import make_cost_model
from zellige.profile import builtin_profile_for_device, load_profile

GIB = 2**30


@pytest.mark.parametrize(
    "device_name, expected",
    [
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("NVIDIA H100 PCIe", "h100"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H200 NVL", "h200"),
    ],
    ids=["h100-sxm", "h100-pcie", "h200", "h200-nvl"],
)
def test_builtin_profile_follows_the_device_name(device_name: str, expected: str) -> None:
    name, note = builtin_profile_for_device(device_name)
    assert (name, note) == (expected, None)
    assert expected.upper() in load_profile(name).device_name


def test_an_unknown_device_gets_the_h200_profile_and_a_note_naming_it() -> None:
    name, note = builtin_profile_for_device("NVIDIA A100-SXM4-80GB")
    assert name == "h200"
    assert "A100" in note and "zellige profile" in note


def test_capacity_comes_from_the_profile_device() -> None:
    h100 = make_cost_model("mmdit-11b", 8, profile="h100")
    h200 = make_cost_model("mmdit-11b", 8)  # the built-in H200 profile
    assert h100.memory_capacity_bytes() < 80 * GIB < h200.memory_capacity_bytes()
    assert load_profile("h100").device_memory_bytes == 81559 * 2**20


def test_a_smaller_running_device_gets_plans_for_its_capacity() -> None:
    """The H200 profile's 140 GiB against a 60 GiB device: every plan fits 60 GiB."""
    small = make_cost_model("mmdit-11b", 32, profile="h200", gpu_memory_bytes=60 * GIB)
    batch = zellige.generate(zellige.load_recipe("opensora2-stage2"), 32, 0)
    large_plan = zellige.make_plan("zellige", batch, make_cost_model("mmdit-11b", 32))
    assert max(large_plan.predicted.rank_peak_bytes) > 60 * GIB  # the H200 plan would not fit
    plan = zellige.make_plan("zellige", batch, small)
    assert max(plan.predicted.rank_peak_bytes) <= small.memory_capacity_bytes()


@pytest.mark.parametrize(
    "memory", [0, 2**60, True, 1.5 * GIB], ids=["zero", "huge", "bool", "float"]
)
def test_bad_gpu_memory_is_refused(memory) -> None:
    with pytest.raises(ValueError, match="GPU memory|gpu_memory_bytes"):
        make_cost_model("mmdit-11b", 8, gpu_memory_bytes=memory)


def test_cli_plans_for_the_gpu_memory_given(tmp_path) -> None:
    rows = zellige.compare("opensora2-stage2", 32, planners=["zellige"], gpu_memory_gib=60)
    assert rows[0].fits and rows[0].peak_bytes <= 60 * GIB
    with pytest.raises(ValueError, match="GiB"):
        zellige.compare("opensora2-stage2", 32, planners=["zellige"], gpu_memory_gib=float("nan"))


def test_training_on_a_smaller_gpu_plans_for_its_memory() -> None:
    """A run on an H100 with the H200 profile given: its plans fit the H100's usable memory."""
    from zellige.costs import planning_device

    usable = 78 * GIB
    profile, memory, notes = planning_device("h200", "NVIDIA H100 80GB HBM3", usable)
    assert (profile, memory) == ("h200", usable)
    assert any("78.0 GiB" in note and "140.0 GiB" in note for note in notes)
    cost_model = make_cost_model("mmdit-11b", 32, profile=profile, gpu_memory_bytes=memory)
    batch = zellige.generate(zellige.load_recipe("opensora2-stage2"), 32, 0)
    plan = zellige.make_plan("zellige", batch, cost_model)
    assert max(plan.predicted.rank_peak_bytes) <= cost_model.memory_capacity_bytes() < usable


def test_training_picks_the_builtin_profile_of_its_gpu() -> None:
    from zellige.costs import planning_device

    whole = 81559 * 2**20  # all of the H100's memory, as its profile records it
    profile, memory, notes = planning_device(None, "NVIDIA H100 80GB HBM3", whole)
    assert (profile, memory) == ("h100", whole)
    assert notes == ["cost model: the built-in h100 profile, for this NVIDIA H100 80GB HBM3"]
    assert planning_device(None, None, None) == (None, None, [])  # CPU: the profile's device


def test_a_first_step_that_fits_no_gpu_stops_before_training(tmp_path) -> None:
    """A profile whose GPU has 1 GiB and a 2^24-token sequence: one line before the first step."""
    import json
    import subprocess
    import sys

    profile = zellige.profile.profile_to_dict(load_profile("h200"))
    profile["device_memory_bytes"] = GIB
    (tmp_path / "small.json").write_text(json.dumps(profile))
    overrides = {"steps": 2, "profile": str(tmp_path / "small.json")}
    script = f"""
import os
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29617")
from zellige.train.config import resolve_config
from zellige.train.loop import train
config = resolve_config("tiny-cpu", {{}}, {overrides!r}, "")
try:
    train(config, sequences=[{{"id": 0, "num_tokens": 2**24, "text_tokens": 8, "source_rank": 0}}])
except ValueError as error:
    print("refused:", error)
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("refused:")]
    assert len(lines) == 1, result.stdout + result.stderr
    assert "does not fit in 0.9 GiB per GPU" in lines[0] and "more ranks" in lines[0]


# Every GPU config the README lists, with the recipes its runs use: planned as training plans
# on an H100 80GB (its built-in profile, the memory a process there can use).
_H100_RUNS = [
    ("wan1p3b-h200", None),
    ("wan14b-h200x8", None),
    ("wan14b-width-h200", None),
    ("wan14b-width-h200", "wan-stage3"),
    ("wan1p3b-opensora2-stage2-h200x8", None),
    ("wan1p3b-wan-stage3-h200x8", None),
    ("wan14b-width-opensora2-stage2-h200x8", None),
    ("wan14b-width-wan-stage3-h200x8", None),
    ("mmdit11b-width-h200", None),
    ("mmdit11b-width-h200", "opensora2-stage1"),
    ("hunyuan13b-width-h200", None),
    ("hunyuan13b-width-h200", "opensora2-stage1"),
]


@pytest.mark.parametrize("name, recipe", _H100_RUNS)
def test_every_gpu_config_plans_within_an_h100(name: str, recipe: str | None) -> None:
    """The H200-sized configs on an H100: each of their first steps plans within the H100's
    usable memory (more checkpointing or fewer tokens per rank where needed), never above it."""
    from zellige.data import StepDataset
    from zellige.train.config import get_config
    from zellige.train.optimizer_builder import cost_options

    config = get_config(name)
    num_ranks = 8 if name.endswith("x8") else 1
    usable = 78 * GIB  # an H100 80GB less the CUDA context and what other libraries hold
    dataset = StepDataset(
        model=config.model.dit,
        recipe=recipe or config.data.recipe,
        planner=config.parallelism.planner,
        rank=0,
        num_ranks=num_ranks,
        gpus_per_node=8,
        seed=1,
        profile="h100",
        gpu_memory_bytes=usable,
        cost_options=cost_options(config, num_ranks),
        attention_ragged=True,
    )
    capacity = dataset.pipeline().cost_model.memory_capacity_bytes()
    assert capacity <= usable
    for step in range(3):
        plan = dataset.plan(step)
        # a step that fits only in parts runs as micro-batches of its samples, each within it
        plans = (
            [m.plan for m in plan.micro_batches] if isinstance(plan, zellige.GlobalPlan) else [plan]
        )
        for part in plans:
            assert max(part.predicted.rank_peak_bytes) <= capacity, (name, recipe, step)


def test_a_step_that_fits_only_in_parts_runs_as_micro_batches(tmp_path) -> None:
    """Four 4k-token sequences on one rank of a GPU with 1.015 GiB: the step does not fit at once
    but micro-batches of its samples do. The run says so, trains them with gradient
    accumulation, and its loss is the one of the same step on a GPU that holds it whole."""
    import json
    import subprocess
    import sys

    profile = zellige.profile.profile_to_dict(load_profile("h200"))
    profile["device_memory_bytes"] = int(1.015 * GIB)
    (tmp_path / "small.json").write_text(json.dumps(profile))
    script = """
import json, os, sys
os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
from zellige.train.config import resolve_config
from zellige.train.loop import train
overrides = {"steps": 1, "dtype": "float64", "loader_workers": 0}
if sys.argv[1] != "whole":
    overrides["profile"] = sys.argv[1]
config = resolve_config("tiny-cpu", {}, overrides, "")
sequences = [
    {"id": i, "num_tokens": 2**12, "text_tokens": 8, "source_rank": 0} for i in range(4)
]
records = train(config, sequences=sequences)
print("records:", json.dumps([{k: r[k] for k in ("loss", "micro_batches")} for r in records]))
"""

    def run(profile_arg: str, port: str) -> tuple[list[dict], str]:
        result = subprocess.run(
            [sys.executable, "-c", script, profile_arg, port],
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("records:")]
        assert len(lines) == 1, result.stdout + result.stderr
        return json.loads(lines[0].removeprefix("records:")), result.stdout + result.stderr

    parts, log = run(str(tmp_path / "small.json"), "29618")
    whole, _ = run("whole", "29619")
    count = parts[0]["micro_batches"]
    assert count >= 2 and whole[0]["micro_batches"] == 1
    assert f"runs as {count} micro-batches of its samples" in log
    assert parts[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-12)
