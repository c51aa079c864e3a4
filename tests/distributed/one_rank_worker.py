"""Trains the tiny model under several paths and saves each one's losses, gradient norms and
final parameters (test_train_one_rank.py compares them). Meant for a world of one; under torchrun
with more ranks the same paths run sharded (FSDP2) and rank 0 saves.

usage: one_rank_worker.py OUT DTYPE VARIANT...; a variant is NAME=FIELD:VALUE,... of TrainConfig
overrides (bool and float values), e.g. fsdp=fsdp_on_one_rank:true."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from zellige.runtime import end_rank_process
from zellige.train import loop
from zellige.train.config import get_config

STEPS = 3
CLIP = 0.05  # below every step's gradient norm: the clipping acts on every step


def _value(text: str):
    if text in ("true", "false"):
        return text == "true"
    return float(text)


def run(dtype: str, changes: dict) -> dict:
    fields = {"steps": STEPS, "loader_workers": 0, "dtype": dtype, "grad_clip_norm": CLIP}
    config = get_config("tiny-cpu").with_fields(**(fields | changes))
    built = {}
    build_model = loop.build_model

    def keeping(*args):
        built["model"] = build_model(*args)
        return built["model"]

    loop.build_model = keeping
    try:
        history = loop.train(config, progress=False)
    finally:
        loop.build_model = build_model
    params = {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in built["model"].named_parameters()
    }
    return {
        "losses": [r["loss"] for r in history],
        "grad_norms": [r["grad_norm"] for r in history],
        "checkpointed_blocks": [r["checkpointed_blocks"] for r in history],
        "params": params,
    }


def main() -> None:
    out, dtype, *variants = sys.argv[1:]
    results = {}
    for variant in variants:
        name, _, fields = variant.partition("=")
        changes = {}
        for item in filter(None, fields.split(",")):
            key, _, value = item.partition(":")
            changes[key] = _value(value)
        results[name] = run(dtype, changes)
    if dist.get_rank() == 0:
        torch.save(results, out)
    end_rank_process()  # the FSDP2-held gloo group must not meet Python's finalization


if __name__ == "__main__":
    main()
