"""Checkpoints as input: every value of train_state.json is checked (type, range, agreement
with the directory and with this run) before anything is built from it, damaged content is one
line `zellige.train: error: ...` with exit status 2 on every rank, two runs never write one
--out, and a save interrupted while it replaces a step still resumes. One process, seconds per
case (the launcher in this process), one short run in a subprocess as the fixture."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zellige.train.__main__ import main

TIMEOUT_S = 180


@pytest.fixture(autouse=True)
def _restored_environment():
    """An in-process run sets RANK, WORLD_SIZE and MASTER_* (setup_distributed): later tests'
    subprocesses must not inherit them."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


def _train(*args: str, wait: bool = True):
    command = [sys.executable, "-m", "zellige.train", "--loader-workers", "0", *args]
    # a single process picks its own rendezvous: drop what an in-process run left behind
    dropped = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["OMP_NUM_THREADS"] = "1"
    if not wait:
        return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _one_error(capsys, argv: list[str], status: int = 2) -> str:
    try:
        got = main(argv)
    except SystemExit as exit_:
        got = exit_.code
    captured = capsys.readouterr()
    assert got == status, captured.err[-3000:]
    lines = captured.err.strip().splitlines()
    errors = [line for line in lines if line.startswith("zellige.train: error: ")]
    assert len(errors) == 1, captured.err[-3000:]
    assert "Traceback" not in captured.err
    return errors[0]


