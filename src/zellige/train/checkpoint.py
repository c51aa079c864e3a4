"""Checkpoints that resume exactly: sharded model and optimizer state (torch.distributed.checkpoint,
written by every rank in parallel), plus the step, the LR schedule and every rank's RNG states.

Layout of DIR: DIR/step-K/ (the DCP shards + rank-R.pt) and DIR/latest (text: step-K).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def save_checkpoint(
    out_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> Path:
    """Saves the state after `step` steps; returns the checkpoint directory."""
    path = Path(out_dir) / f"step-{step}"
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(path))
    rank = dist.get_rank()
    local = {"step": step, "scheduler": scheduler.state_dict(), "rng": _rng_state()}
    torch.save(local, path / f"rank-{rank}.pt")
    dist.barrier()
    if rank == 0:
        (Path(out_dir) / "latest").write_text(path.name + "\n")
    return path


def load_checkpoint(
    resume_dir: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> int:
    """Restores the latest checkpoint under resume_dir (or resume_dir itself if it is one);
    returns the number of steps it had completed."""
    path = Path(resume_dir)
    if (path / "latest").exists():
        path = path / (path / "latest").read_text().strip()
    rank = dist.get_rank()
    local_file = path / f"rank-{rank}.pt"
    if not local_file.exists():
        raise ValueError(f"no checkpoint for rank {rank} in {path} (saved with fewer ranks?)")
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    local = torch.load(local_file, weights_only=False)
    scheduler.load_state_dict(local["scheduler"])
    _set_rng_state(local["rng"])
    return int(local["step"])


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
