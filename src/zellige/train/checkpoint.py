"""Checkpoints that resume exactly, on the same or another number of ranks.

Layout of DIR (the README's training section describes it for users):
    DIR/step-K/            sharded model and optimizer state (torch.distributed.checkpoint, every
                           rank writes its shards in parallel) and train_state.json
    DIR/latest             text "step-K": the newest complete checkpoint
    DIR/.lock              held (flock) by the run that writes DIR: a second run is refused

train_state.json holds what is not sharded: the step, the learning-rate schedule, the number of
ranks and of loader ranks, the model's sizes, what else a resumed run must share (dtype, seed,
recipe, planner), a SHA-256 of every file of the checkpoint and one of itself (`digest`). It is
JSON, so reading it runs no code; every value is checked against the limits of docs/formats.md
before anything is built from it. There is no RNG state to keep: the loop reseeds torch's
generators from (seed, step, rank) at every step and draws its data from (seed, step, sequence).

A save is atomic: it writes DIR/.step-K.partial, renames it to DIR/step-K once every file and its
checksum are written, then replaces DIR/latest through a rename. A process killed at any moment
leaves DIR/latest naming a complete checkpoint, or (while step K is saved again) naming a step-K
moved aside, which resume then finds as DIR/.step-K.partial or DIR/.step-K.stale. The next run
with --out DIR removes what killed saves left behind.

Checkpoints are trusted input: DCP's .metadata file and the optimizer's non-tensor values are
pickles, which run code when loaded. The checksums catch corruption, not tampering.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from zellige._core import MAX_GPUS
from zellige._files import read_input
from zellige._json import check_strings, cut, parse_json, printable
from zellige.train.config import MAX_LEARNING_RATE, MAX_STEPS, check_data_ranks

FORMAT = "zellige-train-checkpoint"
# 2: train_state.json carries `run` and `digest`; version 1 files (without them) still load
VERSION = 2
STATE_FILE = "train_state.json"
LOCK_FILE = ".lock"
METADATA_FILE = ".metadata"  # DCP's index of the shards: read first, so it must be checksummed
MAX_STATE_BYTES = 16 << 20
_CHUNK_BYTES = 8 << 20
_STATE_KEYS = ("format", "version", "step", "num_ranks", "data_ranks", "model", "scheduler")
_RUN_KEYS = ("dtype", "seed", "recipe", "planner")  # what a resumed run must share
# ... and these, absent from checkpoints saved before they existed (read as None)
_OPTIONAL_RUN_KEYS = ("global_batch", "data")
_STEP_NAME = re.compile(r"step-[0-9]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")


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
    run: dict | None = None  # dtype, seed, recipe, planner (None: a version 1 checkpoint)


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
        if not _STEP_NAME.fullmatch(name):
            raise ValueError(
                f"--resume {where}: latest names {printable(cut(name, 40))!r}, not a step-K"
            )
        path = _moved_aside(where, name) or where / name
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
        text = read_input(path / STATE_FILE, MAX_STATE_BYTES, STATE_FILE)
        info = _checked_state(path, parse_json(text, STATE_FILE))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        text = printable(cut(str(error), 200))
        raise ValueError(f"--resume {path}: {STATE_FILE} is not valid ({text})") from None
    return info


def _moved_aside(where: Path, name: str) -> Path | None:
    """Where step-K is while a save of the same step replaces it (latest names it, the directory
    is gone): the new copy, complete once its state file exists, else the old one."""
    if (where / name).exists():
        return None
    for candidate in (where / f".{name}.partial", where / f".{name}.stale"):
        if (candidate / STATE_FILE).is_file():
            return candidate
    return None


def _checked_state(path: Path, state: Any) -> CheckpointInfo:
    """CheckpointInfo from train_state.json's object; ValueError for any value outside its
    type, range or agreement with the other values and the directory."""
    check_strings(state, STATE_FILE)  # depth, and strings that are not text
    if not isinstance(state, dict):
        raise ValueError("not a JSON object")
    if state.get("format") != FORMAT or state.get("version") not in (1, VERSION):
        raise ValueError(f"not format {FORMAT} version 1 or {VERSION}")
    keys = (*_STATE_KEYS, "files") + (("run", "digest") if state["version"] >= 2 else ())
    unknown = sorted(set(state) - set(keys))
    missing = [key for key in keys if key not in state]
    if unknown or missing:
        raise ValueError(f"unknown key {cut(unknown[0])!r}" if unknown else f"no {missing[0]!r}")
    if state["version"] >= 2:
        body = {key: value for key, value in state.items() if key != "digest"}
        if state["digest"] != _state_digest(body):
            raise ValueError("its digest does not match its content (the file was changed)")
    step = _int(state["step"], 1, MAX_STEPS, "step")
    if _STEP_NAME.fullmatch(path.name) and path.name != f"step-{step}":
        raise ValueError(f"step {step} in directory {path.name}")
    model = state["model"]
    if not isinstance(model, dict) or any(
        not isinstance(v, int | float | str | bool) for v in model.values()
    ):
        raise ValueError("model must be an object of sizes")
    files = state["files"]
    if not isinstance(files, dict):
        raise ValueError("files must be an object")
    for file_name, digest in files.items():
        if "/" in file_name or file_name in ("", ".", "..", STATE_FILE):
            raise ValueError(f"the file name {cut(file_name)!r} is not a plain name")
        if (
            not isinstance(digest, dict)
            or set(digest) != {"bytes", "sha256"}
            or not isinstance(digest["sha256"], str)
            or not _SHA256.fullmatch(digest["sha256"])
        ):
            raise ValueError(f"files[{cut(file_name)!r}] must be {{bytes, sha256}}")
        _int(digest["bytes"], 0, 1 << 50, f"files[{cut(file_name)!r}].bytes")
    # every file DCP reads has a checksum: its index and each shard beside it
    unlisted = sorted(
        p.name for p in path.iterdir() if p.name == METADATA_FILE or p.suffix == ".distcp"
    )
    unlisted = [file_name for file_name in unlisted if file_name not in files]
    if METADATA_FILE not in files or unlisted:
        raise ValueError(f"files lists no checksum of {(unlisted or [METADATA_FILE])[0]}")
    run = state.get("run")
    if run is not None:
        if not isinstance(run, dict) or set(run) - set(_OPTIONAL_RUN_KEYS) != set(_RUN_KEYS):
            raise ValueError(
                f"run must hold exactly {', '.join(_RUN_KEYS)} (and optionally "
                f"{', '.join(_OPTIONAL_RUN_KEYS)})"
            )
        if not all(isinstance(run[key], str) for key in ("dtype", "recipe", "planner")):
            raise ValueError("run.dtype, run.recipe and run.planner must be strings")
        _int(run["seed"], 0, (1 << 32) - 1, "run.seed")
        for key in _OPTIONAL_RUN_KEYS:
            if not isinstance(run.get(key), str | None):
                raise ValueError(f"run.{key} must be a string or null")
    return CheckpointInfo(
        path=path,
        step=step,
        num_ranks=_int(state["num_ranks"], 1, MAX_GPUS, "num_ranks"),
        data_ranks=_int(state["data_ranks"], 1, MAX_GPUS, "data_ranks"),
        model=model,
        scheduler=_checked_scheduler(state["scheduler"], step),
        files=files,
        run=run,
    )


def _checked_scheduler(scheduler: Any, step: int) -> dict:
    """The LambdaLR state: the learning rates finite and inside the limits, its epoch the step.
    load_checkpoint compares its keys with the run's own scheduler."""
    if not isinstance(scheduler, dict):
        raise ValueError("scheduler must be an object")
    for key in ("base_lrs", "_last_lr"):
        rates = scheduler.get(key)
        if (
            not isinstance(rates, list)
            or not rates
            or not all(_finite_number(r) and 0 <= r <= MAX_LEARNING_RATE for r in rates)
        ):
            raise ValueError(
                f"scheduler.{key} must be a list of learning rates in [0, {MAX_LEARNING_RATE:g}]"
            )
    if any(not 0 < r for r in scheduler["base_lrs"]):
        raise ValueError("scheduler.base_lrs must be > 0")
    if _int(scheduler.get("last_epoch"), 0, MAX_STEPS, "scheduler.last_epoch") != step:
        raise ValueError(f"scheduler.last_epoch {scheduler['last_epoch']} is not step {step}")
    lambdas = scheduler.get("lr_lambdas")
    if not isinstance(lambdas, list) or any(item is not None for item in lambdas):
        raise ValueError("scheduler.lr_lambdas must be a list of null (the loop's schedule)")
    return scheduler


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _state_digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def run_fields(config: Any) -> dict:
    """What a resumed run must share with the run that saved, by the keys train_state.json
    records them under (a TrainConfig's model.dtype, seed, data.recipe, parallelism.planner,
    data.global_batch: another global batch size would draw other batches; and "data": the
    SHA-256 of the latent dataset's manifest, None for the recipe's synthetic data, so another
    dataset is refused wherever it lies)."""
    data_dir = config.data.data_dir
    return {
        "dtype": config.model.dtype,
        "seed": config.seed,
        "recipe": config.data.recipe,
        "planner": config.parallelism.planner,
        "global_batch": config.data.global_batch,
        "data": None if data_dir is None else _manifest_digest(Path(data_dir)),
    }


