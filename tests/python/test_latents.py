"""Latent datasets (zellige.data.latents, zellige.data.encode): the writer stores the VAE's
normalised encoding and the text encoder's embeddings (oracle: the encoders called directly),
the reader's sampling covers every bucket each epoch and depends only on (seed, step, rank),
every corruption is one clear error naming the file and sample, the model check refuses what
cannot train, and the `zellige encode` / `zellige train` commands fail in one line."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from zellige.cli import main as cli_main
from zellige.data import StepDataset
from zellige.data.encode import (
    RawSample,
    encode_pixels,
    media_samples,
    read_media,
    write_latent_dataset,
)
from zellige.data.latents import (
    LatentDataError,
    open_latent_dataset,
    patchify,
    token_grid,
)
from zellige.model import model_preset

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "latent_models.py"
_spec = importlib.util.spec_from_file_location("latent_models", FIXTURE)
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

TINY = model_preset("tiny-cpu")  # 4 latent channels, text width 32, patch 1 x 2 x 2
SEED = 7


def _raw_samples() -> list[RawSample]:
    """7 square images, 3 wide images and 2 clips of 17 frames (5 latent frames)."""
    samples = [
        RawSample(pixels=models.clip(1, 64, 64, i)[:, 0], caption=f"square {i}") for i in range(7)
    ]
    samples += [
        RawSample(pixels=models.clip(1, 64, 128, 10 + i)[:, 0], caption=f"wide image {i}")
        for i in range(3)
    ]
    samples += [
        RawSample(pixels=models.clip(17, 64, 96, 20 + i), caption=f"clip {i} of the sea")
        for i in range(2)
    ]
    return samples


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("latents") / "data"
    vae, text_encoder = models.build_pool()
    dataset = write_latent_dataset(
        _raw_samples(), vae=vae, text_encoder=text_encoder, out=out, shard_size=5
    )
    return {"dataset": dataset, "vae": vae, "text_encoder": text_encoder, "path": out}


def _copy(written: dict, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(written["path"], copy)
    return copy


def test_patchify_matches_a_loop_over_patches() -> None:
    latents_CTHW = torch.randn(3, 4, 6, 8)
    pt, p = 2, 2
    tokens = patchify(latents_CTHW, pt, p)
    want = []
    for t in range(0, 4, pt):
        for h in range(0, 6, p):
            for w in range(0, 8, p):
                want.append(latents_CTHW[:, t : t + pt, h : h + p, w : w + p].reshape(-1))
    assert torch.equal(tokens, torch.stack(want))
    assert token_grid((4, 6, 8), pt, p) == (2, 3, 4)


def test_stored_samples_are_the_encoders_outputs(written) -> None:
    dataset, vae, text_encoder = written["dataset"], written["vae"], written["text_encoder"]
    raw = _raw_samples()
    assert len(dataset) == len(raw) and len(dataset.shards) == 3  # 5 + 5 + 2
    for index, sample in enumerate(raw):
        latents, text = dataset.read(index)
        pixels = sample.pixels if sample.pixels.dim() == 4 else sample.pixels[:, None]
        want = vae.encode(pixels[None]).latent_dist.mode()[0]
        assert torch.equal(latents, want)
        assert torch.equal(text, text_encoder(sample.caption))
    grids = Counter(record.grid_thw for record in dataset.records)
    assert grids == {(1, 8, 8): 7, (1, 8, 16): 3, (5, 8, 12): 2}
    # micro-batches of about the largest sample's latent positions (480)
    assert dataset.bucket_batch == {"1x8x16": 3, "1x8x8": 7, "5x8x12": 1}
    assert dataset.latent_channels == 4 and dataset.text_dim == 32
    dataset.verify()


def test_an_epoch_draws_every_sample_in_same_bucket_micro_batches(written) -> None:
    dataset = written["dataset"]
    # per epoch: 1 batch of 7 squares, 1 of 3 wide images, 2 clips alone
    assert dataset.micro_batches_per_epoch == 4
    data_ranks = 2
    drawn = [
        dataset.micro_batch(step, rank, data_ranks=data_ranks, seed=SEED)
        for step in range(2)
        for rank in range(data_ranks)
    ]
    assert sorted(i for batch in drawn for i in batch) == list(range(len(dataset)))
    for batch in drawn:
        buckets = {dataset.records[i].bucket for i in batch}
        assert len(buckets) == 1 and len(batch) == dataset.bucket_batch[buckets.pop()]
    # the next epoch is another order of the same micro-batch shapes
    later = [dataset.micro_batch(2, rank, data_ranks=data_ranks, seed=SEED) for rank in (0, 1)]
    later += [dataset.micro_batch(3, rank, data_ranks=data_ranks, seed=SEED) for rank in (0, 1)]
    assert sorted(i for batch in later for i in batch) == list(range(len(dataset)))


def test_draws_depend_on_seed_step_and_rank_only(written) -> None:
    """A resumed run (a fresh reader asked for later steps first) draws what the first did."""
    first = written["dataset"]
    fresh = open_latent_dataset(written["path"])
    steps = range(12)
    want = {
        (s, r): first.micro_batch(s, r, data_ranks=3, seed=SEED) for s in steps for r in (0, 1, 2)
    }
    for s in reversed(steps):
        for r in (2, 1, 0):
            assert fresh.micro_batch(s, r, data_ranks=3, seed=SEED) == want[(s, r)]
    other = [first.micro_batch(s, 0, data_ranks=3, seed=SEED + 1) for s in steps]
    assert other != [want[(s, 0)] for s in steps]
    with pytest.raises(ValueError, match="loader rank 3 of 3"):
        first.micro_batch(0, 3, data_ranks=3, seed=SEED)


def test_batch_and_balancer_samples_follow_the_draws(written) -> None:
    dataset = written["dataset"]
    batch = dataset.batch(5, data_ranks=2, seed=SEED, patch=(1, 2))
    drawn = dataset.step_samples(5, data_ranks=2, seed=SEED)
    assert [s.source_rank for s in batch.sequences] == [rank for rank, _ in drawn]
    for sequence, (_, index) in zip(batch.sequences, drawn, strict=True):
        record = dataset.records[index]
        assert (sequence.grid_t, sequence.grid_h, sequence.grid_w) == token_grid(
            record.grid_thw, 1, 2
        )
        assert sequence.text_tokens == record.text_tokens
        assert sequence.kind == ("video" if record.grid_thw[0] > 1 else "image")
    for rank in (0, 1):
        samples = dataset.samples(5, rank, data_ranks=2, seed=SEED, patch=(1, 2))
        indices = dataset.micro_batch(5, rank, data_ranks=2, seed=SEED)
        assert len(samples) == len(indices)
        for sample, index in zip(samples, indices, strict=True):
            latents, text = dataset.read(index)
            assert torch.equal(sample.tokens["latents"], patchify(latents, 1, 2))
            assert torch.equal(sample.text["text"], text)
            assert sample.tokens["latents"].shape == (sample.num_tokens, TINY.token_channels)


def test_step_dataset_trains_on_the_stored_latents(written) -> None:
    """The trainer's source: each sequence's rectified-flow pair is built on its stored latents
    (clean = noisy - t * velocity), text as stored; the batch is the reader's."""
    dataset = written["dataset"]
    steps = StepDataset(
        model=TINY, recipe="tiny", planner="dp-tokens", rank=0, num_ranks=1, gpus_per_node=1,
        seed=SEED, data_dir=str(written["path"]),
    )  # fmt: skip
    data = steps[3]
    assert data.error is None
    indices = [i for _, i in dataset.step_samples(3, data_ranks=1, seed=SEED)]
    clean = torch.cat([patchify(dataset.read(i)[0], 1, 2) for i in indices])
    text = torch.cat([dataset.read(i)[1] for i in indices])
    recovered = data.source_noisy_TC - data.source_timestep_T[:, None] * data.source_velocity_TC
    torch.testing.assert_close(recovered, clean, rtol=0, atol=1e-5)
    assert torch.equal(data.source_text_XE, text)
    assert data.total_tokens == clean.shape[0]


