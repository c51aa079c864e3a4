"""The `zellige` CLI end to end (as a user runs it: `python -m zellige.cli` in a subprocess) and the
Python API it mirrors: happy paths of plan / compare / show, the --json schema, and every bad input
of issue 2 giving one line on stderr and exit status 2, never a traceback."""

import json
import re
import subprocess
import sys

import pytest

import zellige
from zellige import _core
from zellige.costs import make_cost_model

JSON_FIELDS = {
    "planner",
    "makespan_s",
    "lower_bound_s",
    "imbalance",
    "exchange_bytes",
    "peak_bytes",
    "fits",
    "plan_ms",
}
# `show`: rank, time, then the bar.
RANK_LINE = re.compile(r"^\s*(\d+)\s+\d+\.\d+ s \|")
# Small enough to keep every call well under a second.
WORKLOAD = ["--workload", "opensora2-stage2", "--gpus", "8"]


def zellige_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zellige.cli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def assert_user_error(result: subprocess.CompletedProcess, *needles: str) -> str:
    """One line `zellige[ command]: error: ...` on stderr, exit 2, mentioning each of `needles`."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    message = lines[0]
    assert re.match(r"zellige( \w+)?: error: ", message), message
    for needle in needles:
        assert needle.lower() in message.lower(), message
    return message


def write_batch(path, sequences) -> str:
    path.write_text(json.dumps({"sequences": sequences}))
    return str(path)


def images(count: int, num_tokens: int = 256) -> list[dict]:
    return [
        {"id": i, "num_tokens": num_tokens, "text_tokens": 64, "source_rank": i % 4}
        for i in range(count)
    ]


# ---- happy paths ----


def test_plan_writes_a_plan_that_show_draws(tmp_path):
    out = tmp_path / "plan.json"
    result = zellige_cli("plan", *WORKLOAD, "--planner", "dp-cost", "--seed", 3, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "makespan" in result.stdout and "lower bound" in result.stdout

    plan = zellige.load_plan(out)
    batch = zellige.generate("opensora2-stage2", 8, seed=3)
    zellige.validate_plan(plan, batch, 8, zellige.model_preset("mmdit-11b").num_heads)
    assert plan.planner == "dp-cost" and plan.num_ranks == 8

    png = tmp_path / "plan.png"
    shown = zellige_cli("show", out, "--png", png)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert [RANK_LINE.match(line).group(1) for line in lines[1:-1]] == [str(r) for r in range(8)]
    assert lines[-1] == f"wrote {png}" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The same picture when the batch is named explicitly instead of read from the plan.
    explicit = zellige_cli("show", out, "--workload", "opensora2-stage2", "--seed", 3)
    assert explicit.returncode == 0 and explicit.stdout.splitlines() == lines[:-1]


def test_plan_from_a_batch_file_carries_the_batch(tmp_path):
    batch_file = write_batch(tmp_path / "batch.json", images(12, 1024))
    out = tmp_path / "plan.json"
    flags = "--gpus 4 --gpus-per-node 4 --model wan-1.3b --planner dp-tokens".split()
    result = zellige_cli("plan", "--batch", batch_file, *flags, "--out", out)
    assert result.returncode == 0, result.stderr
    context = json.loads(out.read_text())["context"]
    assert context["model"] == "wan-1.3b" and len(context["batch"]["sequences"]) == 12
    shown = zellige_cli("show", out)
    assert shown.returncode == 0, shown.stderr
    assert len(shown.stdout.splitlines()) == 1 + 4


def test_compare_json_schema():
    result = zellige_cli(
        "compare", *WORKLOAD, "--planners", "dp-tokens,dp-cost,static-cp:4", "--json"
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert [row["planner"] for row in rows] == ["dp-tokens", "dp-cost", "static-cp:4"]
    for row in rows:
        assert set(row) == JSON_FIELDS
        assert isinstance(row["fits"], bool)
        for field in JSON_FIELDS - {"planner", "fits"}:
            assert isinstance(row[field], float | int) and row[field] >= 0, field
        assert row["makespan_s"] >= row["lower_bound_s"] > 0
        assert row["imbalance"] >= 1.0


def test_compare_runs_the_joint_reference_when_asked(tmp_path):
    sequences = [*images(3, 1024), {"id": 3, "num_tokens": 60_000, "text_tokens": 0}]
    path = write_batch(tmp_path / "batch.json", sequences)
    flags = "--gpus 4 --gpus-per-node 4 --model wan-1.3b --planners zellige,joint --json".split()
    result = zellige_cli("compare", "--batch", path, *flags)
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)  # nothing else on stdout (HiGHS prints a banner otherwise)
    assert [row["planner"] for row in rows] == ["zellige", "joint"]
    assert all(row["makespan_s"] >= row["lower_bound_s"] for row in rows)


def test_compare_table_has_a_row_per_default_planner():
    result = zellige_cli("compare", *WORKLOAD)
    assert result.returncode == 0, result.stderr
    planners = zellige.default_planners(8)
    lines = result.stdout.splitlines()
    assert lines[2:] and len(lines) == 2 + len(planners)  # summary, header, rows
    assert [line.split()[0] for line in lines[2:]] == planners


def test_api_mirrors_the_cli():
    plan = zellige.plan("opensora2-stage2", 8, planner="dp-tokens", seed=1)
    assert isinstance(plan, _core.Plan) and plan.num_ranks == 8
    rows = zellige.compare("opensora2-stage2", 8, planners=["dp-tokens", "dp-cost"], seed=1)
    assert [row.planner for row in rows] == ["dp-tokens", "dp-cost"]
    assert rows[0].makespan_s == pytest.approx(plan.predicted.makespan_s)
    batch = zellige.generate("opensora2-stage2", 8, seed=1)
    same = zellige.plan(batch, 8, model="mmdit-11b", planner="dp-tokens", seed=1)
    assert [p.ranks for p in same.placements] == [p.ranks for p in plan.placements]


@pytest.mark.parametrize(
    ("num_gpus", "expected"),
    [
        (32, "g1n8+g2n4+g4n2+g8n1"),
        (8, "g1n2+g2n1+g4n1"),
        (16, "g2n2+g4n1+g8n1"),
        (128, "g1n32+g2n16+g4n8+g8n4"),
    ],
    ids=lambda v: str(v),
)
def test_default_mixed_knapformer_spec_covers_the_cluster(num_gpus, expected):
    assert f"knapformer:{expected}" in zellige.default_planners(num_gpus)


# ---- bad input: one line, exit 2 ----


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["compare", "--workload", "nope", "--gpus", 8], ["unknown workload", "opensora2-stage2"]),
        (["plan", *WORKLOAD, "--planner", "nope"], ["unknown planner", "dp-tokens"]),
        (["compare", *WORKLOAD, "--planners", "dp-cost,nope"], ["unknown planner"]),
        (["plan", *WORKLOAD, "--model", "nope", "--planner", "dp-cost"], ["nope", "wan-14b"]),
        (
            ["compare", "--workload", "opensora2-stage2", "--gpus", 4, "--gpus-per-node", 8],
            ["gpus-per-node"],
        ),
        (["compare", "--workload", "opensora2-stage2", "--gpus", 0], ["gpus"]),
        (["compare", *WORKLOAD, "--links", "carrier-pigeon"], ["link"]),
        (["compare", *WORKLOAD, "--profile", "/nonexistent/profile.json"], ["profile"]),
        (
            ["compare", "--batch", "/nonexistent/batch.json", "--gpus", 8, "--model", "mmdit-11b"],
            ["/nonexistent/batch.json"],
        ),
        (["show", "/nonexistent/plan.json"], ["/nonexistent/plan.json"]),
        (["compare", "--workload", "opensora2-stage2", "--gpus", "eight"], ["--gpus", "eight"]),
        (["plan", *WORKLOAD], ["--planner"]),
    ],
    ids=[
        "workload",
        "planner",
        "planner-in-list",
        "model",
        "gpus-per-node",
        "zero-gpus",
        "links",
        "profile-file",
        "batch-file",
        "plan-file",
        "non-integer-flag",
        "missing-flag",
    ],
)
def test_bad_names_and_files(args, needles):
    assert_user_error(zellige_cli(*args), *needles)


BAD_BATCHES = {
    "malformed": ('{"sequences": [{"id": 0, "num_tokens": 256,, "text_tokens": 0}]}', ["json"]),
    "truncated": ('{"sequences": [{"id": 0, "num_tokens": 256, "text_tok', ["truncated"]),
    "missing-field": ('{"sequences": [{"id": 0, "text_tokens": 0}]}', ["num_tokens"]),
    "non-integer": ('{"sequences": [{"id": 0, "num_tokens": 25.6}]}', ["num_tokens"]),
    "string-length": ('{"sequences": [{"id": 0, "num_tokens": "256"}]}', ["num_tokens"]),
    "zero-length": ('{"sequences": [{"id": 0, "num_tokens": 0}]}', ["sequence 0", "num_tokens"]),
    "negative-length": ('{"sequences": [{"id": 3, "num_tokens": -5}]}', ["sequence 3"]),
    "negative-frames": (
        '{"sequences": [{"id": 1, "frames": -9, "height": 256, "width": 256}]}',
        ["sequence 1"],
    ),
    "duplicate-id": (
        '{"sequences": [{"id": 7, "num_tokens": 256}, {"id": 7, "num_tokens": 512}]}',
        ["duplicate", "7"],
    ),
    "empty": ('{"sequences": []}', ["no sequences"]),
    "not-an-object": ("[1, 2, 3]", ["object"]),
    "source-rank": (
        '{"sequences": [{"id": 0, "num_tokens": 256, "source_rank": 99}]}',
        ["sequence 0", "source_rank"],
    ),
}


@pytest.mark.parametrize("name", list(BAD_BATCHES))
@pytest.mark.parametrize("command", ["plan", "compare"])
def test_bad_batch_files(tmp_path, name, command):
    text, needles = BAD_BATCHES[name]
    path = tmp_path / "batch.json"
    path.write_text(text)
    extra = ["--planner", "dp-tokens"] if command == "plan" else []
    result = zellige_cli(command, "--batch", path, "--gpus", 8, "--model", "mmdit-11b", *extra)
    assert_user_error(result, str(path), *needles)


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ('{"planner": "dp-cost", "num_ranks": 8, "placements": [', ["truncated"]),
        ('{"planner": "dp-cost", "placements": []}', ["num_ranks"]),
        ('{"planner": "dp-cost", "num_ranks": "8", "placements": []}', ["num_ranks"]),
        ('{"planner": "dp-cost", "num_ranks": 8, "placements": []}', ["--model"]),
        (
            '{"planner": "dp-cost", "num_ranks": 8, "placements": [], "context": '
            '{"model": "mmdit-11b", "workload": "opensora2-stage2", "gpus_per_node": "8"}}',
            ["gpus_per_node", "integer"],
        ),
    ],
    ids=["truncated", "missing-field", "non-integer", "no-model", "context-type"],
)
def test_bad_plan_files(tmp_path, text, needles):
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert_user_error(zellige_cli("show", path), str(path), *needles)


def test_show_rejects_a_plan_for_another_batch(tmp_path):
    out = tmp_path / "plan.json"
    assert zellige_cli("plan", *WORKLOAD, "--planner", "dp-tokens", "--out", out).returncode == 0
    # A different seed draws a different batch: the plan no longer covers its sequences.
    result = zellige_cli("show", out, "--workload", "opensora2-stage2", "--seed", 11)
    assert_user_error(result, "this plan is not for this batch")


def test_a_sequence_that_fits_nowhere_is_named(tmp_path):
    sequences = [*images(4), {"id": 42, "num_tokens": 200_000_000, "text_tokens": 0}]
    path = write_batch(tmp_path / "batch.json", sequences)
    for command, extra in (("plan", ["--planner", "zellige"]), ("compare", [])):
        result = zellige_cli(command, "--batch", path, "--gpus", 8, "--model", "mmdit-11b", *extra)
        assert_user_error(result, "sequence 42", "memory")


def whole_sequence_too_big_tokens(model: str, num_gpus: int) -> int:
    """A length that no single GPU can hold but `num_gpus` sharing it can (found by doubling)."""
    cost_model = make_cost_model(model, num_gpus)
    capacity = cost_model.memory_capacity_bytes()
    local = _core.Strategy.local
    ulysses = _core.Strategy.ulysses
    num_tokens = 4096
    while True:
        seq = _core.sequence_from_tokens(0, "video", num_tokens, 0, 0)
        whole = cost_model.shares(seq, _core.make_placement(0, local, [0]))[0].memory_bytes
        if cost_model.fixed_bytes() + whole > capacity:
            break
        num_tokens *= 2
    sharded = cost_model.shares(seq, _core.make_placement(0, ulysses, list(range(num_gpus))))
    assert cost_model.fixed_bytes() + max(s.memory_bytes for s in sharded) < capacity
    return num_tokens


def test_a_planner_that_cannot_place_in_memory_says_memory(tmp_path):
    num_tokens = whole_sequence_too_big_tokens("mmdit-11b", 8)
    sequences = [*images(4), {"id": 9, "num_tokens": num_tokens, "text_tokens": 0}]
    path = write_batch(tmp_path / "batch.json", sequences)
    # dp-tokens keeps every sequence whole: it must refuse, naming memory ...
    refused = zellige_cli(
        "plan", "--batch", path, "--gpus", 8, "--model", "mmdit-11b", "--planner", "dp-tokens"
    )
    assert_user_error(refused, "memory")
    # ... while compare reports the refusal in its row and still runs the planner that can shard.
    result = zellige_cli(
        "compare",
        "--batch",
        path,
        "--gpus",
        8,
        "--model",
        "mmdit-11b",
        "--planners",
        "dp-tokens,zellige",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    dp_tokens, planned = json.loads(result.stdout)
    assert "memory" in dp_tokens["error"] and dp_tokens["fits"] is False
    assert planned["fits"] is True and "error" not in planned
