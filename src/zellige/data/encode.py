"""Writing a latent dataset: images and clips through the user's VAE, captions through the
user's text encoder, into shards and a manifest (zellige.data.latents reads them back).

Pixels are [3, H, W] (image) or [3, F, H, W] (clip) in [-1, 1], as diffusers' VAEs take them;
a file is read with Pillow (images, and animated GIF / WebP / PNG as clips) or PyAV (other
video files, if installed). The VAE is any diffusers autoencoder: its `encode(x)` output's
latent distribution's mode (or its `latent`) is normalised the way the VAE's config says
(latents_mean / latents_std, else shift_factor / scaling_factor). The text encoder is any
callable from a caption to its [L, E] embeddings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from zellige.data.latents import (
    DTYPES,
    FORMAT,
    MANIFEST,
    VERSION,
    LatentDataset,
    file_digest,
    open_latent_dataset,
    sample_digest,
    shard_name,
    write_manifest,
)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
VIDEO_SUFFIXES = (".mp4", ".mov", ".mkv", ".webm", ".avi")
MEDIA_SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES

TextEncoder = Callable[[str], Tensor]


@dataclass(kw_only=True)
class RawSample:
    """One image or clip to encode and its caption.

    pixels: [3, H, W] or [3, F, H, W] in [-1, 1], or the path of an image or video file.
    caption: the text for the text encoder.
    bucket: the sample's bucket (default: its latent grid, "txhxw").
    """

    pixels: Tensor | str | Path
    caption: str
    bucket: str | None = None


def read_media(path: str | Path) -> Tensor:
    """An image file as [3, H, W], an animated image or video file as [3, F, H, W]; in [-1, 1]."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in VIDEO_SUFFIXES:
        frames = _video_frames(path)
    elif suffix in IMAGE_SUFFIXES:
        from PIL import Image, ImageSequence

        try:
            with Image.open(path) as image:
                frames = [np.asarray(f.convert("RGB")) for f in ImageSequence.Iterator(image)]
        except OSError as error:
            raise ValueError(f"{path}: cannot read the image ({error})") from None
    else:
        raise ValueError(f"{path}: not an image or video file ({', '.join(MEDIA_SUFFIXES)})")
    pixels = torch.from_numpy(np.stack(frames)).permute(3, 0, 1, 2).float() / 127.5 - 1
    return pixels[:, 0] if pixels.shape[1] == 1 else pixels


def _video_frames(path: Path) -> list[np.ndarray]:
    try:
        import av
    except ImportError:
        raise ValueError(
            f"{path}: reading video files needs PyAV (pip install av); animated GIF, WebP "
            "and PNG clips are read without it"
        ) from None
    try:
        with av.open(str(path)) as container:
            return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    except av.error.FFmpegError as error:
        raise ValueError(f"{path}: cannot decode the video ({error})") from None


def caption_of(path: Path) -> str:
    """The caption beside a media file: the text of the file with the same stem and .txt."""
    text_path = path.with_suffix(".txt")
    try:
        return text_path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise ValueError(f"{path}: no caption file {text_path.name} beside it") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"{text_path}: cannot read the caption ({error})") from None


def media_samples(inputs: Iterable[str | Path]) -> list[RawSample]:
    """A RawSample per media file of `inputs` (files, or directories searched recursively, in
    sorted order), each captioned by its .txt file."""
    files = []
    for item in inputs:
        item = Path(item)
        if item.is_dir():
            files += sorted(p for p in item.rglob("*") if p.suffix.lower() in MEDIA_SUFFIXES)
        elif item.is_file():
            files.append(item)
        else:
            raise ValueError(f"{item}: no such file or directory")
    if not files:
        raise ValueError("no image or video files in the inputs")
    return [RawSample(pixels=path, caption=caption_of(path)) for path in files]


def is_video_vae(vae: torch.nn.Module) -> bool:
    """Whether `vae` takes [B, 3, F, H, W] clips (a 3D autoencoder, as Wan's or HunyuanVideo's)
    rather than [B, 3, H, W] images."""
    return any(isinstance(module, torch.nn.Conv3d) for module in vae.modules())


def encode_pixels(vae: torch.nn.Module, pixels: Tensor, video_vae: bool) -> Tensor:
    """Normalised latents [C, t, h, w] of one image or clip."""
    if pixels.dim() not in (3, 4) or pixels.shape[0] != 3:
        raise ValueError(f"pixels must be [3, H, W] or [3, F, H, W], got {list(pixels.shape)}")
    clip = pixels if pixels.dim() == 4 else pixels[:, None]
    parameter = next(vae.parameters())
    if video_vae:
        x = clip[None]
    elif clip.shape[1] == 1:
        x = clip[:, 0][None]
    else:
        raise ValueError(
            f"a clip of {clip.shape[1]} frames needs a video VAE; {type(vae).__name__} encodes "
            "images"
        )
    with torch.no_grad():
        encoded = vae.encode(x.to(parameter.device, parameter.dtype))
    dist = getattr(encoded, "latent_dist", None)
    if dist is None and isinstance(encoded, tuple):
        dist = encoded[0]
    z = dist.mode() if hasattr(dist, "mode") else getattr(encoded, "latent", dist)
    if not isinstance(z, Tensor):
        raise ValueError(
            f"{type(vae).__name__}.encode gave neither a latent distribution nor latents"
        )
    z = z[0].float().cpu()
    if z.dim() == 3:
        z = z[:, None]
    return _normalised(vae, z)


def _normalised(vae: torch.nn.Module, z_CTHW: Tensor) -> Tensor:
    config = getattr(vae, "config", None)
    mean, std = getattr(config, "latents_mean", None), getattr(config, "latents_std", None)
    if mean is not None and std is not None:
        shape = (-1, 1, 1, 1)
        return (z_CTHW - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)
    shift = getattr(config, "shift_factor", None) or 0.0
    scale = getattr(config, "scaling_factor", None) or 1.0
    return (z_CTHW - shift) * scale