def test_a_corrupt_sample_becomes_the_steps_error(written, tmp_path) -> None:
    """Raised by every rank together when the step loads (never skipped)."""
    copy = _copy(written, tmp_path)
    _flip_last_data_byte(copy / "shard-00000.safetensors")
    steps = StepDataset(
        model=TINY, recipe="tiny", planner="dp-tokens", rank=0, num_ranks=1, gpus_per_node=1,
        seed=SEED, data_dir=str(copy),
    )  # fmt: skip
    errors = [steps[step].error for step in range(4)]  # one epoch: every sample once
    bad = [e for e in errors if e is not None]
    assert len(bad) == 1 and "shard-00000.safetensors, sample 4" in bad[0], errors
    assert bad[0].startswith("rank 0: latent dataset ") and "SHA-256" in bad[0]


def _flip_last_data_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def _break(copy: Path, how: str) -> None:
    shard = copy / "shard-00001.safetensors"
    manifest = copy / "manifest.json"
    if how == "flipped byte":
        _flip_last_data_byte(shard)
    elif how == "missing shard":
        shard.unlink()
    elif how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-7])
    elif how == "bad header":
        data = bytearray(shard.read_bytes())
        data[8:16] = b"notjson!"
        shard.write_bytes(bytes(data))
    elif how == "no manifest":
        manifest.unlink()
    elif how == "manifest version":
        text = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**text, "version": 99}))
    elif how == "manifest sample":
        text = json.loads(manifest.read_text())
        text["samples"][3]["grid"] = [1, 0, 8]
        manifest.write_text(json.dumps(text))
    elif how == "manifest not json":
        manifest.write_text("{")


