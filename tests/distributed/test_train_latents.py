"""Training from a latent dataset on 2 processes, started by the launcher (`zellige train`): a
dataset written by `zellige encode` from generated images and clips through a tiny Wan VAE,
3 float64 steps, a run resumed after step 1 that matches the uninterrupted one exactly, a
corrupt shard that stops the run with one line, and a bad --resume refused in one line before
any process starts (each run under a timeout, so a hang fails the test)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zellige.data.latents import open_latent_dataset

TIMEOUT_S = 300
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "latent_models.py"


def _zellige(*args: str) -> subprocess.CompletedProcess:
    # zellige comes from the environment (installed, or PYTHONPATH=src when developing)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONFAULTHANDLER="1")
    command = [sys.executable, "-m", "zellige.cli", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


def _media(root: Path) -> Path:
    """Images (64x64 and 64x128 PNG) and clips (17-frame GIFs), each with a caption file."""
    from PIL import Image

    spec = importlib.util.spec_from_file_location("latent_models", FIXTURE)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    root.mkdir()
    shapes = [(1, 64, 64)] * 5 + [(1, 64, 128)] * 2 + [(17, 64, 96)] * 3
    for number, (frames, height, width) in enumerate(shapes):
        pixels = ((models.clip(frames, height, width, number) + 1) * 127.5).round().byte()
        images = [Image.fromarray(frame.numpy()) for frame in pixels.permute(1, 2, 3, 0)]
        name = f"sample{number:02d}"
        if frames == 1:
            images[0].save(root / f"{name}.png")
        else:
            images[0].save(root / f"{name}.gif", save_all=True, append_images=images[1:])
        (root / f"{name}.txt").write_text(f"caption of sample {number}" + " more" * number)
    return root


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    pytest.importorskip("diffusers")
    root = tmp_path_factory.mktemp("latents")
    out = root / "data"
    done = _zellige(
        "encode", str(_media(root / "media")), "--models", f"{FIXTURE}:build", "--out", str(out),
        "--shard-size", "4",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"wrote 10 samples in 3 shards to {out}"), done.stdout
    return out


def _train(tmp_path: Path, name: str, *args: str) -> list[dict]:
    metrics = tmp_path / f"{name}.jsonl"
    done = _zellige(
        "train", "--nproc", "2", "--config", "tiny-cpu", "--dtype", "float64", "--metrics",
        str(metrics), *args,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "OMP_NUM_THREADS" not in done.stderr
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def test_training_on_latents_resumes_exactly(dataset: Path, tmp_path: Path) -> None:
    data = ("--data", str(dataset), "--planner", "static-cp:2")
    out = tmp_path / "ckpt"
    straight = _train(
        tmp_path, "straight", "--steps", "3", "--checkpoint-every", "1", "--out", str(out), *data
    )
    resumed = _train(tmp_path, "resumed", "--steps", "3", "--resume", str(out / "step-1"), *data)
    assert [r["step"] for r in straight] == [1, 2, 3]
    assert [r["step"] for r in resumed] == [2, 3]
    for key in ("loss", "grad_norm", "tokens"):
        assert [r[key] for r in resumed] == [r[key] for r in straight[1:]], key
    # the steps' batches are the reader's draws (oracle: the manifest alone)
    reader = open_latent_dataset(dataset)
    for record in straight:
        batch = reader.batch(record["step"] - 1, data_ranks=2, seed=0, patch=(1, 2))
        assert record["tokens"] == sum(s.num_tokens for s in batch.sequences)
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in straight)


def test_a_corrupt_shard_stops_the_run_with_one_line(dataset: Path, tmp_path: Path) -> None:
    """The sample that rank 1 draws at step 2 is damaged: step 1 trains, step 2 stops every
    rank with the same error, printed once."""
    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    reader = open_latent_dataset(copy)
    index = reader.micro_batch(1, 1, data_ranks=2, seed=0)[0]
    record = reader.records[index]
    shard = copy / reader.shards[record.shard].file
    latents, _ = reader.read(index)
    # flip one byte inside that sample's latents (found by their bytes in the file)
    raw = bytearray(shard.read_bytes())
    start = bytes(raw).find(latents.contiguous().view(torch.uint8).numpy().tobytes())
    assert start > 0
    raw[start + 3] ^= 0x10
    shard.write_bytes(bytes(raw))
    done = _zellige(
        "train", "--nproc", "2", "--config", "tiny-cpu", "--steps", "3", "--data", str(copy),
        "--metrics", str(tmp_path / "m.jsonl"), "--no-metrics-one-step-late",
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    want = (
        f"zellige.train: error: rank 1: latent dataset {copy}: {shard.name}, sample {index}: its "
        "bytes differ from the manifest's SHA-256 (the shard is corrupt)"
    )
    assert errors == [want], done.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps == [1]


def test_launcher_refuses_a_missing_checkpoint_in_one_line(tmp_path: Path) -> None:
    done = _zellige(
        "train", "--nproc", "2", "--config", "tiny-cpu", "--steps", "2", "--resume",
        str(tmp_path / "missing") + "/",
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"zellige: error: --resume {tmp_path / 'missing'}: no such directory"
    ]
