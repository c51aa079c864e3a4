"""Latent datasets on disk: pre-computed VAE latents and text embeddings in shards, a manifest
with each sample's metadata and digests, and the reader the trainer and the Balancer draw from.

Layout of a dataset directory (docs/formats.md, "Latent dataset"):

    manifest.json            format, version, latent channels, text width, buckets, shards, samples
    shard-00000.safetensors  per sample k of the shard: "k.latents" [C, t, h, w], "k.text" [L, E]

The manifest is written last, so a directory without one is an unfinished write. Every sample's
bytes carry a SHA-256 in the manifest, checked on each read; every shard's size is checked when
the dataset opens (a missing or truncated shard fails before training) and its SHA-256 by
verify(). A failed check raises LatentDataError; no sample is ever skipped.

Sampling: each bucket holds samples of one shape class and a micro-batch size (samples a loader
rank draws at once). An epoch shuffles each bucket (seed, epoch, bucket), cuts it into micro-batches
(the last one filled from the bucket's start) and shuffles the micro-batches of all buckets
(seed, epoch). Loader rank r of R draws micro-batch step * R + r: a function of (seed, step, rank),
so a resumed run continues at the same position without stored state, and every rank knows the
whole step's batch from the manifest alone.

Legend: C latent channels, t/h/w latent frames, height and width (VAE grid, before patchify),
L text tokens, E text-encoder width, T visual tokens (after patchify), K token channels.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from zellige import _core

if TYPE_CHECKING:
    from collections.abc import Sequence

    from zellige.balancer import Sample
    from zellige.data.synthetic import SequenceSample, SourceTensors
    from zellige.model import DiTConfig

FORMAT = "zellige-latents"
VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_MANIFEST_BYTES = 1 << 30  # a manifest of ~10M samples; a bigger file is not ours
_OPEN_SHARDS = 8  # open shard handles kept per process (the reader draws across shards)
_EPOCHS_KEPT = 2  # epoch orders kept per process (a step may straddle two epochs)


class LatentDataError(ValueError):
    """A latent dataset that cannot be read as written: a missing, truncated or corrupt shard or
    manifest, or one that does not fit the model. The message names the file and the sample."""


@dataclass(frozen=True, slots=True)
class ShardInfo:
    file: str  # name inside the dataset directory
    num_bytes: int
    sha256: str  # of the whole file (verify())


@dataclass(frozen=True, slots=True)
class LatentRecord:
    """One sample's metadata, as the manifest holds it."""

    shard: int  # index into LatentDataset.shards
    key: int  # the sample's index inside its shard (tensor names "key.latents", "key.text")
    grid_thw: tuple[int, int, int]  # latent frames, height, width (before patchify)
    text_tokens: int  # L
    bucket: str
    sha256: str  # of the latents' bytes, then the text's, as stored

    @property
    def latent_positions(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


def patchify(latents_CTHW: Tensor, patch_t: int, patch_hw: int) -> Tensor:
    """Latent tokens [T, K] in (t, h, w) raster order of the token grid; K = C x patch_t x
    patch_hw^2 with the channel outermost (a patch-embedding Conv3d's weight order)."""
    c, t, h, w = latents_CTHW.shape
    pt, p = patch_t, patch_hw
    grid = latents_CTHW.reshape(c, t // pt, pt, h // p, p, w // p, p)
    num_tokens = (t // pt) * (h // p) * (w // p)
    return grid.permute(1, 3, 5, 0, 2, 4, 6).reshape(num_tokens, c * pt * p * p)


def token_grid(grid_thw: tuple[int, int, int], patch_t: int, patch_hw: int) -> tuple[int, int, int]:
    t, h, w = grid_thw
    return t // patch_t, h // patch_hw, w // patch_hw


def sample_digest(latents: Tensor, text: Tensor) -> str:
    """SHA-256 of a sample's stored bytes: its latents, then its text embeddings."""
    digest = hashlib.sha256()
    for tensor in (latents, text):
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class LatentDataset:
    """A latent dataset directory, opened read-only (open_latent_dataset).

    Example:
        >>> data = open_latent_dataset("latents/")
        >>> data.check_model(model_config)          # channels, text width, patch sizes
        >>> indices = data.micro_batch(step, loader_rank, data_ranks=8, seed=0)
        >>> latents_CTHW, text_LE = data.read(indices[0])
        >>> samples = data.samples(step, rank, data_ranks=8, seed=0, patch=(1, 2))  # Balancer
    """

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.latent_channels: int = manifest["latent_channels"]
        self.text_dim: int = manifest["text_dim"]
        self.dtype: str = manifest["dtype"]
        self.about: dict[str, str] = manifest.get("about", {})
        self.bucket_batch: dict[str, int] = dict(sorted(manifest["buckets"].items()))
        self.shards = [ShardInfo(**shard) for shard in manifest["shards"]]
        self.records = [
            LatentRecord(
                shard=s["shard"],
                key=s["key"],
                grid_thw=tuple(s["grid"]),
                text_tokens=s["text_tokens"],
                bucket=s["bucket"],
                sha256=s["sha256"],
            )
            for s in manifest["samples"]
        ]
        members: dict[str, list[int]] = {name: [] for name in self.bucket_batch}
        for index, record in enumerate(self.records):
            members[record.bucket].append(index)
        self._members = {name: np.asarray(m, dtype=np.int64) for name, m in members.items() if m}
        # micro-batches per epoch: each bucket's samples in batches, the last one filled up
        self.micro_batches_per_epoch = sum(
            math.ceil(len(m) / self.bucket_batch[name]) for name, m in self._members.items()
        )
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._epochs: OrderedDict[tuple[int, int], list[np.ndarray]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.records)

    def __getstate__(self) -> dict:
        # open shard handles do not pickle: a loader worker opens its own
        return {**self.__dict__, "_handles": OrderedDict(), "_epochs": OrderedDict()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)

    def check_model(self, model: DiTConfig) -> None:
        """LatentDataError unless the model can train on these latents: the same latent
        channels and text width, and every latent grid divisible by the model's patch."""
        where = f"latent dataset {self.path}"
        if self.latent_channels != model.latent_channels:
            raise LatentDataError(
                f"{where} holds {self.latent_channels}-channel latents, model {model.name} has "
                f"latent_channels {model.latent_channels}: encode with the model's VAE, or set "
                "model.latent_channels"
            )
        if self.text_dim != model.text_dim:
            raise LatentDataError(
                f"{where} holds {self.text_dim}-wide text embeddings, model {model.name} has "
                f"text_dim {model.text_dim}: encode with the model's text encoder, or set "
                "model.text_dim"
            )
        patch = (model.patch_t, model.patch_hw, model.patch_hw)
        for index, record in enumerate(self.records):
            if any(n % p for n, p in zip(record.grid_thw, patch, strict=True)):
                raise LatentDataError(
                    f"{where}: sample {index}'s latent grid {list(record.grid_thw)} (frames, "
                    f"height, width) is not divisible by model {model.name}'s patch "
                    f"{list(patch)}"
                )

    def verify(self) -> None:
        """Hashes every shard file against the manifest (reads the whole dataset)."""
        for shard in self.shards:
            path = self.path / shard.file
            if file_digest(path) != shard.sha256:
                raise LatentDataError(
                    f"latent dataset {self.path}: {shard.file} differs from the manifest's "
                    "SHA-256 (the file is corrupt or was replaced)"
                )

    # --- sampling ---------------------------------------------------------------------------------

    def micro_batch(self, step: int, loader_rank: int, *, data_ranks: int, seed: int) -> list[int]:
        """The sample indices loader rank `loader_rank` of `data_ranks` draws at `step`."""
        if not (0 <= loader_rank < data_ranks and step >= 0):
            raise ValueError(
                f"loader rank {loader_rank} of {data_ranks} at step {step}: need a step >= 0 "
                "and a rank in [0, data_ranks)"
            )
        position = step * data_ranks + loader_rank
        epoch, within = divmod(position, self.micro_batches_per_epoch)
        return self._epoch(seed, epoch)[within].tolist()

    def _epoch(self, seed: int, epoch: int) -> list[np.ndarray]:
        key = (seed, epoch)
        if key not in self._epochs:
            batches = []
            for number, (name, members) in enumerate(self._members.items()):
                size = self.bucket_batch[name]
                count = math.ceil(len(members) / size)
                order = np.random.default_rng([seed, epoch, number, 0xB0C]).permutation(members)
                batches += np.split(np.resize(order, count * size), count)
            order = np.random.default_rng([seed, epoch]).permutation(len(batches))
            self._epochs[key] = [batches[i] for i in order]
            while len(self._epochs) > _EPOCHS_KEPT:
                self._epochs.popitem(last=False)
        return self._epochs[key]

    def step_samples(self, step: int, *, data_ranks: int, seed: int) -> list[tuple[int, int]]:
        """(loader rank, sample index) of every sequence of the step, in batch order."""
        return [
            (rank, index)
            for rank in range(data_ranks)
            for index in self.micro_batch(step, rank, data_ranks=data_ranks, seed=seed)
        ]

    def batch(
        self, step: int, *, data_ranks: int, seed: int, patch: tuple[int, int]
    ) -> _core.Batch:
        """The step's Batch (token grids after a (patch_t, patch_hw) patchify; sequence i's
        source_rank is the loader rank that drew it)."""
        from zellige.workload import batch_from_dict

        sequences = []
        for number, (rank, index) in enumerate(
            self.step_samples(step, data_ranks=data_ranks, seed=seed)
        ):
            record = self.records[index]
            grid = token_grid(record.grid_thw, *patch)
            sequences.append(
                {
                    "id": number,
                    "kind": "video" if record.grid_thw[0] > 1 else "image",
                    "num_tokens": grid[0] * grid[1] * grid[2],
                    "grid": list(grid),
                    "text_tokens": record.text_tokens,
                    "source_rank": rank,
                }
            )
        return batch_from_dict({"sequences": sequences}, num_ranks=data_ranks)

    def samples(
        self, step: int, rank: int, *, data_ranks: int, seed: int, patch: tuple[int, int]
    ) -> list[Sample]:
        """This loader rank's samples of the step for the Balancer: tokens["latents"] [T, K]
        (clean latents, patchified) and text["text"] [L, E], float32."""
        from zellige.balancer import Sample

        samples = []
        for index in self.micro_batch(step, rank, data_ranks=data_ranks, seed=seed):
            latents, text = self.read(index)
            record = self.records[index]
            samples.append(
                Sample(
                    grid_thw=token_grid(record.grid_thw, *patch),
                    text_tokens=record.text_tokens,
                    tokens={"latents": patchify(latents.float(), *patch)},
                    text={"text": text.float()},
                )
            )
        return samples

    # --- reading ----------------------------------------------------------------------------------

    def read(self, index: int) -> tuple[Tensor, Tensor]:
        """Sample `index`'s latents [C, t, h, w] and text [L, E] as stored, digest checked."""
        record = self.records[index]
        shard = self.shards[record.shard]
        where = f"latent dataset {self.path}: {shard.file}, sample {index}"
        try:
            handle = self._handle(record.shard)
            latents = handle.get_tensor(f"{record.key}.latents")
            text = handle.get_tensor(f"{record.key}.text")
        except LatentDataError:
            raise
        except Exception as error:  # safetensors' own errors, a vanished file, a bad header
            raise LatentDataError(f"{where}: cannot read ({_reason(error)})") from None
        want = ((self.latent_channels, *record.grid_thw), (record.text_tokens, self.text_dim))
        if (tuple(latents.shape), tuple(text.shape)) != want:
            raise LatentDataError(
                f"{where}: shapes {list(latents.shape)} and {list(text.shape)} differ from the "
                f"manifest's {list(want[0])} and {list(want[1])}"
            )
        if sample_digest(latents, text) != record.sha256:
            raise LatentDataError(
                f"{where}: its bytes differ from the manifest's SHA-256 (the shard is corrupt)"
            )
        return latents, text

    def _handle(self, shard_index: int):
        from safetensors import safe_open

        if shard_index in self._handles:
            self._handles.move_to_end(shard_index)
            return self._handles[shard_index]
        shard = self.shards[shard_index]
        path = self.path / shard.file
        _check_shard_file(self.path, shard)
        handle = safe_open(str(path), framework="pt")
        self._handles[shard_index] = handle
        while len(self._handles) > _OPEN_SHARDS:
            self._handles.popitem(last=False)
        return handle


def open_latent_dataset(path: str | Path) -> LatentDataset:
    """The dataset at `path`, its manifest checked and every shard present with its recorded
    size. Raises LatentDataError (a ValueError) with one line naming what is wrong."""
    root = Path(path)
    manifest_path = root / MANIFEST
    if not root.is_dir():
        raise LatentDataError(f"latent dataset {root}: not a directory")
    if not manifest_path.is_file():
        raise LatentDataError(
            f"latent dataset {root}: no {MANIFEST} (not a dataset written by zellige encode, or "
            "its write did not finish)"
        )
    try:
        if manifest_path.stat().st_size > MAX_MANIFEST_BYTES:
            raise LatentDataError(f"{manifest_path}: larger than {MAX_MANIFEST_BYTES:,} bytes")
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise LatentDataError(f"{manifest_path}: cannot read ({_reason(error)})") from None
    _check_manifest(manifest, manifest_path)
    dataset = LatentDataset(root, manifest)
    for shard in dataset.shards:
        _check_shard_file(root, shard)
    return dataset


def _check_shard_file(root: Path, shard: ShardInfo) -> None:
    path = root / shard.file
    try:
        size = path.stat().st_size
    except OSError as error:
        raise LatentDataError(
            f"latent dataset {root}: shard {shard.file} is missing ({_reason(error)})"
        ) from None
    if size != shard.num_bytes:
        raise LatentDataError(
            f"latent dataset {root}: shard {shard.file} has {size:,} bytes, the manifest says "
            f"{shard.num_bytes:,} (truncated or replaced)"
        )


def _reason(error: BaseException) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return " ".join(str(error).split())[:200] or type(error).__name__


def _check_manifest(manifest: Any, where: Path) -> None:
    """LatentDataError naming the first field of the manifest that is malformed."""

    def fail(text: str):
        raise LatentDataError(f"{where}: {text}")

    def integer(value: Any, low: int, high: int) -> bool:
        return type(value) is int and low <= value <= high

    if not isinstance(manifest, dict):
        fail("not a JSON object")
    if manifest.get("format") != FORMAT:
        fail(f"format must be {FORMAT!r}")
    if manifest.get("version") != VERSION:
        fail(f"version {manifest.get('version')!r}: this reader reads version {VERSION}")
    for key in ("latent_channels", "text_dim"):
        if not integer(manifest.get(key), 1, 1 << 16):
            fail(f"{key} must be an integer in [1, 65536]")
    if manifest.get("dtype") not in DTYPES:
        fail(f"dtype must be one of {', '.join(DTYPES)}")
    buckets = manifest.get("buckets")
    if not isinstance(buckets, dict) or not buckets:
        fail("buckets must be a nonempty object of bucket name -> micro-batch size")
    for name, size in buckets.items():
        if not integer(size, 1, 1 << 20):
            fail(f"bucket {name!r}: micro-batch size must be an integer in [1, 1048576]")
    shards = manifest.get("shards")
    if not isinstance(shards, list) or not shards:
        fail("shards must be a nonempty list")
    for number, shard in enumerate(shards):
        if (
            not isinstance(shard, dict)
            or set(shard) != {"file", "num_bytes", "sha256"}
            or not isinstance(shard["file"], str)
            or Path(shard["file"]).name != shard["file"]
            or shard["file"] in ("", ".", "..")
            or not integer(shard["num_bytes"], 1, 1 << 50)
            or not _is_sha256(shard["sha256"])
        ):
            fail(f"shard #{number} must be {{file (a name in the directory), num_bytes, sha256}}")
    samples = manifest.get("samples")
    if not isinstance(samples, list) or not samples:
        fail("samples must be a nonempty list")
    fields = {"shard", "key", "grid", "text_tokens", "bucket", "sha256"}
    for index, sample in enumerate(samples):
        if not isinstance(sample, dict) or set(sample) != fields:
            fail(f"sample {index} must have exactly {', '.join(sorted(fields))}")
        grid = sample["grid"]
        ok = (
            integer(sample["shard"], 0, len(shards) - 1)
            and integer(sample["key"], 0, 1 << 40)
            and isinstance(grid, list)
            and len(grid) == 3
            and all(integer(n, 1, _core.MAX_SEQUENCE_TOKENS) for n in grid)
            and integer(sample["text_tokens"], 0, _core.MAX_TEXT_TOKENS)
            and sample["bucket"] in buckets
            and _is_sha256(sample["sha256"])
        )
        if not ok:
            fail(
                f"sample {index}: shard, key, grid [t, h, w], text_tokens, bucket (one of the "
                "buckets) or sha256 malformed"
            )


def _is_sha256(value: Any) -> bool:
    return (
        isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
    )


# --- the trainer's sample source ------------------------------------------------------------------


class LatentSource:
    """The step pipeline's sample source for a latent dataset (StepDataset's counterpart of
    SyntheticLatents): the batch of each step from the dataset's sampling, and each sequence's
    rectified-flow example from its stored latents, with noise and flow time drawn from
    (seed, step, sequence id) as the synthetic source draws them."""

    def __init__(
        self, dataset: LatentDataset, model: DiTConfig, *, seed: int, data_ranks: int
    ) -> None:
        self.dataset = dataset
        self.patch = (model.patch_t, model.patch_hw)
        self.token_channels, self.text_dim = model.token_channels, model.text_dim
        self.seed = seed
        self.data_ranks = data_ranks
        self._drawn: tuple[int, list[tuple[int, int]]] | None = None  # a step's samples

    def batch(self, step: int) -> _core.Batch:
        return self.dataset.batch(
            step, data_ranks=self.data_ranks, seed=self.seed, patch=self.patch
        )

    def sample(
        self, *, step: int, sequence_id: int, grid_thw: tuple[int, int, int], text_tokens: int
    ) -> SequenceSample:
        from zellige.data.synthetic import SequenceSample, _mix, grid_positions

        if self._drawn is None or self._drawn[0] != step:
            drawn = self.dataset.step_samples(step, data_ranks=self.data_ranks, seed=self.seed)
            self._drawn = (step, drawn)
        index = self._drawn[1][sequence_id][1]
        latents, text = self.dataset.read(index)
        clean_TK = patchify(latents.float(), *self.patch)
        record = self.dataset.records[index]
        assert token_grid(record.grid_thw, *self.patch) == tuple(grid_thw)
        assert record.text_tokens == text_tokens
        generator = torch.Generator().manual_seed(_mix(self.seed, step, sequence_id))
        # logit-normal flow time, as in SD3-style rectified-flow training
        timestep = float(torch.sigmoid(torch.randn((), generator=generator)))
        noise_TK = torch.randn(clean_TK.shape, generator=generator)
        return SequenceSample(
            noisy_LC=(1 - timestep) * clean_TK + timestep * noise_TK,
            velocity_LC=noise_TK - clean_TK,
            positions_L3=grid_positions(*grid_thw),
            timestep=timestep,
            text_XE=text.float(),
        )

    def source_tensors(
        self, *, step: int, sequences: Sequence, text_dtype: torch.dtype = torch.float32
    ) -> SourceTensors:
        """The samples of `sequences` at `step`, concatenated in order (the form of
        SyntheticLatents.source_tensors), the text rows in `text_dtype`. Raises LatentDataError
        for a missing or corrupt shard."""
        from zellige.data.synthetic import SourceTensors

        samples = [
            self.sample(
                step=step,
                sequence_id=s.id,
                grid_thw=(s.grid_t, s.grid_h, s.grid_w),
                text_tokens=s.text_tokens,
            )
            for s in sequences
        ]

        def cat(parts: list[Tensor], width: int, dtype: torch.dtype = torch.float32) -> Tensor:
            return torch.cat(parts).to(dtype) if parts else torch.empty(0, width, dtype=dtype)

        times = torch.tensor([x.timestep for x in samples], dtype=torch.float32)

        def repeated(counts: list[int]) -> Tensor:
            return torch.repeat_interleave(times, torch.tensor(counts, dtype=torch.int64))

        text_tokens = [s.text_tokens for s in sequences]
        return SourceTensors(
            noisy_TC=cat([x.noisy_LC for x in samples], self.token_channels),
            velocity_TC=cat([x.velocity_LC for x in samples], self.token_channels),
            timestep_T=repeated([s.num_tokens for s in sequences]),
            text_XE=cat([x.text_XE for x in samples], self.text_dim, text_dtype),
            text_timestep_X=repeated(text_tokens),
            text_tokens=text_tokens,
        )


def shard_name(number: int) -> str:
    return f"shard-{number:05d}.safetensors"


def write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    """manifest.json, written last and atomically: its presence marks a finished dataset."""
    temporary = root / (MANIFEST + ".tmp")
    temporary.write_text(json.dumps(manifest, separators=(",", ":")) + "\n", encoding="utf-8")
    os.replace(temporary, root / MANIFEST)