BROKEN = {
    # how -> (fails at open?, what the message says)
    "flipped byte": (
        False,
        "shard-00001.safetensors, sample 9: its bytes differ from the manifest",
    ),
    "bad header": (False, "shard-00001.safetensors, sample 5: cannot read"),
    "missing shard": (True, "shard shard-00001.safetensors is missing"),
    "truncated shard": (True, "shard-00001.safetensors has"),
    "no manifest": (True, "no manifest.json"),
    "manifest version": (True, "version 99: this reader reads version 1"),
    "manifest sample": (True, "sample 3: shard, key, grid"),
    "manifest not json": (True, "manifest.json: cannot read"),
}


@pytest.mark.parametrize("how", list(BROKEN))
def test_every_corruption_is_one_clear_error(written, tmp_path, how) -> None:
    copy = _copy(written, tmp_path)
    _break(copy, how)
    at_open, message = BROKEN[how]
    if at_open:
        with pytest.raises(LatentDataError, match=message.replace(".", r"\.")) as error:
            open_latent_dataset(copy)
    else:
        dataset = open_latent_dataset(copy)
        if how == "flipped byte":  # the shard's last bytes are its last sample's text
            for index in (5, 6, 7, 8):
                dataset.read(index)
        with pytest.raises(LatentDataError, match=message.replace(".", r"\.")) as error:
            dataset.read(9 if how == "flipped byte" else 5)
        with pytest.raises(LatentDataError, match="differs from the manifest's SHA-256"):
            dataset.verify()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"latent_channels": 16}, "holds 4-channel latents, model tiny-cpu has latent_channels 16"),
        ({"text_dim": 64}, "holds 32-wide text embeddings, model tiny-cpu has text_dim 64"),
        ({"patch_t": 2}, r"sample 0's latent grid \[1, 8, 8\] .* patch \[2, 2, 2\]"),
    ],
    ids=["channels", "text width", "patch"],
)
def test_a_model_that_cannot_train_on_the_latents_is_refused(written, change, message) -> None:
    model = dataclasses.replace(TINY, **change)
    with pytest.raises(LatentDataError, match=message):
        written["dataset"].check_model(model)
    written["dataset"].check_model(TINY)


