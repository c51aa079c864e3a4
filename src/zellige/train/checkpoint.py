"""Checkpoints that resume exactly, on the same or another number of ranks.

Layout of DIR (the README's training section describes it for users):
    DIR/step-K/            sharded model and optimizer state (torch.distributed.checkpoint, every
                           rank writes its shards in parallel) and train_state.json
    DIR/latest             text "step-K": the newest complete checkpoint

train_state.json holds what is not sharded: the step, the learning-rate schedule, the number of
ranks and of loader ranks, the model's sizes and a SHA-256 of every file of the checkpoint. It is
JSON, so reading it runs no code. There is no RNG state to keep: the loop reseeds torch's
generators from (seed, step, rank) at every step and draws its data from (seed, step, sequence).

A save is atomic: it writes DIR/.step-K.partial, renames it to DIR/step-K once every file and its
checksum are written, then replaces DIR/latest through a rename. A process killed at any moment
leaves DIR/latest naming a complete checkpoint.

Checkpoints are trusted input: DCP's .metadata file and the optimizer's non-tensor values are
pickles, which run code when loaded. The checksums catch corruption, not tampering.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

FORMAT = "zellige-train-checkpoint"
VERSION = 1
STATE_FILE = "train_state.json"
_CHUNK_BYTES = 8 << 20


@dataclass(kw_only=True, slots=True)
class CheckpointInfo:
    """What train_state.json says about a checkpoint (read without a process group)."""

    path: Path
    step: int
    num_ranks: int
    data_ranks: int
    model: dict  # DiTConfig fields
    scheduler: dict
    files: dict[str, dict]  # file name -> {"bytes": n, "sha256": hex}


def find_checkpoint(resume_dir: str | Path) -> CheckpointInfo:
    """The checkpoint DIR/latest names, or resume_dir itself if it is one. Raises ValueError
    with one line when there is none or its train_state.json is unreadable."""
    where = Path(resume_dir)
    if not where.exists():
        raise ValueError(f"--resume {where}: no such directory")
    if not where.is_dir():
        raise ValueError(f"--resume {where}: not a directory")
    path = where
    latest = where / "latest"
    name = None
    if latest.is_file():
        name = latest.read_text(errors="replace").strip()
        if not name.startswith("step-") or "/" in name:
            raise ValueError(f"--resume {where}: latest names {name[:40]!r}, not a step-K")
        path = where / name
    if not (path / STATE_FILE).is_file():
        if any(path.glob("rank-*.pt")):
            raise ValueError(
                f"--resume {path}: a checkpoint of an older zellige (rank-R.pt pickles, "
                "which this version does not load)"
            )
        if name is not None:
            raise ValueError(f"--resume {where}: latest names {name}, not a checkpoint here")
        raise ValueError(f"--resume {where}: no checkpoint there (no latest, no {STATE_FILE})")
    try:
        state = json.loads((path / STATE_FILE).read_text())
        if state.get("format") != FORMAT or state.get("version") != VERSION:
            raise ValueError(f"not format {FORMAT} version {VERSION}")
        info = CheckpointInfo(
            path=path,
            step=_int(state["step"], 1),
            num_ranks=_int(state["num_ranks"], 1),
            data_ranks=_int(state["data_ranks"], 1),
            model=dict(state["model"]),
            scheduler=dict(state["scheduler"]),
            files={str(k): dict(v) for k, v in state["files"].items()},
        )
        if any("/" in name or name in ("", ".", "..") for name in info.files):
            raise ValueError("a file name is not a plain name")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as error:
        text = str(error)[:200]
        raise ValueError(f"--resume {path}: {STATE_FILE} is not valid ({text})") from None
    return info


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    data_ranks: int,
    model_config: object,
) -> Path:
    """Saves the state after `step` steps (collective); returns the checkpoint directory."""
    out_dir = Path(out_dir)
    final = out_dir / f"step-{step}"
    partial = out_dir / f".step-{step}.partial"
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if rank == 0 and partial.exists():  # left by a run killed while saving
        shutil.rmtree(partial)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(partial))
    # dcp.save returns on every rank once the coordinator has written .metadata: all files exist
    names = sorted(p.name for p in partial.iterdir())
    mine = {name: _file_digest(partial / name) for name in names[rank::num_ranks]}
    gathered: list[dict | None] = [None] * num_ranks
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        files = {name: digest for part in gathered for name, digest in part.items()}
        state = {
            "format": FORMAT,
            "version": VERSION,
            "step": step,
            "num_ranks": num_ranks,
            "data_ranks": data_ranks,
            "model": dataclasses.asdict(model_config),
            "scheduler": scheduler.state_dict(),
            "files": files,
        }
        _write_durably(partial / STATE_FILE, json.dumps(state, indent=1) + "\n")
        if final.exists():  # a step saved again (a run that restarted from an earlier one)
            stale = out_dir / f".step-{step}.stale"
            shutil.rmtree(stale, ignore_errors=True)
            final.rename(stale)
            partial.rename(final)
            shutil.rmtree(stale)
        else:
            partial.rename(final)
        temporary = out_dir / ".latest.partial"
        _write_durably(temporary, final.name + "\n")
        os.replace(temporary, out_dir / "latest")
        _fsync_directory(out_dir)
    dist.barrier()
    return final


def load_checkpoint(
    info: CheckpointInfo,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> None:
    """Restores a checkpoint found by find_checkpoint (collective), on any number of ranks: DCP
    reshards the model and optimizer state. First checks every file against its checksum (the
    ranks share the reading); raises ValueError, the same on every rank, on a mismatch."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    names = sorted(info.files)
    bad = []
    for name in names[rank::num_ranks]:
        file = info.path / name
        if not file.is_file() or _file_digest(file) != info.files[name]:
            bad.append(name)
    gathered: list[list[str] | None] = [None] * num_ranks
    dist.all_gather_object(gathered, bad)
    bad = sorted(name for part in gathered for name in part)
    if bad:
        raise ValueError(
            f"checkpoint {info.path} is corrupt: {', '.join(bad[:5])} "
            f"{'does' if len(bad) == 1 else 'do'} not match the checksums in {STATE_FILE}"
        )
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(info.path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    scheduler.load_state_dict(info.scheduler)


def _file_digest(path: Path) -> dict:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _int(value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"expected an integer >= {minimum}, got {str(value)[:40]}")
    return value
