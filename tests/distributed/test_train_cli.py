"""The train CLI's checks and checkpoints on one process (no torchrun: seconds per case).

Bad input is one line `zellige.train: error: ...`, exit status 2, before training; a TOML run
file with command-line overrides; TensorBoard next to the JSONL; resume that says when it has
nothing to do, refuses a checkpoint of another model or a step count below it, verifies
checksums and never unpickles a file of its own; a non-finite loss stops the run."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zellige.train.__main__ import main

TIMEOUT_S = 180


def _train(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "zellige.train", "--loader-workers", "0", *args]
    # a single process picks its own rendezvous port: drop any that an earlier test left behind
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _one_error(capsys, argv: list[str], status: int = 2) -> str:
    """Runs the CLI in this process; asserts one error line and the exit status; returns it."""
    try:
        got = main(argv)
    except SystemExit as exit_:  # argparse's errors exit
        got = exit_.code
    assert got == status
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zellige.train: error: "), captured.err
    assert captured.out == ""
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One short run from a TOML file with overrides, saving checkpoints and TensorBoard."""
    root = tmp_path_factory.mktemp("run")
    config_file = root / "run.toml"
    config_file.write_text(
        'config = "tiny-cpu"\nsteps = 50\n[model]\npreset = "tiny-cpu"\ndtype = "float64"\n'
        '[parallelism]\nplanner = "dp-cost"\n'
    )
    done = _train(
        "--config-file", str(config_file), "--steps", "2", "--checkpoint-every", "1",
        "--out", str(root / "ckpt"), "--metrics", str(root / "m.jsonl"),
        "--tensorboard", str(root / "tb"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {"root": root, "stdout": done.stdout, "stderr": done.stderr, "config_file": config_file}


def test_toml_file_with_overrides_and_run_output(run) -> None:
    records = [json.loads(line) for line in (run["root"] / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]  # --steps 2 overrode the file's 50
    assert {r["planner"] for r in records} == {"dp-cost"}  # from the file
    stderr = run["stderr"]
    ckpt = run["root"] / "ckpt"
    assert f"saved checkpoint {ckpt / 'step-1'}" in stderr
    assert f"saved checkpoint {ckpt / 'step-2'}" in stderr
    assert "cost model: the built-in profile (NVIDIA H200); this run is on CPU" in stderr
    stdout = run["stdout"]  # the step lines and the summary
    summary = [line for line in stdout.splitlines() if line.startswith("done: steps 1-2 on 1 rank")]
    assert len(summary) == 1 and f"checkpoint {ckpt / 'step-2'}" in summary[0], stdout
    # one number style for tok/s: grouped digits, no exponent
    values = re.findall(r"tok/s (\S+)", stdout) + re.findall(r"; (\S+) tok/s", stdout)
    assert len(values) == 3, stdout
    assert all(re.fullmatch(r"\d{1,3}(,\d{3})*", v) for v in values), values
    state = json.loads((ckpt / "step-2" / "train_state.json").read_text())
    assert state["step"] == 2 and state["num_ranks"] == 1 and state["model"]["num_layers"] == 2
    assert not list(ckpt.glob("step-2/*.pt")) and not list(ckpt.glob(".*partial"))


def test_tensorboard_has_the_jsonl_scalars(run) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    records = [json.loads(line) for line in (run["root"] / "m.jsonl").read_text().splitlines()]
    events = EventAccumulator(str(run["root"] / "tb"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("loss")]
    assert [s for s, _ in losses] == [1, 2]
    assert [v for _, v in losses] == pytest.approx([r["loss"] for r in records], rel=1e-6)
    assert "tokens_per_s" in events.Tags()["scalars"]


def test_resume_with_nothing_to_do_says_so(run, capsys) -> None:
    metrics = run["root"] / "m.jsonl"
    before = metrics.read_text()
    ckpt = run["root"] / "ckpt"
    argv = ["--config-file", str(run["config_file"]), "--steps", "2", "--resume", str(ckpt)]
    assert main([*argv, "--metrics", str(metrics)]) == 0
    err = capsys.readouterr().err
    assert f"checkpoint {ckpt / 'step-2'} is already at step 2 = --steps: nothing to do" in err
    assert metrics.read_text() == before


def test_resume_refusals(run, capsys, tmp_path: Path) -> None:
    ckpt = str(run["root"] / "ckpt")
    base = ["--config-file", str(run["config_file"])]
    line = _one_error(capsys, [*base, "--steps", "1", "--resume", ckpt])
    assert "--steps 1 is below the step of checkpoint" in line and "(2)" in line
    fewer = tmp_path / "fewer.toml"
    fewer.write_text('config = "tiny-cpu"\n[model]\npreset = "tiny-cpu"\nnum_layers = 1\n')
    line = _one_error(capsys, ["--config-file", str(fewer), "--steps", "3", "--resume", ckpt])
    assert "holds another model: its num_layers is 2, this run's 1" in line
    missing = tmp_path / "missing"
    line = _one_error(capsys, [*base, "--resume", str(missing)])
    assert line == f"zellige.train: error: --resume {missing}: no such directory"
    empty = tmp_path / "empty"
    empty.mkdir()
    line = _one_error(capsys, [*base, "--resume", str(empty)])
    assert "no checkpoint there" in line and "fewer ranks" not in line


class _Marker:
    """Unpickling this writes a file: the proof that a checkpoint ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "ran"))


def test_resume_runs_no_code_of_a_crafted_rank_file(run, capsys, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    # today's rank-R.pt layout with a payload: refused, never unpickled
    old = tmp_path / "old" / "step-3"
    old.mkdir(parents=True)
    (old.parent / "latest").write_text("step-3\n")
    (old / "rank-0.pt").write_bytes(pickle.dumps({"step": _Marker(str(marker))}))
    line = _one_error(capsys, ["--config", "tiny-cpu", "--resume", str(old.parent)])
    assert "older zellige" in line
    # a payload dropped into a good checkpoint is not read either: the run resumes and trains
    good = tmp_path / "good"
    shutil.copytree(run["root"] / "ckpt", good)
    torch.save({"step": _Marker(str(marker))}, good / "step-2" / "rank-0.pt")
    done = _train("--config-file", str(run["config_file"]), "--steps", "3", "--resume", str(good))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr and "step 3/3" in done.stdout
    assert not marker.exists()


def test_corrupt_checkpoint_is_refused(run, tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt"
    shutil.copytree(run["root"] / "ckpt", corrupt)
    shard = corrupt / "step-2" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside a tensor
    shard.write_bytes(bytes(data))
    done = _train(
        "--config-file", str(run["config_file"]), "--steps", "3", "--resume", str(corrupt)
    )
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        f"zellige.train: error: checkpoint {corrupt / 'step-2'} is corrupt: __0_0.distcp does "
        "not match the checksums in train_state.json"
    ], done.stderr[-3000:]
    assert "Traceback" not in done.stderr


def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    done = _train(
        "--config", "tiny-cpu", "--steps", "6", "--learning-rate", "1e30",
        "--checkpoint-every", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("zellige.train:")]
    assert len(errors) == 1 and "not finite" in errors[0], done.stderr[-3000:]
    latest = (out / "latest").read_text().strip()
    assert errors[0].endswith(f"the last checkpoint: {out / latest}")
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("step-")) == [
        f"step-{k}" for k in range(1, int(latest.removeprefix("step-")) + 1)
    ]
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--steps", "-1"], "steps must be at least 1, got -1"),
        (["--seed", "-1"], "seed must be in [0, 2**32), got -1"),
        (["--learning-rate", "nan"], "learning_rate must be > 0, got nan"),
        (["--timeout-s", "0"], "timeout_s must be > 0 seconds"),
        (["--steps", "ten"], "argument --steps: 'ten' is not int"),
        (["--config", "nope"], "unknown config 'nope'"),
        (["--planner", "bogus"], "planner 'bogus': unknown planner"),
        (["--planner", "static-cp:3"], "static-cp:3: the group size must divide the 1 GPUs"),
        (["--recipe", "bogus"], "unknown workload 'bogus'"),
        (["--profile", "/missing.json"], "/missing.json: cannot read"),
    ],
)
def test_bad_values_are_one_line(capsys, tmp_path: Path, argv: list[str], words: str) -> None:
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("kept\n")
    config = [] if "--config" in argv else ["--config", "tiny-cpu"]
    line = _one_error(capsys, [*config, *argv, "--metrics", str(metrics)])
    assert words in line
    assert metrics.read_text() == "kept\n"  # not emptied


def test_bad_paths_fail_before_training(capsys, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    line = _one_error(capsys, ["--config", "tiny-cpu", "--out", str(a_file)])
    assert line.endswith(f"--out {a_file}: exists and is not a directory")
    line = _one_error(capsys, ["--config", "tiny-cpu", "--metrics", str(tmp_path / "no" / "m")])
    assert "is not a writable directory" in line


def test_config_file_errors(capsys, tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('config = "tiny-cpu"\nstpes = 3\n')
    line = _one_error(capsys, ["--config-file", str(path)])
    assert f"{path}: unknown key 'stpes'; allowed: config, steps, seed, freeze_gc, model" in line
    path.write_text('config = "tiny-cpu"\nlearning_rate = 1e-3\n')  # a key of a section
    line = _one_error(capsys, ["--config-file", str(path)])
    assert line.endswith(f"{path}: learning_rate is not a key there: use [optimizer] learning_rate")
    path.write_text('config = "tiny-cpu"\n[data]\nplanner = "dp-cost"\n')
    line = _one_error(capsys, ["--config-file", str(path)])
    assert line.endswith(f"{path}: data.planner is not a key there: use [parallelism] planner")
    path.write_text('config = "tiny-cpu"\n[optimizer]\nlr = 1e-3\n')
    line = _one_error(capsys, ["--config-file", str(path)])
    assert "unknown key 'optimizer.lr'; allowed: learning_rate, betas" in line
    path.write_text('config = "tiny-cpu"\nsteps = "3"\n')
    assert "steps must be an integer, got '3'" in _one_error(capsys, ["--config-file", str(path)])
    path.write_text("steps = [\n")
    assert "not valid TOML" in _one_error(capsys, ["--config-file", str(path)])
    line = _one_error(capsys, ["--config-file", str(tmp_path / "missing.toml")])
    assert "cannot read" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only PyTorch or no GPU")
def test_gpu_config_on_a_cpu_only_install(capsys) -> None:
    line = _one_error(capsys, ["--config", "wan1p3b-h200", "--steps", "1"])
    assert "trains on CUDA GPUs" in line
    if torch.version.cuda is None:
        assert "CPU-only build" in line and "--index-url https://download.pytorch.org" in line


def test_wandb_is_optional(capsys) -> None:
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed")
    line = _one_error(capsys, ["--config", "tiny-cpu", "--wandb", "project"])
    assert "--wandb needs the wandb package" in line