BASE = ["--config", "tiny-cpu", "--dtype", "float64"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A 2-step run on one rank that saved after each step."""
    out = tmp_path_factory.mktemp("saved") / "ckpt"
    done = _train(*BASE, "--steps", "2", "--checkpoint-every", "1", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _copy(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    (copy / ".lock").unlink(missing_ok=True)
    return copy


def _digest(path: Path) -> dict:
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _rewrite(step_dir: Path, change, *, redigest: bool = True, refiles: bool = False) -> None:
    """train_state.json changed by `change(state)`; its digest (and the file checksums) made
    valid again, so only the content's checks can refuse it."""
    path = step_dir / "train_state.json"
    state = json.loads(path.read_text())
    change(state)
    if refiles:
        for name in list(state["files"]):
            if (step_dir / name).is_file():
                state["files"][name] = _digest(step_dir / name)
    if redigest and "digest" in state:
        body = {k: v for k, v in state.items() if k != "digest"}
        state["digest"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    path.write_text(json.dumps(state, indent=1))


def _resume(capsys, ckpt: Path, *extra: str) -> str:
    return _one_error(capsys, [*BASE, "--steps", "3", "--resume", str(ckpt), *extra])


def test_a_step_changed_in_train_state_is_refused(saved, capsys, tmp_path) -> None:
    ckpt = _copy(saved, tmp_path)
    _rewrite(ckpt / "step-2", lambda s: s.update(step=1), redigest=False)
    line = _resume(capsys, ckpt)
    assert "train_state.json is not valid (its digest does not match its content" in line
    _rewrite(ckpt / "step-2", lambda s: s.update(step=1))  # digest made valid: the name says 2
    assert "step 1 in directory step-2" in _resume(capsys, ckpt)


CONTENT_CASES = {
    "base_lrs NaN": (lambda s: s["scheduler"].update(base_lrs=[float("nan")]), "not valid"),
    "base_lrs 1e308": (lambda s: s["scheduler"].update(base_lrs=[1e308]), "scheduler.base_lrs"),
    "scheduler empty": (lambda s: s.update(scheduler={}), "scheduler.base_lrs must be"),
    "last_epoch x": (lambda s: s["scheduler"].update(last_epoch="x"), "scheduler.last_epoch"),
    "last_epoch 1": (lambda s: s["scheduler"].update(last_epoch=1), "is not step 2"),
    "optimizer null": (lambda s: s.update(optimizer=None), "unknown key 'optimizer'"),
    "data_ranks 2^63": (lambda s: s.update(data_ranks=2**63), "data_ranks must be an integer"),
    "num_ranks 0": (lambda s: s.update(num_ranks=0), "num_ranks must be an integer"),
    "data_ranks 16384": (lambda s: s.update(data_ranks=16384), "at most 8 per rank of this run's"),
    "no .metadata": (lambda s: s["files"].pop(".metadata"), "no checksum of .metadata"),
    "files empty": (lambda s: s.update(files={}), "no checksum of"),
    "files a path": (lambda s: s["files"].update({"../x": s["files"][".metadata"]}), "plain name"),
    "model a list": (lambda s: s.update(model=[1]), "model must be an object"),
    "run missing": (lambda s: s.pop("run"), "no 'run'"),
    "run seed -1": (lambda s: s["run"].update(seed=-1), "run.seed must be an integer"),
    "deeply nested": (lambda s: s.update(model={"x": [[[[[[[[1]]]]]]]]}), "model must be"),
}


@pytest.mark.parametrize("case", list(CONTENT_CASES))
def test_damaged_content_with_valid_checksums_is_one_line(saved, capsys, tmp_path, case) -> None:
    change, words = CONTENT_CASES[case]
    ckpt = _copy(saved, tmp_path)
    _rewrite(ckpt / "step-2", change)
    line = _resume(capsys, ckpt)
    assert words in line, line


def test_train_state_nested_ten_thousand_deep(saved, capsys, tmp_path) -> None:
    ckpt = _copy(saved, tmp_path)
    (ckpt / "step-2" / "train_state.json").write_text("[" * 10000 + "]" * 10000)
    assert "train_state.json is not valid" in _resume(capsys, ckpt)


@pytest.mark.parametrize("metadata", [b"", b"garbage \x00\x01"])
def test_an_empty_or_garbage_metadata_with_its_checksum_is_one_line(
    saved, capsys, tmp_path, metadata
) -> None:
    ckpt = _copy(saved, tmp_path)
    (ckpt / "step-2" / ".metadata").write_bytes(metadata)
    _rewrite(ckpt / "step-2", lambda s: None, refiles=True)
    line = _resume(capsys, ckpt)
    assert f"checkpoint {ckpt / 'step-2'}: its shards do not load" in line


@pytest.mark.parametrize(
    "flag, value, saved_value",
    [
        ("--dtype", "float32", "'float64'"),
        ("--seed", "7", "0"),
        ("--planner", "dp-cost", "'zellige'"),
    ],
)
def test_resume_with_another_dtype_seed_or_planner_is_refused(
    saved, capsys, tmp_path, flag, value, saved_value
) -> None:
    ckpt = _copy(saved, tmp_path)
    line = _one_error(capsys, [*BASE, "--steps", "3", "--resume", str(ckpt), flag, value])
    key = flag.removeprefix("--")
    assert f"was trained with {key} {saved_value}, this run's is" in line


def test_resume_with_another_global_batch_is_refused(saved, capsys, tmp_path) -> None:
    """The global batch size decides the batches drawn: a resumed run must keep it."""
    ckpt = _copy(saved, tmp_path)
    line = _one_error(capsys, [*BASE, "--steps", "3", "--resume", str(ckpt), "--global-batch", "8"])
    assert "was trained with global_batch None, this run's is '8'" in line
    _rewrite(ckpt / "step-2", lambda s: s["run"].update(global_batch="8"))
    assert "was trained with global_batch '8', this run's is None" in _resume(capsys, ckpt)
    _rewrite(ckpt / "step-2", lambda s: s["run"].update(global_batch=8))
    assert "run.global_batch must be a string or null" in _resume(capsys, ckpt)


def test_resume_from_a_latent_dataset_without_it_is_refused(saved, capsys, tmp_path) -> None:
    """A run that trained on a latent dataset (its manifest's digest recorded) resumes on it."""
    ckpt = _copy(saved, tmp_path)
    _rewrite(ckpt / "step-2", lambda s: s["run"].update(data="ab" * 32))
    assert (
        f"was trained on the latent dataset whose manifest has SHA-256 {'ab' * 8}..., this run on "
        "the recipe's synthetic data: resume with the same --data"
    ) in _resume(capsys, ckpt)


def test_resume_with_another_recipe_is_refused(saved, capsys, tmp_path) -> None:
    ckpt = _copy(saved, tmp_path)
    _rewrite(ckpt / "step-2", lambda s: s["run"].update(recipe="wan-stage1"))
    assert "was trained with recipe 'wan-stage1', this run's is 'tiny'" in _resume(capsys, ckpt)


@pytest.mark.parametrize("aside", [".step-2.partial", ".step-2.stale"])
def test_a_step_moved_aside_by_a_killed_resave_still_resumes(saved, tmp_path, aside) -> None:
    ckpt = _copy(saved, tmp_path)
    (ckpt / "step-2").rename(ckpt / aside)  # latest names step-2, which is gone
    done = _train(*BASE, "--steps", "3", "--resume", str(ckpt), "--out", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {ckpt / aside} at step 2" in done.stderr
    assert (ckpt / "latest").read_text().strip() == "step-3"
    # the next run into --out removes what the killed save left
    done = _train(*BASE, "--steps", "4", "--resume", str(ckpt), "--out", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (ckpt / aside).exists()


def test_leftovers_of_killed_saves_are_removed_by_the_next_run(saved, tmp_path) -> None:
    ckpt = _copy(saved, tmp_path)
    (ckpt / ".step-5.partial").mkdir()
    (ckpt / ".step-5.partial" / "__0_0.distcp").write_bytes(b"x" * 1000)
    (ckpt / ".latest.partial").write_text("step-5\n")
    done = _train(*BASE, "--steps", "3", "--resume", str(ckpt), "--out", str(ckpt))
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (ckpt / ".step-5.partial").exists() and not (ckpt / ".latest.partial").exists()


def test_a_second_run_on_the_same_out_is_refused_and_the_first_is_untouched(
    capsys, tmp_path
) -> None:
    out = tmp_path / "ckpt"
    first = _train(*BASE, "--steps", "1000", "--checkpoint-every", "1", "--out", str(out),
                   wait=False)  # fmt: skip
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / "step-1" / "train_state.json").exists():
            assert first.poll() is None, first.stderr.read().decode()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        line = _one_error(capsys, [*BASE, "--steps", "3", "--out", str(out)])
        assert f"--out {out}: another run (pid {first.pid}) is writing checkpoints there" in line
    finally:
        first.kill()
        first.communicate(timeout=30)
    latest = (out / "latest").read_text().strip()
    done = _train(*BASE, "--steps", str(int(latest.removeprefix("step-")) + 1),
                  "--resume", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_held_lock_is_refused_before_the_model_is_built(capsys, tmp_path) -> None:
    out = tmp_path / "ckpt"
    out.mkdir()
    with open(out / ".lock", "w") as held:
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX)
        line = _one_error(capsys, [*BASE, "--steps", "1", "--out", str(out)])
    assert "another run (pid 4242) is writing checkpoints there" in line


@pytest.mark.parametrize("name", ["latest", "step-3", ".step-3.partial", ".latest.partial"])
def test_metrics_where_checkpoints_are_written_is_refused(capsys, tmp_path, name) -> None:
    out = tmp_path / "ckpt"
    line = _one_error(capsys, [*BASE, "--out", str(out), "--metrics", str(out / name)])
    assert f"--metrics {out / name}: inside --out where checkpoints are written" in line


def test_metrics_beside_the_checkpoints_is_allowed(tmp_path) -> None:
    out = tmp_path / "ckpt"
    done = _train(*BASE, "--steps", "1", "--out", str(out), "--metrics", str(out / "m.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "m.jsonl").read_text().count("\n") == 1


def test_three_ranks_and_two_gpus_per_node_names_the_flag(capsys, monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "3")
    line = _one_error(capsys, [*BASE, "--steps", "1"])
    assert "gpus_per_node 2 does not divide the 3 ranks" in line and "--gpus-per-node" in line
    assert "--gpus " not in line
