"""Property-based stress of the launcher and the Balancer (the full tier: @pytest.mark.slow).

Generated TOML run files (valid and damaged) and damaged checkpoints go through
`python -m zellige.train` in this process (a traceback fails the test); random malformed samples
go through a Balancer on 2 gloo processes. The property: valid input trains (exit 0; 1 with one
line for a run that stops on a non-finite loss); invalid input exits 2 with one line
`zellige.train: error: ...` (the Balancer: the same ValueError on every rank) within seconds,
and nothing already on disk is lost (a checkpoint resumed without --out is not changed)."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zellige.runtime import end_rank_process, verify
from zellige.train.__main__ import main
from zellige.train.config import SECTION_OF

pytestmark = pytest.mark.slow

SECONDS = 60  # one launcher call: refusals take seconds, a valid run trains 1-2 tiny steps
SETTINGS = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    derandomize=True,
)
JUNK = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, -1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "\x1b[31mred\x07", "a\nb", "x" * 5000, "nope"]),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=3),
)
# valid values that keep a run to seconds on CPU
CHEAP = {
    "steps": st.integers(1, 2),
    "seed": st.integers(0, 2**32 - 1),
    "dtype": st.sampled_from(["float64", "float32", "bfloat16"]),
    "planner": st.sampled_from(["zellige", "dp-tokens", "dp-cost"]),
    "learning_rate": st.floats(1e-6, 1e-2),
    "warmup_steps": st.integers(0, 5),
    "grad_clip_norm": st.floats(0.1, 10),
    "weight_decay": st.floats(0, 0.1),
    "betas": st.tuples(st.floats(0, 0.99), st.floats(0, 0.999)).map(list),
    "checkpoint_every": st.integers(0, 2),
    "data_ranks": st.integers(1, 4),
    "timeout_s": st.floats(60, 600),
    "metrics_one_step_late": st.booleans(),
    "freeze_gc": st.booleans(),
}
MODEL = {
    "num_layers": st.integers(1, 3),
    "num_heads": st.sampled_from([1, 2, 4]),
    "ffn_width": st.integers(1, 256),
    "text_tokens": st.integers(0, 16),
    "text_dim": st.integers(1, 64),
    "latent_channels": st.integers(1, 8),
    "freq_dim": st.sampled_from([2, 16, 32]),
    "eps": st.floats(1e-8, 1e-3),
    "rope_theta": st.floats(10, 1e5),
}


@pytest.fixture(autouse=True)
def _restored_environment():
    """An in-process run sets RANK, WORLD_SIZE and MASTER_* (setup_distributed): later tests'
    subprocesses must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def run_launcher(argv: list[str]) -> tuple[int, str, float]:
    err = io.StringIO()
    started = time.monotonic()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            status = main(["--loader-workers", "0", *argv])
        except SystemExit as exit_:
            status = exit_.code
    return status, err.getvalue(), time.monotonic() - started


def assert_the_property(status: int, stderr: str, seconds: float) -> None:
    assert seconds < SECONDS, f"{seconds:.1f} s"
    assert status in (0, 1, 2), stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("zellige.train: error: ")]
    if status != 0:
        assert len(errors) == 1, stderr[-2000:]
        assert len(errors[0]) < 500 and all(ch.isprintable() for ch in errors[0]), errors[0]
    if status == 1:
        assert "not finite" in errors[0], errors[0]
    assert "Traceback" not in stderr


def toml_value(value: object) -> str | None:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int | str):
        return json.dumps(value)
    if isinstance(value, list | tuple):
        items = [toml_value(v) for v in value]
        return None if None in items else "[" + ", ".join(items) + "]"
    return None


@st.composite
def run_files(draw) -> tuple[str, bool]:
    """A TOML run file and whether every value in it was drawn valid."""
    fields = draw(st.dictionaries(st.sampled_from(sorted(CHEAP)), st.none(), max_size=6))
    model = draw(st.dictionaries(st.sampled_from(sorted(MODEL)), st.none(), max_size=4))
    values = {key: draw(CHEAP[key]) for key in fields}
    model_values = {key: draw(MODEL[key]) for key in model}
    valid = True
    if draw(st.booleans()):  # damage one value
        valid = False
        target = draw(st.sampled_from([*sorted(CHEAP), *(f"model.{k}" for k in sorted(MODEL))]))
        junk = draw(JUNK)
        if target.startswith("model."):
            model_values[target.removeprefix("model.")] = junk
        else:
            values[target] = junk
    values.setdefault("steps", 1)
    # each field in its table (the run's own at the top); the model's sizes beside its preset
    tables: dict[str, list[str]] = {"": ['config = "tiny-cpu"'], "model": ['preset = "tiny-cpu"']}
    for key, value in [*values.items(), *((f"model.{k}", v) for k, v in model_values.items())]:
        table, _, name = (
            key.rpartition(".") if key.startswith("model.") else (SECTION_OF[key], "", key)
        )
        text = toml_value(value)
        if text is not None:
            tables.setdefault(table, []).append(f"{name} = {text}")
    lines = tables.pop("")
    for table, rows in tables.items():
        lines += [f"[{table}]", *rows]
    return "\n".join(lines) + "\n", valid


@SETTINGS
@given(run_files())
def test_generated_run_files_train_or_are_refused_in_one_line(case) -> None:
    text, valid = case
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.toml"
        path.write_text(text)
        status, err, seconds = run_launcher(["--config-file", str(path)])
        assert_the_property(status, err, seconds)
        if valid:
            # a valid file trains; a width not divisible by the drawn heads is the only refusal
            assert status in (0, 1) or "multiple of" in err or "head_dim" in err, err[-2000:]
        assert path.read_text() == text


