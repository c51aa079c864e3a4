"""`zellige encode`: images and clips through the user's VAE and text encoder into a latent
dataset (zellige.data.latents; docs/formats.md, "Latent dataset") that `--data DIR` trains on."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from zellige.commands._args import int_in
from zellige.data.latents import DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="image or video files, or directories of them (searched recursively); each file's "
        "caption is the text file beside it with the same name and .txt",
    )
    parser.add_argument(
        "--models",
        required=True,
        metavar="MODULE:CALLABLE",
        help="a callable (in an importable module, or a file: path/to/file.py:build) that "
        "returns (vae, text_encoder): any diffusers VAE, and a callable from a caption to its "
        "[L, E] embeddings",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="a new or empty directory")
    parser.add_argument(
        "--shard-size", type=int_in(1, 1 << 20), default=64, help="samples per shard (64)"
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="float32", help="stored type (float32)"
    )


def load_attribute(reference: str) -> Any:
    """`module:name` or `path/to/file.py:name` -> the object. ValueError with one line."""
    module_name, colon, attribute = reference.rpartition(":")
    if not colon or not module_name or not attribute:
        raise ValueError(f"--models {reference}: expected MODULE:CALLABLE or FILE.py:CALLABLE")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise ValueError(f"--models {reference}: no file {path}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules.setdefault(path.stem, module)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"--models {reference}: cannot import {module_name} ({error})") from None
    if not hasattr(module, attribute):
        raise ValueError(f"--models {reference}: {module_name} has no {attribute}")
    return getattr(module, attribute)


def run(args: argparse.Namespace) -> int:
    from zellige.data.encode import media_samples, write_latent_dataset

    build = load_attribute(args.models)
    if not callable(build):
        raise ValueError(f"--models {args.models}: not callable")
    samples = media_samples(args.inputs)  # every caption found before any encoding
    built = build()
    if not (isinstance(built, tuple | list) and len(built) == 2):
        raise ValueError(f"--models {args.models}: must return (vae, text_encoder)")
    vae, text_encoder = built
    dataset = write_latent_dataset(
        samples,
        vae=vae,
        text_encoder=text_encoder,
        out=args.out,
        shard_size=args.shard_size,
        dtype=args.dtype,
    )
    buckets = ", ".join(f"{name} x{size}" for name, size in dataset.bucket_batch.items())
    print(
        f"wrote {len(dataset)} samples in {len(dataset.shards)} shards to {dataset.path}: "
        f"{dataset.latent_channels}-channel latents, {dataset.text_dim}-wide text; buckets "
        f"(micro-batch) {buckets}"
    )
    return 0