def _manifest_digest(data_dir: Path) -> str:
    from zellige.data.latents import MANIFEST, file_digest

    return file_digest(data_dir / MANIFEST)


def check_resumable(info: CheckpointInfo, config: Any, num_ranks: int) -> None:
    """ValueError, one line, when this run differs from the checkpoint's in what it recorded or
    has too few ranks for the batches it was drawing."""
    check_data_ranks(info.data_ranks, num_ranks, f"checkpoint {info.path}'s data_ranks")
    if info.run is None:  # a version 1 checkpoint did not record it
        return
    for key, mine in run_fields(config).items():
        saved = info.run.get(key)  # an optional key a checkpoint did not record: None
        if mine != saved and key == "data":
            raise ValueError(
                f"checkpoint {info.path} was trained on {_data_named(saved)}, this run on "
                f"{_data_named(mine)}: resume with the same --data, or start a new --out"
            )
        if mine != saved:
            raise ValueError(
                f"checkpoint {info.path} was trained with {key} {printable(cut(repr(saved)))}, "
                f"this run's is {printable(cut(repr(mine)))}: resume with the same {key}, or "
                "start a new --out"
            )


def _data_named(digest: str | None) -> str:
    if digest is None:
        return "the recipe's synthetic data"
    return f"the latent dataset whose manifest has SHA-256 {printable(digest[:16])}..."


