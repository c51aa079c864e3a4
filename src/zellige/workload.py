"""Workloads: the built-in recipes (data/recipes.json) and the Batch JSON format
(docs/formats.md).

A batch file lists sequences; each gives `num_tokens` directly or `frames`/`height`/`width`
pixels turned into tokens by the latent geometry. `text_tokens` defaults to the model's text
length, `source_rank` to 0, `kind` to image (one frame) or video.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

from zellige import _core
from zellige._files import write_output
from zellige._json import (
    cut,
    parse_json,
    read_text,
    reject_unknown,
    require_int,
    require_list,
    require_number,
    require_object,
    require_str,
    shown,
)

_SEQUENCE_FIELDS = (
    "id",
    "kind",
    "num_tokens",
    "frames",
    "height",
    "width",
    "text_tokens",
    "source_rank",
    "grid",
)
_KINDS = ("image", "video")


@functools.cache
def _recipes() -> dict[str, dict]:
    text = resources.files("zellige").joinpath("data/recipes.json").read_text()
    return {name: body for name, body in json.loads(text).items() if isinstance(body, dict)}


def recipe_names() -> list[str]:
    """Names of the built-in workload recipes."""
    return list(_recipes())


def load_recipe(name: str) -> _core.Recipe:
    """The built-in recipe `name` as a _core.Recipe (ValueError listing the names if unknown)."""
    recipes = _recipes()
    if name not in recipes:
        raise ValueError(f"unknown workload '{name}' (allowed: {', '.join(recipes)})")
    return recipe_from_dict(name, recipes[name])


def recipe_from_dict(name: str, body: dict) -> _core.Recipe:
    """Parses one recipe of recipes.json: bucket, mix or per-rank-group form."""
    where = f"recipe '{name}'"
    recipe = _core.Recipe(name=name, model=require_str(body, "model", where))
    geometry = _core.LatentGeometry()
    for key in ("temporal_stride", "spatial_stride", "patch_t", "patch_hw"):
        setattr(geometry, key, require_int(body, key, where, getattr(geometry, key)))
    recipe.geometry = geometry
    if "text_tokens_uniform" in body:
        text_range = require_list(body, "text_tokens_uniform", where)
        if len(text_range) != 2 or not all(type(v) is int for v in text_range):
            raise ValueError(f"{where}: 'text_tokens_uniform' must be [min, max] integers")
        recipe.text_tokens_min, recipe.text_tokens_max = text_range
    else:
        recipe.text_tokens = require_int(body, "text_tokens", where)

    if "buckets" in body:
        per_frame = body.get("tokens_per_latent_frame", {})
        per_frame_range = body.get("tokens_per_latent_frame_range", {})
        buckets = []
        for entry in require_list(body, "buckets", where):
            if not isinstance(entry, list) or len(entry) not in (3, 4):
                raise ValueError(
                    f"{where}: bucket {entry} must be [resolution, frames, batch(, weight)]"
                )
            resolution, frames, batch = entry[:3]
            if resolution in per_frame_range:
                low, high = per_frame_range[resolution]
            elif resolution in per_frame:
                low = high = per_frame[resolution]
            else:
                raise ValueError(f"{where}: no tokens_per_latent_frame for '{resolution}'")
            buckets.append(
                _core.Bucket(
                    resolution=resolution,
                    frames=frames,
                    batch=batch,
                    tokens_per_latent_frame_min=low,
                    tokens_per_latent_frame_max=high,
                    weight=float(entry[3]) if len(entry) == 4 else 1.0,
                )
            )
        recipe.buckets = buckets
    elif "mix" in body:
        mix = []
        for i, entry in enumerate(require_list(body, "mix", where)):
            entry_where = f"{where} mix entry {i}"
            entry = require_object(entry, entry_where)
            mix.append(
                _core.MixEntry(
                    kind=require_str(entry, "kind", entry_where),
                    num_tokens=require_int(entry, "tokens", entry_where, 0),
                    frames=require_int(entry, "frames", entry_where, 1),
                    height=require_int(entry, "height", entry_where, 0),
                    width=require_int(entry, "width", entry_where, 0),
                    share=require_number(entry, "share", entry_where),
                )
            )
        recipe.mix = mix
    elif "per_rank_groups" in body:
        groups = []
        for i, entry in enumerate(require_list(body, "per_rank_groups", where)):
            group_where = f"{where} rank group {i}"
            entry = require_object(entry, group_where)
            groups.append(
                _core.RankGroup(
                    ranks=require_int(entry, "ranks", group_where),
                    batch=require_int(entry, "batch", group_where),
                    tokens=require_int(entry, "tokens", group_where),
                )
            )
        recipe.per_rank_groups = groups
    else:
        raise ValueError(f"{where}: needs one of 'buckets', 'mix', 'per_rank_groups'")
    return recipe


def generate(name: str | _core.Recipe, num_ranks: int, seed: int = 0) -> _core.Batch:
    """The batch of one step on num_ranks ranks from a built-in recipe; deterministic for seed."""
    recipe = load_recipe(name) if isinstance(name, str) else name
    return _core.generate_batch(recipe, num_ranks, seed)


def _resolve_model(model: str | _core.ModelSpec | None) -> _core.ModelSpec | None:
    return _core.model_preset(model) if isinstance(model, str) else model


def _sequence_from_dict(
    raw: Any,
    index: int,
    model: _core.ModelSpec | None,
    geometry: _core.LatentGeometry,
) -> _core.Sequence:
    entry = require_object(raw, f"sequence #{index}")
    seq_id = require_int(entry, "id", f"sequence #{index}")
    where = f"sequence {seq_id}"
    reject_unknown(entry, _SEQUENCE_FIELDS, where)

    if "text_tokens" in entry or model is None:
        if "text_tokens" not in entry:
            raise ValueError(
                f"{where}: missing field 'text_tokens' (give it, or a model for its default)"
            )
        text_tokens = require_int(entry, "text_tokens", where)
    else:
        text_tokens = model.text_tokens
    source_rank = require_int(entry, "source_rank", where, 0)

    pixel_keys = [k for k in ("frames", "height", "width") if k in entry]
    if "num_tokens" in entry and pixel_keys:
        raise ValueError(f"{where}: give either num_tokens or frames/height/width, not both")
    if "num_tokens" in entry:
        num_tokens = require_int(entry, "num_tokens", where)
        grid = require_list(entry, "grid", where, [])
        if grid and (
            len(grid) != 3
            or any(type(v) is not int or not 1 <= v <= _core.MAX_SEQUENCE_TOKENS for v in grid)
        ):
            raise ValueError(
                f"{where}: 'grid' must be [t, h, w] positive integers multiplying to num_tokens, "
                f"got {shown(grid)}"
            )
        kind = require_str(entry, "kind", where, "video" if grid and grid[0] > 1 else "image")
        seq = _core.sequence_from_tokens(seq_id, kind, num_tokens, text_tokens, source_rank)
        if grid:
            seq.grid_t, seq.grid_h, seq.grid_w = grid
    elif pixel_keys:
        if "grid" in entry:
            raise ValueError(f"{where}: 'grid' goes with num_tokens (pixels give their own grid)")
        frames = require_int(entry, "frames", where, 1)
        height = require_int(entry, "height", where)
        width = require_int(entry, "width", where)
        kind = require_str(entry, "kind", where, "image" if frames == 1 else "video")
        seq = _core.sequence_from_pixels(
            seq_id, kind, frames, height, width, text_tokens, source_rank, geometry
        )
    else:
        raise ValueError(f"{where}: missing field 'num_tokens' (or 'frames'/'height'/'width')")
    if seq.kind not in _KINDS:
        raise ValueError(f"{where}: kind '{cut(seq.kind)}' is not one of {', '.join(_KINDS)}")
    return seq


def batch_from_dict(
    data: Any,
    model: str | _core.ModelSpec | None = None,
    geometry: _core.LatentGeometry | None = None,
    num_ranks: int = 0,
) -> _core.Batch:
    """A Batch from its JSON object. `model` gives the default text length; `geometry` turns
    pixels into tokens (default 4x8x8 VAE, 1x2x2 patch); num_ranks > 0 checks source ranks."""
    data = require_object(data, "batch")
    reject_unknown(data, ("sequences",), "batch")
    raw_sequences = require_list(data, "sequences", "batch")
    if len(raw_sequences) > _core.MAX_BATCH_SEQUENCES:
        raise ValueError(
            f"batch: {len(raw_sequences):,} sequences, above the limit of "
            f"{_core.MAX_BATCH_SEQUENCES:,}"
        )
    resolved = _resolve_model(model)
    geometry = geometry or _core.LatentGeometry()
    sequences, total_tokens = [], 0
    for i, raw in enumerate(raw_sequences):
        sequences.append(_sequence_from_dict(raw, i, resolved, geometry))
        # Checked as we go, so an oversized batch is refused before all of it is gridded.
        total_tokens += sequences[-1].num_tokens
        if total_tokens > _core.MAX_BATCH_TOKENS:
            raise ValueError(
                f"batch: more than {_core.MAX_BATCH_TOKENS:,} tokens (the limit) by sequence #{i}"
            )
    batch = _core.Batch(sequences=sequences)
    _core.validate_batch(batch, num_ranks)
    return batch


def batch_to_dict(batch: _core.Batch) -> dict:
    """The JSON object of a batch; tokens given directly, with the latent grid."""
    return {
        "sequences": [
            {
                "id": s.id,
                "kind": s.kind,
                "num_tokens": s.num_tokens,
                "text_tokens": s.text_tokens,
                "source_rank": s.source_rank,
                "grid": [s.grid_t, s.grid_h, s.grid_w],
            }
            for s in batch.sequences
        ]
    }


def batch_from_json(
    text: str,
    model: str | _core.ModelSpec | None = None,
    geometry: _core.LatentGeometry | None = None,
    num_ranks: int = 0,
    source: str = "batch",
) -> _core.Batch:
    """A Batch from JSON text; errors are one-line ValueErrors prefixed with `source`."""
    data = parse_json(text, source)
    try:
        return batch_from_dict(data, model, geometry, num_ranks)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def batch_fingerprint(batch: _core.Batch) -> str:
    """A short hash of what a plan depends on: every sequence's id, tokens, text tokens, source
    rank and grid, in id order. A plan file records it, so that a plan shown or checked against
    another batch (even one reusing the ids) is recognised as not made for it."""
    rows = sorted(
        (s.id, s.num_tokens, s.text_tokens, s.source_rank, s.grid_t, s.grid_h, s.grid_w)
        for s in batch.sequences
    )
    return "sha256:" + hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16]


def batch_to_json(batch: _core.Batch) -> str:
    """Batch JSON with one sequence per line."""
    lines = [json.dumps(s) for s in batch_to_dict(batch)["sequences"]]
    return '{"sequences": [\n  ' + ",\n  ".join(lines) + "\n]}\n"


def load_batch(
    path: str | Path,
    model: str | _core.ModelSpec | None = None,
    geometry: _core.LatentGeometry | None = None,
    num_ranks: int = 0,
) -> _core.Batch:
    """Reads a Batch JSON file (see batch_from_dict for the arguments)."""
    return batch_from_json(read_text(path), model, geometry, num_ranks, source=str(path))


def save_batch(batch: _core.Batch, path: str | Path) -> None:
    """Writes Batch JSON atomically (a temporary file renamed over `path`)."""
    write_output(path, batch_to_json(batch))
