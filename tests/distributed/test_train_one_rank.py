"""Training on one rank (issue 16: the step outside the blocks): the paths that skip work on a
world of one give the parameters of the general path after several clipped steps.

- no FSDP (fp32 masters, bf16 copies cast once per step: parallelize.LoneRankWeights) and FSDP2
  keeping its gathered weights to the backward: bit for bit FSDP2's parameters, in bf16 (the
  casts are the same) and float64;
- AdamW writing the next forward's weight copies with its update (copying_optimizer,
  train.optimizer.CopyingAdamW): torch's fused AdamW and the cast, to float64 rounding;
- the clipping folded into the fused AdamW (its grad_scale): torch's clip_grad_norm_ then AdamW
  within the float32 rounding of the scale, while a clipping off by 1% is far outside that; on
  one rank and on two (sharded gradients).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from test_train import _torchrun, _train

from zellige.train.config import DataSection, ModelSection, TrainConfig
from zellige.train.optimizer_builder import weights_kept_to_backward


def _runs(tmp_path: Path, dtype: str, *variants: str, ranks: int = 1) -> dict:
    out = tmp_path / f"one-rank-{dtype}-{ranks}.pt"
    worker = str(Path(__file__).with_name("one_rank_worker.py"))
    _torchrun(ranks, worker, str(out), dtype, *variants)
    return torch.load(out, weights_only=False)


def _largest_relative_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max(
        float((got[k].double() - want[k].double()).abs().max() / want[k].double().abs().max())
        for k in want
    )


def _clipped_every_step(run: dict, clip: float = 0.05) -> bool:
    return all(norm > 2 * clip for norm in run["grad_norms"])


def test_one_rank_paths_give_fsdp_parameters_bit_for_bit(tmp_path: Path) -> None:
    checkpointed = "activation_checkpointing:true,adaptive_checkpointing:false"
    for dtype in ("bfloat16", "float64"):
        variants = [
            "fsdp=fsdp_on_one_rank:true,reshard_after_forward:true",
            "kept=fsdp_on_one_rank:true,reshard_after_forward:false",
            "lone=fsdp_on_one_rank:false",
        ]
        if dtype == "bfloat16":  # the backward's recompute uses the bf16 copies too
            variants += [
                f"fsdp_checkpointed=fsdp_on_one_rank:true,reshard_after_forward:true,{checkpointed}",
                f"lone_checkpointed=fsdp_on_one_rank:false,{checkpointed}",
            ]
        runs = _runs(tmp_path, dtype, *variants)
        assert _clipped_every_step(runs["fsdp"])
        pairs = [("kept", "fsdp"), ("lone", "fsdp")]
        if dtype == "bfloat16":
            pairs.append(("lone_checkpointed", "fsdp_checkpointed"))
            assert min(runs["lone_checkpointed"]["checkpointed_blocks"]) > 0
        for name, reference_name in pairs:
            reference = runs[reference_name]
            assert runs[name]["losses"] == reference["losses"], (dtype, name)
            for key, value in reference["params"].items():
                assert runs[name]["params"][key].dtype == value.dtype  # fp32 / f64 masters
                assert torch.equal(runs[name]["params"][key], value), (dtype, name, key)


def test_copying_optimizer_resumes_bit_for_bit(tmp_path: Path) -> None:
    """A run with the copying optimizer (bf16 copies written with the update, gradients kept in
    the compute dtype) resumed from its step-2 checkpoint continues with the uninterrupted
    run's losses: the saved masters and state are the whole story (the first resumed forward
    casts the masters, as the copies it would have had are their cast)."""
    args = ("--steps", "4", "--loader-workers", "0", "--copying-optimizer")
    args += ("--compute-dtype-gradients",)
    whole = _train(
        1, tmp_path, "whole", *args, "--checkpoint-every", "2", "--out", str(tmp_path / "ckpt")
    )
    resumed = _train(1, tmp_path, "resumed", *args, "--resume", str(tmp_path / "ckpt" / "step-2"))
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]


def test_clipping_in_the_fused_optimizer_matches_clip_grad_norm(tmp_path: Path) -> None:
    runs = _runs(
        tmp_path,
        "float64",
        "separate=fused_optimizer:false,fsdp_on_one_rank:true",
        "folded=fused_optimizer:true,fsdp_on_one_rank:true",
        "folded_lone=fused_optimizer:true",
        "off_by_1pct=fused_optimizer:false,fsdp_on_one_rank:true,grad_clip_norm:0.0505",
    )
    reference = runs["separate"]["params"]
    assert _clipped_every_step(runs["separate"])
    # the scale reaches the kernel in float32: agreement to its rounding, not to float64's
    for name in ("folded", "folded_lone"):
        assert _largest_relative_difference(runs[name]["params"], reference) < 1e-7, name
    # a wrong clipping shows far above that tolerance
    assert _largest_relative_difference(runs["off_by_1pct"]["params"], reference) > 1e-5


def test_copying_optimizer_matches_the_fused_adamw(tmp_path: Path) -> None:
    """CopyingAdamW (one rank, no FSDP) writes the next forward's weight copies with its update
    (float64 copies here: LoneRankWeights makes them for it in any dtype): torch's fused AdamW
    with the clipping folded in and the forward's cast, up to float64 rounding of another
    evaluation order, also where it reads the gradients in the compute dtype with their norm
    taken as they arrive (compute_dtype_gradients); a stale copy (a forward on the weights
    before the update) or a lost clipping would be far outside it, as a clipping off by 1% is."""
    runs = _runs(
        tmp_path,
        "float64",
        "folded_lone=fused_optimizer:true",
        "copying=copying_optimizer:true,compute_dtype_gradients:false",
        "copying_kept=copying_optimizer:true,compute_dtype_gradients:true",
        "copying_checkpointed=copying_optimizer:true,compute_dtype_gradients:false,"
        "activation_checkpointing:true,"
        "adaptive_checkpointing:false",
        "off_by_1pct=fused_optimizer:true,grad_clip_norm:0.0505",
    )
    reference = runs["folded_lone"]
    assert _clipped_every_step(reference)
    for name in ("copying", "copying_checkpointed", "copying_kept"):
        assert _largest_relative_difference(runs[name]["params"], reference["params"]) < 1e-12
        for got, want in zip(runs[name]["losses"], reference["losses"], strict=True):
            assert abs(got - want) <= 1e-12 * abs(want), name
    assert _largest_relative_difference(runs["off_by_1pct"]["params"], reference["params"]) > 1e-5


def test_clipping_in_the_fused_optimizer_on_sharded_gradients(tmp_path: Path) -> None:
    """Two ranks (FSDP2: the gradients are DTensor shards, as on every multi-GPU job): the
    folded clipping's norm is the global one, and the fused AdamW applies it to each shard."""
    runs = _runs(
        tmp_path,
        "float64",
        "separate=fused_optimizer:false",
        "folded=fused_optimizer:true",
        "off_by_1pct=fused_optimizer:false,grad_clip_norm:0.0505",
        ranks=2,
    )
    reference = runs["separate"]["params"]
    assert _clipped_every_step(runs["separate"])
    assert _largest_relative_difference(runs["folded"]["params"], reference) < 1e-7
    assert _largest_relative_difference(runs["off_by_1pct"]["params"], reference) > 1e-5


