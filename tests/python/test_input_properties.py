"""Property-based stress of the planning command line (the full tier: @pytest.mark.slow).

Generated batches, plans, profiles and model specs, valid and damaged, go through `zellige plan`
and `zellige show` (in this process, so a traceback fails the test). The property: a valid input
plans (exit 0); any input exits 0 or with one line `zellige...: error: ...` and status 2, within
seconds; an input file and an existing output are never lost. The issue's own cases are fixed
examples here (@example) and in test_cli_inputs.py."""

from __future__ import annotations

import contextlib
import io
import json
import math
import subprocess
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from zellige.cli import main
from zellige.profile import BUILTIN_PROFILE

pytestmark = pytest.mark.slow

SECONDS = 30  # each command, on a loaded two-core machine; the defects ran for minutes
SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
GPUS = 8

# values that are wrong in some way for almost any field
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 2**31, 2**32 + 1, 2**40, 2**62 + 1, 2**63 - 1, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "\ud800", "\x1b[31mred\x07", "a\nb", "x" * 5000, "1e400"]),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def run_cli(argv: list[str]) -> tuple[int, str, str, float]:
    """The command in this process: (status, stdout, stderr, seconds)."""
    out, err = io.StringIO(), io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(a) for a in argv])
    return status, out.getvalue(), err.getvalue(), time.monotonic() - started


def run_cli_process(argv: list[str]) -> tuple[int, str, str, float]:
    """The command in a process of its own, stopped after SECONDS (a hang fails the property)."""
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "zellige.cli", *map(str, argv)],
            capture_output=True,
            text=True,
            timeout=SECONDS,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"zellige {' '.join(map(str, argv))} ran over {SECONDS} s")
    return done.returncode, done.stdout, done.stderr, time.monotonic() - started


def assert_the_property(status: int, stderr: str, seconds: float, valid: bool = False) -> None:
    assert seconds < SECONDS, f"{seconds:.1f} s"
    if valid:
        assert status == 0, stderr[-2000:]
    assert status in (0, 2), stderr[-2000:]
    if status == 2:
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and ": error: " in lines[0], stderr[-2000:]
        assert lines[0].startswith("zellige") and len(lines[0]) < 1000
        assert all(ch.isprintable() for ch in lines[0]), lines[0]


def dump(value: object) -> str:
    """JSON as a damaged file may hold it: NaN, Infinity and lone surrogates (escaped) included."""
    return json.dumps(value)


# ---- batches -----------------------------------------------------------------------------


@st.composite
def valid_batches(draw) -> dict:
    count = draw(st.integers(min_value=1, max_value=12))
    sequences = []
    for i in range(count):
        sequence = {"id": i, "text_tokens": draw(st.integers(0, 64))}
        if draw(st.booleans()):
            sequence["num_tokens"] = draw(st.integers(1, 4096))
        else:
            sequence |= {"frames": 1 + 4 * draw(st.integers(0, 3)), "height": 16 * draw(
                st.integers(1, 16)), "width": 16 * draw(st.integers(1, 16))}  # fmt: skip
        sequence["source_rank"] = draw(st.integers(0, GPUS - 1))
        sequences.append(sequence)
    return {"sequences": sequences}


@st.composite
def damaged_batches(draw) -> str:
    batch = draw(valid_batches())
    how = draw(st.sampled_from(["field", "unknown", "missing", "truncated", "nested", "top"]))
    sequence = draw(st.sampled_from(batch["sequences"]))
    keys = ["id", "num_tokens", "text_tokens", "source_rank", "frames", "height", "width", "kind"]
    if how == "field":
        sequence[draw(st.sampled_from([*keys, "grid"]))] = draw(JUNK)
    elif how == "unknown":
        sequence[draw(st.text(min_size=1, max_size=8))] = 1
    elif how == "missing":
        sequence.pop(draw(st.sampled_from(sorted(sequence))))
    elif how == "nested":
        return "[" * draw(st.integers(50, 20000)) + "]" * 3
    elif how == "top":
        return dump(draw(JUNK))
    text = dump(batch)
    if how == "truncated":
        text = text[: draw(st.integers(0, len(text) - 1))]
    return text


def _plan_batch(tmp: Path, text: str, valid: bool) -> None:
    batch = tmp / "batch.json"
    batch.write_text(text)
    out = tmp / "plan.json"
    out.write_text("previous")
    status, _, err, seconds = run_cli(
        ["plan", "--batch", batch, "--model", "tiny", "--gpus", GPUS, "--planner", "dp-tokens",
         "--out", out]
    )  # fmt: skip
    assert_the_property(status, err, seconds, valid)
    assert batch.read_text() == text  # the input is never touched
    if status != 0:
        assert out.read_text() == "previous"  # nor an output on a refusal
    else:
        assert json.loads(out.read_text())["planner"] == "dp-tokens"


@SETTINGS
@given(valid_batches())
def test_valid_batches_plan(batch) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _plan_batch(Path(tmp), dump(batch), valid=True)


