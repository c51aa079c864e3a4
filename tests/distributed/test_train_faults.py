"""Faults while training under torchrun (gloo, CPU): a stopped rank fails the run within the
collective timeout and is named; ranks die with their launcher; a kill during a checkpoint save
leaves the previous checkpoint loadable; bad input is one line from one rank, before training."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

BOUND_S = 180  # no run here may take longer: a hang fails the test, it does not stall CI


def _command(nproc: int, *args: str) -> list[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--master-port", str(29000 + os.getpid() % 400)]
    return [*command, "-m", "zellige.train", "--config", "tiny-cpu", "--loader-workers", "0", *args]


def _env() -> dict:
    # a single-process run picks its own rendezvous port: drop any an earlier test left behind
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _launch(nproc: int, *args: str) -> subprocess.Popen:
    # a session of its own, so the test can stop or kill torchrun's process group
    return subprocess.Popen(
        _command(nproc, *args),
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for(condition: Callable[[], bool], timeout_s: float, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s")
        time.sleep(poll_s)


def _children(pid: int) -> list[int]:
    try:
        tasks = Path(f"/proc/{pid}/task").iterdir()
        return [int(c) for t in tasks for c in (t / "children").read_text().split()]
    except (FileNotFoundError, ProcessLookupError):
        return []


def _rank_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the rank processes torchrun started."""
    ranks = {}
    for pid in _children(launcher):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                ranks[int(entry[5:])] = pid
    return ranks


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _kill(pids: list[int]) -> None:
    """SIGKILL these processes, which this test started."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("zellige.train: error:")]


def _no_rank_traceback(stderr: str) -> bool:
    # torchrun prints its own summary when a rank fails; no rank may print a Python traceback
    return "zellige/train" not in stderr and "zellige/data" not in stderr


def test_stopped_rank_fails_the_run_within_the_timeout(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    launcher = _launch(2, "--steps", "1000", "--timeout-s", "5", "--metrics", str(metrics))
    ranks = {}
    try:
        _wait_for(lambda: _lines(metrics) >= 2, BOUND_S)
        ranks = _rank_pids(launcher.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(ranks[1], signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=BOUND_S)
        elapsed_s = time.monotonic() - stopped_at
    finally:
        _kill([launcher.pid, *ranks.values()])
    assert launcher.returncode != 0
    errors = _errors(stderr)
    assert len(errors) == 1, stderr[-3000:]
    assert "rank 1 stopped responding" in errors[0] and "--timeout-s" in errors[0], errors
    # 5 s of timeout, 3 s to tell which rank stands still, and torchrun's own clean-up (up to
    # 30 s before it kills the stopped rank)
    assert elapsed_s < 5 + 3 + 30 + 30, elapsed_s
    assert _no_rank_traceback(stderr), stderr[-3000:]


def test_a_killed_rank_ends_the_run(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    launcher = _launch(2, "--steps", "1000", "--timeout-s", "60", "--metrics", str(metrics))
    ranks = {}
    try:
        _wait_for(lambda: _lines(metrics) >= 2, BOUND_S)
        ranks = _rank_pids(launcher.pid)
        os.kill(ranks[1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = launcher.communicate(timeout=BOUND_S)
        elapsed_s = time.monotonic() - killed_at
    finally:
        _kill([launcher.pid, *ranks.values()])
    assert launcher.returncode != 0
    assert elapsed_s < 30, elapsed_s  # torchrun sees the death; nobody waits for the timeout
    assert not any(_alive(pid) for pid in ranks.values())
    assert _no_rank_traceback(stderr), stderr[-3000:]


def test_ranks_die_with_their_launcher(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    launcher = _launch(2, "--steps", "1000", "--metrics", str(metrics), "--out", str(tmp_path))
    ranks = {}
    try:
        _wait_for(lambda: _lines(metrics) >= 1, BOUND_S)
        ranks = _rank_pids(launcher.pid)
        assert sorted(ranks) == [0, 1]
        os.killpg(launcher.pid, signal.SIGKILL)  # torchrun's process group, as a job manager does
        launcher.communicate(timeout=30)
        survivors = list(ranks.values())
        try:
            _wait_for(lambda: not any(_alive(pid) for pid in survivors), 20)
        except AssertionError:
            pytest.fail(f"ranks {[r for r, p in ranks.items() if _alive(p)]} outlived torchrun")
    finally:
        _kill([launcher.pid, *ranks.values()])


def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    launcher = _launch(2, "--steps", "1000", "--checkpoint-every", "1", "--out", str(out))
    pids = [launcher.pid]
    caught = None
    try:
        _wait_for(lambda: (out / "step-1" / "train_state.json").exists(), BOUND_S)
        pids += _rank_pids(launcher.pid).values()
        deadline = time.monotonic() + BOUND_S
        while caught is None and time.monotonic() < deadline:
            partial = [
                p for p in os.listdir(out) if p.endswith(".partial") and p != ".latest.partial"
            ]
            if not partial:
                time.sleep(0.001)
                continue
            for pid in pids:  # freeze the save where it is, then check it is still under way
                os.kill(pid, signal.SIGSTOP)
            if (out / partial[0]).exists():
                caught = partial[0]
            else:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
        assert caught, "never caught a save in progress"
    finally:
        _kill(pids)
        launcher.communicate(timeout=30)
    step_dirs = sorted(p.name for p in out.iterdir() if p.name.startswith("step-"))
    assert step_dirs and all((out / name / "train_state.json").exists() for name in step_dirs)
    latest = (out / "latest").read_text().strip()
    assert latest in step_dirs and f".{latest}" not in caught
    saved_step = int(latest.removeprefix("step-"))
    # the previous checkpoint loads (its checksums verified) and trains on, here on one rank
    done = subprocess.run(
        [sys.executable, "-m", "zellige.train", "--config", "tiny-cpu", "--loader-workers", "0"]
        + ["--resume", str(out), "--steps", str(saved_step + 1)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {out / latest} at step {saved_step}; saved on 2 ranks" in done.stderr
    assert "resharded to 1" in done.stderr


def test_bad_input_is_one_line_from_one_rank_before_training(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    started = time.monotonic()
    done = subprocess.run(
        _command(2, "--steps", "3", "--out", str(not_a_dir)),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=BOUND_S,
    )
    assert done.returncode != 0
    errors = _errors(done.stderr)
    assert errors == [f"zellige.train: error: --out {not_a_dir}: exists and is not a directory"]
    assert "step 1/" not in done.stderr  # failed before training
    assert _no_rank_traceback(done.stderr), done.stderr[-3000:]
    assert time.monotonic() - started < 60