def test_writer_input_errors(tmp_path) -> None:
    vae, text_encoder = models.build_pool()
    image = RawSample(pixels=models.clip(1, 64, 64, 0)[:, 0], caption="x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "file").write_text("")
    with pytest.raises(ValueError, match="exists and is not an empty directory"):
        write_latent_dataset([image], vae=vae, text_encoder=text_encoder, out=tmp_path / "full")
    with pytest.raises(ValueError, match="shard_size must be a positive integer"):
        write_latent_dataset(
            [image], vae=vae, text_encoder=text_encoder, out=tmp_path / "a", shard_size=0
        )
    with pytest.raises(ValueError, match=r"sample 0: the text encoder returned shape \[2, 1, 32\]"):
        write_latent_dataset(
            [image], vae=vae, text_encoder=lambda caption: torch.zeros(2, 1, 32), out=tmp_path / "b"
        )
    with pytest.raises(ValueError, match="no samples to encode"):
        write_latent_dataset([], vae=vae, text_encoder=text_encoder, out=tmp_path / "c")
    image_vae = models.PoolVAE(video=False)
    clip = RawSample(pixels=models.clip(5, 64, 64, 0), caption="x")
    with pytest.raises(ValueError, match="sample 0: a clip of 5 frames needs a video VAE"):
        write_latent_dataset([clip], vae=image_vae, text_encoder=text_encoder, out=tmp_path / "d")


def _media(root: Path) -> Path:
    """Two PNG images and an animated GIF clip of 9 frames, each with its caption file."""
    from PIL import Image

    root.mkdir()
    for number, (height, width) in enumerate([(64, 64), (64, 128)]):
        pixels = ((models.clip(1, height, width, number)[:, 0] + 1) * 127.5).round().byte()
        Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(root / f"image{number}.png")
        (root / f"image{number}.txt").write_text(f"picture number {number}\n")
    frames = ((models.clip(9, 64, 64, 5) + 1) * 127.5).round().byte().permute(1, 2, 3, 0)
    images = [Image.fromarray(frame.numpy()) for frame in frames]
    images[0].save(root / "clip.gif", save_all=True, append_images=images[1:], duration=40)
    (root / "clip.txt").write_text("a moving pattern")
    return root


def test_media_files_are_read_with_their_captions(tmp_path) -> None:
    root = _media(tmp_path / "media")
    samples = media_samples([root])
    assert [Path(s.pixels).name for s in samples] == ["clip.gif", "image0.png", "image1.png"]
    assert [s.caption for s in samples] == [
        "a moving pattern",
        "picture number 0",
        "picture number 1",
    ]
    assert read_media(root / "image1.png").shape == (3, 64, 128)
    clip = read_media(root / "clip.gif")
    assert clip.shape == (3, 9, 64, 64) and -1 <= clip.min() and clip.max() <= 1
    (root / "image0.txt").unlink()
    with pytest.raises(ValueError, match="image0.png: no caption file image0.txt beside it"):
        media_samples([root])
    with pytest.raises(ValueError, match="not an image or video file"):
        read_media(root / "clip.txt")


def test_encode_command_writes_a_dataset_from_files(tmp_path, capsys) -> None:
    root = _media(tmp_path / "media")
    out = tmp_path / "data"
    status = cli_main(
        [
            "encode",
            str(root),
            "--models",
            f"{FIXTURE}:build_pool",
            "--out",
            str(out),
            "--shard-size",
            "2",
        ]
    )
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert captured.out.startswith(f"wrote 3 samples in 2 shards to {out}: 4-channel latents")
    dataset = open_latent_dataset(out)
    assert sorted(r.grid_thw for r in dataset.records) == [(1, 8, 8), (1, 8, 16), (3, 8, 8)]
    vae, text_encoder = models.build_pool()
    want = encode_pixels(vae, read_media(root / "clip.gif"), video_vae=True)
    assert torch.equal(dataset.read(0)[0], want)
    assert torch.equal(dataset.read(0)[1], text_encoder("a moving pattern"))


@pytest.mark.parametrize(
    "models_flag, message",
    [
        ("nocolon", "expected MODULE:CALLABLE"),
        ("zellige_no_such_module:build", "cannot import zellige_no_such_module"),
        (f"{FIXTURE}:nothing", "has no nothing"),
        (f"{FIXTURE}:TEXT_DIM", "not callable"),
    ],
    ids=["form", "module", "attribute", "not callable"],
)
def test_encode_command_errors_are_one_line(tmp_path, capsys, models_flag, message) -> None:
    root = _media(tmp_path / "media")
    status = cli_main(["encode", str(root), "--models", models_flag, "--out", str(tmp_path / "o")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("zellige: error: --models")
    assert message in lines[0]


def _one_error_line(capsys, argv: list[str]) -> str:
    status = cli_main(argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert status == 2 and len(lines) == 1, captured.err
    assert captured.out == ""
    return lines[0]


def test_launcher_checks_the_run_before_starting_processes(tmp_path, capsys, written) -> None:
    """`zellige train` refuses bad input as the trainer would, with no process started."""
    line = _one_error_line(
        capsys,
        ["train", "--nproc", "2", "--config", "tiny-cpu", "--steps", "2", "--resume", "missing/"],
    )
    assert line == "zellige: error: --resume missing: no such directory"
    line = _one_error_line(
        capsys, ["train", "--nproc", "2", "--config", "tiny-cpu", "--stepz", "2"]
    )
    assert line.startswith("zellige: error: unrecognized arguments: --stepz 2")
    line = _one_error_line(capsys, ["train", "--nproc", "3", "--config", "tiny-cpu"])
    assert "gpus_per_node 2 does not divide the 3 ranks" in line
    config = tmp_path / "run.toml"
    config.write_text('config = "tiny-cpu"\n[model]\npreset = "tiny-cpu"\ntext_dim = 64\n')
    line = _one_error_line(
        capsys,
        ["train", "--nproc", "2", "--config-file", str(config), "--data", str(written["path"])],
    )
    assert "holds 32-wide text embeddings, model tiny-cpu has text_dim 64" in line
    line = _one_error_line(
        capsys, ["train", "--nproc", "2", "--config", "tiny-cpu", "--data", str(tmp_path / "none")]
    )
    assert line.endswith("none: not a directory")
    line = _one_error_line(
        capsys, ["train", "--nproc", "2", "--nnodes", "2", "--config", "tiny-cpu"]
    )
    assert "--nnodes 2: pass --master-addr" in line
    # other commands still refuse arguments they do not know
    line = _one_error_line(capsys, ["encode", "x", "--models", "a:b", "--out", "o", "--steps", "2"])
    assert line.startswith("zellige: error: unrecognized arguments: --steps 2")


def test_trainer_refuses_a_dataset_of_another_latent_width(tmp_path, written) -> None:
    """zellige.train's own check (the launcher's is the same function)."""
    from zellige.train.config import get_config
    from zellige.train.loop import preflight

    config = get_config("tiny-cpu").with_fields(
        model=dataclasses.replace(TINY, latent_channels=8),
        data_dir=str(written["path"]),
    )
    with pytest.raises(
        ValueError, match="holds 4-channel latents, model tiny-cpu has latent_channels 8"
    ):
        preflight(config, num_ranks=2)


def test_diffusers_vaes_are_normalised_as_their_configs_say(tmp_path) -> None:
    pytest.importorskip("diffusers")
    torch.manual_seed(0)
    wan, image_vae = models.wan_vae(), models.image_vae()
    clip = models.clip(9, 64, 64, 3)
    image = models.clip(1, 64, 64, 4)[:, 0]
    text_encoder = models.ByteTextEncoder()
    dataset = write_latent_dataset(
        [RawSample(pixels=clip, caption="a clip"), RawSample(pixels=image, caption="an image")],
        vae=wan,
        text_encoder=text_encoder,
        out=tmp_path / "wan",
    )
    mean = torch.tensor(wan.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(wan.config.latents_std).view(-1, 1, 1, 1)
    with torch.no_grad():
        z_clip = wan.encode(clip[None]).latent_dist.mode()[0]
        z_image = wan.encode(image[None, :, None]).latent_dist.mode()[0]
    assert torch.equal(dataset.read(0)[0], (z_clip - mean) / std)
    assert torch.equal(dataset.read(1)[0], (z_image - mean) / std)
    assert dataset.records[0].grid_thw == (3, 8, 8) and dataset.records[1].grid_thw == (1, 8, 8)
    assert dataset.about["latent_normalisation"] == "(z - latents_mean) / latents_std"

    stored = write_latent_dataset(
        [RawSample(pixels=image, caption="an image")],
        vae=image_vae,
        text_encoder=text_encoder,
        out=tmp_path / "kl",
        dtype="bfloat16",
    )
    with torch.no_grad():
        z = image_vae.encode(image[None]).latent_dist.mode()[0][:, None]
    scale = image_vae.config.scaling_factor
    assert torch.equal(stored.read(0)[0], (z * scale).to(torch.bfloat16))
    assert stored.read(0)[1].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="a clip of 9 frames needs a video VAE; AutoencoderKL"):
        write_latent_dataset(
            [RawSample(pixels=clip, caption="")], vae=image_vae, text_encoder=text_encoder,
            out=tmp_path / "kl-clip",
        )  # fmt: skip
    assert np.isclose(scale, 0.18215)


def test_a_global_batch_from_a_latent_dataset_is_refused(tmp_path, written) -> None:
    """The trainer's config check (before any process starts) and StepDataset refuse it alike."""
    from zellige.global_batch import parse_global_batch_size
    from zellige.train.config import get_config
    from zellige.train.loop import preflight

    message = "a global batch from a latent dataset is not supported"
    config = get_config("tiny-cpu").with_fields(global_batch="8", data_dir=str(written["path"]))
    with pytest.raises(ValueError, match=message):
        preflight(config, num_ranks=1)
    with pytest.raises(ValueError, match=message):
        StepDataset(
            model=TINY, recipe="tiny", planner="zellige", rank=0, num_ranks=1, gpus_per_node=1,
            seed=SEED, data_dir=str(written["path"]), global_batch=parse_global_batch_size("8"),
        )  # fmt: skip