# ---- checkpoints -------------------------------------------------------------------------

BASE = ["--config", "tiny-cpu", "--dtype", "float64"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved") / "ckpt"
    dropped = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dropped} | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "zellige.train", "--loader-workers", "0", *BASE, "--steps", "2",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (out / ".lock").unlink(missing_ok=True)
    return out


def _tree_digest(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@st.composite
def damage(draw, files: list[str]):
    how = draw(st.sampled_from(["flip", "truncate", "delete", "state", "latest"]))
    name = draw(st.sampled_from(files))
    return how, name, draw(st.integers(0, 2**31)), draw(JUNK)


def _damage(root: Path, how: str, name: str, number: int, junk: object) -> None:
    path = root / name
    if how == "flip" and path.stat().st_size:
        data = bytearray(path.read_bytes())
        data[number % len(data)] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: number % (len(data) + 1)])
    elif how == "delete":
        path.unlink()
    elif how == "state":  # a value replaced, its digest made valid again (content checks only)
        state_path = root / "step-2" / "train_state.json"
        state = json.loads(state_path.read_text())
        keys = [k for k in state if k != "digest"]
        key = keys[number % len(keys)]
        if isinstance(state[key], dict) and state[key] and number % 2:
            inner = sorted(state[key])[number % len(state[key])]
            state[key][inner] = junk
        else:
            state[key] = junk
        body = {k: v for k, v in state.items() if k != "digest"}
        state["digest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        state_path.write_text(json.dumps(state))
    elif how == "latest":
        (root / "latest").write_text(str(junk))


@SETTINGS
@given(data=st.data())
def test_damaged_checkpoints_are_refused_in_one_line_and_left_as_they_are(saved, data) -> None:
    files = sorted(str(p.relative_to(saved)) for p in saved.rglob("*") if p.is_file())
    how, name, number, junk = data.draw(damage(files), label="damage")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "ckpt"
        shutil.copytree(saved, root)
        _damage(root, how, name, number, junk)
        before = _tree_digest(root)
        status, err, seconds = run_launcher([*BASE, "--steps", "3", "--resume", str(root)])
        assert_the_property(status, err, seconds)
        assert _tree_digest(root) == before  # resumed without --out: nothing written there


# ---- the Balancer ------------------------------------------------------------------------

WORLD = 2
NUM_CASES = 60


def _random_samples(rng: random.Random, damaged: bool) -> object:
    import zellige

    samples = []
    for _ in range(rng.randint(0 if damaged else 1, 3)):
        grid = [rng.randint(1, 3), rng.randint(1, 6), rng.randint(1, 6)]
        text_tokens: object = rng.randint(0, 5)
        rows = grid[0] * grid[1] * grid[2]
        tokens: dict = {"x": torch.zeros(rows, 2)}
        if damaged:
            junk = rng.choice([None, math.nan, -1, 0, 2**40, 2.5, True, "3", [1], 2**70])
            what = rng.choice(["grid", "text", "tensor", "rows", "dim", "object"])
            if what == "grid":
                grid[rng.randrange(3)] = junk
            elif what == "text":
                text_tokens = junk
            elif what == "tensor":
                tokens = {"x": [[0.0, 0.0]] * rows}
            elif what == "rows":
                tokens = {"x": torch.zeros(rows + 1, 2)}
            elif what == "dim":
                grid = grid[:2]
            else:
                samples.append(junk)
                continue
        samples.append(zellige.Sample(grid_thw=tuple(grid), text_tokens=text_tokens, tokens=tokens))
    if damaged and rng.random() < 0.1:
        return rng.choice([None, 7, "samples"])
    return samples


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=30))
    import zellige

    outcomes = []
    try:
        for case in range(NUM_CASES):
            rng = random.Random(case * WORLD + rank)
            damaged = rank == 1 and case % 3 != 0  # every third case valid on both ranks
            samples = _random_samples(rng, damaged)
            balancer = zellige.Balancer("tiny", plan_ahead=False)
            began = time.perf_counter()
            try:
                step = balancer.step(samples)
                step.inputs()
                outcome = "ok"
            except ValueError as error:
                outcome = f"ValueError: {error}"
            except Exception as error:  # noqa: BLE001 - the property fails on it
                outcome = f"{type(error).__name__}: {error}"
            outcomes.append((outcome, time.perf_counter() - began, damaged))
            balancer.close()
    except Exception:  # noqa: BLE001
        outcomes.append((traceback.format_exc(), 0.0, False))
    gathered = [None] * WORLD
    dist.all_gather_object(gathered, outcomes)
    if rank == 0:
        queue.put(gathered)
    end_rank_process()


def test_random_malformed_samples_are_one_value_error_on_every_rank() -> None:
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_worker, args=(verify.free_port(), queue), nprocs=WORLD, join=True)
    ranks = queue.get()
    assert len(ranks[0]) == len(ranks[1]) == NUM_CASES, ranks
    for case, (first, second) in enumerate(zip(*ranks, strict=True)):
        assert first[0] == second[0], (case, first, second)  # the same on both ranks
        assert first[0] == "ok" or first[0].startswith("ValueError: "), (case, first)
        assert max(first[1], second[1]) < 10, (case, first, second)
        if not second[2]:  # valid on both ranks
            assert first[0] == "ok", (case, first)
