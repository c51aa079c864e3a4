"""The training step reads no tensor back to the host after the loader hands it over (issue 16:
no host syncs in the step): one step of the tiny model on 2 gloo ranks under every kind of
placement (local, Ulysses, ring, hybrid), watched by no_host_sync_worker.py's guard. A canary
run makes such reads on purpose, so the test also shows the guard sees them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_train import _built, _torchrun

from zellige.runtime import layout, verify

CANARY_READS = [
    "aten._local_scalar_dense.default",  # .item()
    "aten._local_scalar_dense.default",  # bool()
    "aten.index.Tensor with a boolean mask",
    "Tensor.tolist()",
    "aten.repeat_interleave.Tensor without output_size",
    "torch.tensor(a list of tensors)",
    "Tensor.__array__()",
]


def _reads(tmp_path: Path, batch: str, planners: list[str]) -> dict[str, list[list[str]]]:
    out = tmp_path / f"reads-{batch}.json"
    worker = str(Path(__file__).with_name("no_host_sync_worker.py"))
    _torchrun(2, worker, str(out), batch, *planners)
    return json.loads(out.read_text())


def test_the_training_step_reads_nothing_back(tmp_path: Path) -> None:
    planners = ["hand-ring", *(p for p in ("dp-cost", "static-cp:2", "zellige") if _built(p))]
    records = _reads(tmp_path, "mixed", [*planners, "canary"])
    for planner in planners:
        for rank, reads in enumerate(records[planner]):
            assert reads == [], f"{planner}, rank {rank}: the step read tensors back: {reads}"
    for rank, reads in enumerate(records["canary"]):
        got = [r.split(" at ")[0] for r in reads]
        assert got == CANARY_READS, f"rank {rank}: the guard missed a read: {reads}"


def test_the_mmdit_step_reads_nothing_back(tmp_path: Path) -> None:
    """The joint step (mmdit_step.py): its stream order and local sequence index come from the
    program's host arrays, so neither the step nor the MMDiT's forward reads anything back."""
    planners = ["mmdit:hand-ring", *(f"mmdit:{p}" for p in ("dp-cost", "zellige") if _built(p))]
    records = _reads(tmp_path, "mixed", planners)
    for planner in planners:
        for rank, reads in enumerate(records[planner]):
            assert reads == [], f"{planner}, rank {rank}: the step read tensors back: {reads}"


def test_a_rank_without_tokens_reads_nothing_back(tmp_path: Path) -> None:
    records = _reads(tmp_path, "single", ["dp-cost"])
    for rank, reads in enumerate(records["dp-cost"]):
        assert reads == [], f"rank {rank}: the step read tensors back: {reads}"


def test_on_cuda_the_ranks_agree_over_host_tensors(monkeypatch) -> None:
    """load_step's status exchange under an NCCL world (faked: this machine has no GPU) goes over
    a gloo twin of the world with host tensors, made once per world, and still raises a rank's
    error on every rank."""
    # init_process_group sets the rendezvous variables in this process's environment: restore
    # them, or later tests' subprocesses inherit a port that is no longer free
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    verify.init_process_group(0, 1, verify.free_port(), "cpu")
    try:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        cuda = torch.device("cuda", 0)
        twin, status_device = layout._status_group(None, cuda)
        assert status_device.type == "cpu" and twin is not dist.group.WORLD
        assert layout._status_group(None, cuda)[0] is twin
        layout._agree_on_status(None, 7, None, cuda)
        with pytest.raises(ValueError, match="the loader failed"):
            layout._agree_on_status("the loader failed", 7, None, cuda)
    finally:
        dist.destroy_process_group()
    verify.init_process_group(0, 1, verify.free_port(), "cpu")
    try:  # a new world gets a new twin
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        assert layout._status_group(None, torch.device("cuda", 0))[0] is not twin
    finally:
        dist.destroy_process_group()
        # the twin held there would keep its gloo threads running into pytest's exit
        layout._HOST_GROUP.clear()