def normalisation_of(vae: torch.nn.Module) -> str:
    config = getattr(vae, "config", None)
    if getattr(config, "latents_mean", None) is not None:
        return "(z - latents_mean) / latents_std"
    shift = getattr(config, "shift_factor", None) or 0.0
    scale = getattr(config, "scaling_factor", None) or 1.0
    return f"(z - {shift:g}) * {scale:g}"


def write_latent_dataset(
    samples: Iterable[RawSample],
    *,
    vae: torch.nn.Module,
    text_encoder: TextEncoder,
    out: str | Path,
    shard_size: int = 64,
    dtype: str = "float32",
    bucket_batch: dict[str, int] | None = None,
    video_vae: bool | None = None,
) -> LatentDataset:
    """Encodes `samples` into a latent dataset at `out` (a new or empty directory) and returns
    it opened. `shard_size`: samples per shard; `dtype`: the stored latents' and embeddings'
    type (float32, bfloat16 or float16); `bucket_batch`: the micro-batch size of buckets by
    name (default: as many samples as give the largest sample's latent positions, at least 1:
    every loader rank then draws about equal work); `video_vae`: whether the VAE takes clips
    (default: it has Conv3d layers).

    Example:
        >>> write_latent_dataset(
        ...     [RawSample(pixels="cat.png", caption="a cat"), RawSample(pixels=clip, caption="")],
        ...     vae=AutoencoderKLWan.from_pretrained(...), text_encoder=encode_t5, out="latents/")
    """
    if type(shard_size) is not int or shard_size < 1:
        raise ValueError(f"shard_size must be a positive integer, got {shard_size!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    root = Path(out)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"{root}: exists and is not an empty directory")
    root.mkdir(parents=True, exist_ok=True)
    video_vae = is_video_vae(vae) if video_vae is None else video_vae
    store = DTYPES[dtype]
    vae.eval()

    shards, records, pending = [], [], {}
    latent_channels = text_dim = None

    def flush() -> None:
        from safetensors.torch import save_file

        path = root / shard_name(len(shards))
        save_file(pending, str(path), metadata={"format": FORMAT})
        shards.append(
            {"file": path.name, "num_bytes": path.stat().st_size, "sha256": file_digest(path)}
        )
        pending.clear()

    for number, raw in enumerate(samples):
        from_file = not isinstance(raw.pixels, Tensor)
        where = f"sample {number}" + (f" ({raw.pixels})" if from_file else "")
        try:
            pixels = raw.pixels if isinstance(raw.pixels, Tensor) else read_media(raw.pixels)
            latents = encode_pixels(vae, pixels, video_vae).to(store).contiguous()
            text = _embedding(text_encoder(raw.caption)).to(store).contiguous()
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        if latent_channels is None:
            latent_channels, text_dim = latents.shape[0], text.shape[1]
        if (latents.shape[0], text.shape[1]) != (latent_channels, text_dim):
            raise ValueError(
                f"{where}: {latents.shape[0]} latent channels and {text.shape[1]}-wide text, "
                f"sample 0 had {latent_channels} and {text_dim}"
            )
        key = len(pending) // 2
        pending[f"{key}.latents"], pending[f"{key}.text"] = latents, text
        grid = list(latents.shape[1:])
        records.append(
            {
                "shard": len(shards),
                "key": key,
                "grid": grid,
                "text_tokens": text.shape[0],
                "bucket": raw.bucket or "x".join(str(n) for n in grid),
                "sha256": sample_digest(latents, text),
            }
        )
        if len(pending) == 2 * shard_size:
            flush()
    if pending:
        flush()
    if not records:
        raise ValueError("no samples to encode")
    write_manifest(
        root,
        {
            "format": FORMAT,
            "version": VERSION,
            "latent_channels": latent_channels,
            "text_dim": text_dim,
            "dtype": dtype,
            "about": {
                "vae": type(vae).__name__,
                "latent_normalisation": normalisation_of(vae),
                "text_encoder": getattr(text_encoder, "__name__", type(text_encoder).__name__),
            },
            "buckets": _bucket_batches(records, bucket_batch or {}),
            "shards": shards,
            "samples": records,
        },
    )
    return open_latent_dataset(root)


def _embedding(text: Any) -> Tensor:
    if not isinstance(text, Tensor):
        raise ValueError(f"the text encoder returned {type(text).__name__}, not a tensor")
    if text.dim() == 3 and text.shape[0] == 1:
        text = text[0]
    if text.dim() != 2:
        raise ValueError(f"the text encoder returned shape {list(text.shape)}, not [L, E]")
    return text.detach().float().cpu()


def _bucket_batches(records: list[dict], given: dict[str, int]) -> dict[str, int]:
    largest: dict[str, int] = {}
    for record in records:
        positions = math.prod(record["grid"])
        largest[record["bucket"]] = max(largest.get(record["bucket"], 0), positions)
    unknown = sorted(set(given) - set(largest))
    if unknown:
        raise ValueError(f"bucket_batch names buckets no sample has: {', '.join(unknown)}")
    overall = max(largest.values())
    sizes = {name: given.get(name, max(1, overall // size)) for name, size in largest.items()}
    for name, size in sizes.items():
        if type(size) is not int or size < 1:
            raise ValueError(f"bucket_batch[{name!r}] must be a positive integer, got {size!r}")
    return dict(sorted(sizes.items()))


__all__ = [
    "MANIFEST",
    "RawSample",
    "media_samples",
    "read_media",
    "write_latent_dataset",
]