def test_the_cost_model_prices_kept_weights_where_training_keeps_them() -> None:
    def config(**fields) -> TrainConfig:
        sections = dict(model=ModelSection(dit=None), data=DataSection(recipe="tiny"))
        return TrainConfig(name="t", **sections).with_fields(**fields)

    assert weights_kept_to_backward(config(), 1)  # no FSDP on one rank
    assert not weights_kept_to_backward(config(), 2)
    assert weights_kept_to_backward(config(reshard_after_forward=False), 2)
    assert weights_kept_to_backward(config(fsdp_on_one_rank=True), 1)
    assert not weights_kept_to_backward(
        config(fsdp_on_one_rank=True, reshard_after_forward=True), 1
    )
    assert weights_kept_to_backward(config(reshard_after_forward=True), 1)  # no FSDP: kept


def test_compiled_steps_leave_full_collections_little_to_traverse(tmp_path: Path) -> None:
    """issue 16: an image step of wan-1.3b on an H200 was 0.3-0.5 s longer once per run,
    outside the blocks: a Python full garbage collection that fell in it traversed every
    object torch.compile had left (0.23 s for 0.43 M objects on a CPU). The loop collects and
    freezes them between steps (QuietCollector): a step after the first, whatever its pack,
    compiles nothing, and a full collection in it walks only the step's own objects, not the
    process's (torch and the compiled graphs). Unfrozen when training ends. Without it
    (freeze_gc false), every step's full collection walks the whole process."""
    out = tmp_path / "gc.json"
    _torchrun(1, str(Path(__file__).with_name("gc_worker.py")), str(out))
    runs = json.loads(out.read_text())
    report = runs["frozen"]
    steps = report["steps"]
    assert len({s["sequences"] for s in steps}) > 1  # packs of images and of one clip alternate
    assert steps[0]["compile_events"] > 0
    assert [s["compile_events"] for s in steps[1:]] == [0] * (len(steps) - 1)
    assert report["before"] > 100_000
    for step in steps[1:]:
        assert step["traversed"] < report["before"] / 20, step
    assert report["frozen_after"] == 0
    auto = runs["auto"]
    assert all(step["traversed"] > auto["before"] / 2 for step in auto["steps"])


def test_split_modulation_and_gathered_head_train_as_the_default(tmp_path: Path) -> None:
    """The modulation's one-hot GEMM per piece and the head's gathered rows (bench variants
    :split-modulation, :gathered-head) in float64 training with clipping on every step: the
    default path's losses and final parameters to float64 rounding (the forward selects the
    same rows; the gradients' sums over tokens may be ordered differently)."""
    runs = _runs(
        tmp_path,
        "float64",
        "default=split_modulation:false,gathered_head:false",
        "new=split_modulation:true,gathered_head:true",
    )
    assert _clipped_every_step(runs["default"])
    assert runs["new"]["losses"][0] == runs["default"]["losses"][0]
    for got, want in zip(runs["new"]["losses"], runs["default"]["losses"], strict=True):
        assert abs(got - want) <= 1e-12 * abs(want)
    assert _largest_relative_difference(runs["new"]["params"], runs["default"]["params"]) < 1e-10