@SETTINGS
@given(damaged_batches())
@example('{"sequences": [{"id": 0, "num_tokens": 16, "kind": "\\ud800"}]}')
@example('{"sequences": [{"id": 0, "num_tokens": 4294967297}]}')
@example('{"sequences": [{"id": 0, "num_tokens": NaN}]}')
@example("[" * 10000)
def test_damaged_batches_are_one_line(text) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        _plan_batch(Path(tmp), text, valid=False)


# ---- plans -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan_text(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    status, _, err, _ = run_cli(
        ["plan", "--workload", "opensora2-stage2", "--gpus", GPUS, "--planner", "zellige",
         "--out", out]
    )  # fmt: skip
    assert status == 0, err
    return out.read_text()


def _paths(value: object, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a JSON value (for picking what to damage)."""
    paths = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value[:4]):
            paths += _paths(item, (*prefix, index))
    return paths


def _set(value: object, path: tuple, new: object) -> None:
    for key in path[:-1]:
        value = value[key]
    value[path[-1]] = new


@SETTINGS
@given(data=st.data())
def test_damaged_plans_are_shown_or_refused_in_one_line(plan_text, data) -> None:
    plan = json.loads(plan_text)
    path = data.draw(st.sampled_from(_paths(plan)), label="path")
    _set(plan, path, data.draw(JUNK, label="value"))
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "plan.json"
        text = dump(plan)
        file.write_text(text)
        status, out, err, seconds = run_cli(["show", file])
        assert_the_property(status, err, seconds)
        assert all(ch.isprintable() for line in out.splitlines() for ch in line)
        assert file.read_text() == text


def test_the_valid_plan_shows(plan_text, tmp_path) -> None:
    file = tmp_path / "plan.json"
    file.write_text(plan_text)
    status, _, err, seconds = run_cli(["show", file])
    assert_the_property(status, err, seconds, valid=True)


# ---- profiles ----------------------------------------------------------------------------


def _builtin_profile() -> dict:
    return json.loads(
        (resources.files("zellige") / "profiles" / f"{BUILTIN_PROFILE}.json").read_text()
    )


@SETTINGS
@given(data=st.data())
def test_damaged_profiles_plan_or_are_refused_in_one_line(data) -> None:
    profile = _builtin_profile()
    path = data.draw(st.sampled_from(_paths(profile)), label="path")
    current = profile
    for key in path:
        current = current[key]
    if isinstance(current, float) and data.draw(st.booleans(), label="scale"):
        new = current * 10.0 ** data.draw(st.integers(-40, 40), label="exponent")
    else:
        new = data.draw(JUNK, label="value")
    _set(profile, path, new)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "profile.json"
        file.write_text(dump(profile))
        status, out, err, seconds = run_cli(
            ["plan", "--workload", "opensora2-stage2", "--gpus", GPUS, "--planner", "zellige",
             "--profile", file]
        )  # fmt: skip
        assert_the_property(status, err, seconds)
        if status == 0:
            assert "inf" not in out.lower().split() and "nan" not in out.lower().split()


# ---- model specs -------------------------------------------------------------------------

SPEC = {"name": "gen", "width": 64, "num_heads": 4, "num_layers": 2, "ffn_width": 128,
        "text_tokens": 8}  # fmt: skip


def _toml(spec: dict) -> str | None:
    """The spec as TOML, or None when a value has no TOML form (null)."""
    lines = []
    for key, value in spec.items():
        if value is None or isinstance(value, dict):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            value = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            lines.append(f"{key} = {value}")
            continue
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return None
        text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
            return None  # TOML integers are 64-bit
        lines.append(f"{key} = {text}")
    return "\n".join(lines) + "\n"


@settings(SETTINGS, max_examples=15)
@given(
    key=st.sampled_from([*SPEC, "head_dim", "joint_attention", "num_double_layers", "param_count",
                         "unknown"]),
    value=st.one_of(JUNK, st.integers(1, 1 << 20)),
    suffix=st.sampled_from([".json", ".toml"]),
)  # fmt: skip
@example(key="num_layers", value=2**40, suffix=".json")
@example(key="head_dim", value=2**62 + 1, suffix=".json")
@example(key="name", value="\ud800", suffix=".json")
def test_generated_model_specs_plan_or_are_refused_in_one_line(key, value, suffix) -> None:
    spec = {**SPEC, key: value}
    text = dump(spec) if suffix == ".json" else _toml(spec)
    if text is None:
        text = dump(spec)
        suffix = ".json"
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / f"spec{suffix}"
        file.write_text(text)
        # a process of its own: the sizes reach the core, where a hang cannot be interrupted
        status, out, err, seconds = run_cli_process(
            ["plan", "--workload", "opensora2-stage2", "--gpus", GPUS, "--planner", "dp-tokens",
             "--model-spec", file]
        )  # fmt: skip
        assert_the_property(status, err, seconds)
        assert all(ch.isprintable() for line in out.splitlines() for ch in line)
        assert file.read_text() == text


def test_the_base_spec_plans(tmp_path) -> None:
    file = tmp_path / "spec.toml"
    file.write_text(_toml(SPEC))
    status, _, err, seconds = run_cli(
        ["plan", "--workload", "opensora2-stage2", "--gpus", GPUS, "--planner", "dp-tokens",
         "--model-spec", file]
    )  # fmt: skip
    assert_the_property(status, err, seconds, valid=True)