def check_out_dir(out_dir: str | Path | None, **paths: str | Path | None) -> None:
    """ValueError when another output (flag -> path) lies where the checkpoint layout writes
    inside --out (latest, step-K, their temporaries, the lock): a save would replace it."""
    if out_dir is None:
        return
    out = Path(out_dir).absolute()
    for flag, path in paths.items():
        if path is None:
            continue
        inside = Path(path).absolute()
        if out == inside:
            raise ValueError(f"{flag} {path} is --out itself")
        if out not in inside.parents:
            continue
        first = inside.relative_to(out).parts[0]
        if first in ("latest", ".latest.partial", LOCK_FILE) or _STEP_NAME.fullmatch(
            first.lstrip(".").removesuffix(".partial").removesuffix(".stale")
        ):
            raise ValueError(
                f"{flag} {path}: inside --out where checkpoints are written ({first}); "
                "give another path"
            )


class OutLock:
    """DIR/.lock held by rank 0 for the run (flock: released when the process ends, however)."""

    def __init__(self, fd: int | None) -> None:
        self._fd = fd

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_held = OutLock(None)  # this process's lock: one run at a time per process


def lock_out_dir(out_dir: str | Path | None) -> OutLock:
    """Takes DIR/.lock for this run (collective); raises the same ValueError on every rank when
    another run holds it. Under the lock, removes what killed saves left (their .partial,
    .stale and temporary files), except a step-K moved aside that latest still names."""
    global _held
    _held.close()  # a run of this process that ended before closing its lock (an error)
    if out_dir is None:
        return OutLock(None)
    out = Path(out_dir)
    fd, error = None, None
    if dist.get_rank() == 0:
        try:
            fd = os.open(out / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            _remove_leftovers(out)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            error = (
                f"--out {out}: another run (pid {printable(cut(holder, 20))}) is writing "
                "checkpoints there; wait for it or give another --out"
            )
        except OSError as exc:
            error = f"--out {out}: cannot lock {LOCK_FILE} ({exc.strerror or exc})"
        if error is not None and fd is not None:
            os.close(fd)
            fd = None
    errors = [error]
    dist.broadcast_object_list(errors, src=0)
    if errors[0] is not None:
        raise ValueError(errors[0])
    _held = OutLock(fd)
    return _held


def _remove_leftovers(out: Path) -> None:
    latest = out / "latest"
    name = latest.read_text(errors="replace").strip() if latest.is_file() else None
    keep = _moved_aside(out, name) if name and _STEP_NAME.fullmatch(name) else None
    for entry in out.iterdir():
        leftover = entry.name == ".latest.partial" or (
            entry.name.startswith(".step-") and entry.name.endswith((".partial", ".stale"))
        )
        if leftover and entry != keep:
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    *,
    data_ranks: int,
    model_config: object,
    run: dict | None = None,
) -> Path:
    """Saves the state after `step` steps (collective); returns the checkpoint directory.
    `run`: run_fields(config), checked when the checkpoint is resumed. A failed write (no space
    left) raises RuntimeError naming the file."""
    out_dir = Path(out_dir)
    final = out_dir / f"step-{step}"
    partial = out_dir / f".step-{step}.partial"
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    if rank == 0 and partial.exists():  # left by a run killed while saving
        shutil.rmtree(partial)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    try:  # DCP gathers every rank's failure (no space left ...), so all ranks raise alike
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(partial))
    except CheckpointException as error:
        text = printable(
            cut(str(error).strip().splitlines()[-1] if str(error).strip() else "", 200)
        )
        raise RuntimeError(f"cannot write checkpoint {partial}: {text}") from None
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
            "run": run,
        }
        state["digest"] = _state_digest(state)
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
    expected = scheduler.state_dict()
    if set(info.scheduler) != set(expected) or len(info.scheduler["base_lrs"]) != len(
        expected["base_lrs"]
    ):
        raise ValueError(
            f"checkpoint {info.path}: {STATE_FILE} holds a scheduler state of another shape "
            f"(keys {cut(', '.join(sorted(map(str, info.scheduler))), 120)})"
        )
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    try:  # DCP gathers every rank's failure, so all ranks raise here alike
        dcp.load(state, checkpoint_id=str(info.path))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
        )
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - damaged .metadata
        text = printable(cut(str(error).strip().splitlines()[0] if str(error).strip() else "", 200))
        raise ValueError(
            f"checkpoint {info.path}: its shards do not load ({type(error).__name__}: {text})"
        ) from None
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
    try:
        with open(path, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
    except OSError as error:
        raise RuntimeError(f"cannot write {path}: {error.strerror or error}") from None


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _int(value: object, low: int, high: int, key: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{key} must be an integer in [{low}, {high:,}], got {cut(repr(value))}")
    return value
