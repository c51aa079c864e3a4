"""Where a rank's peak memory goes, against the cost model, on one GPU (a diagnostic for
`zellige validate-profile`'s memory error).

    python bench/memory_breakdown.py [--profile FILE] [--json OUT]

For a few rank shapes (all local sequences, wan-14b cut to 2 layers, checkpointing on), the
rank's step runs as validate-profile runs it (rank_work.train_step) twice: once as is, and
once with every weight gradient freed the moment it is accumulated. Printed per shape, all
above the blocks' bf16 weights (which both the harness and the model hold):
- measured: bytes kept after the forward, the backward's peak, and the gradients alive at
  that peak (the difference of the two runs' peaks);
- modelled: the shares' memory (kept activations and one layer's buffers) and the fixed
  "one layer's unsharded fp32 gradients".
"""

from __future__ import annotations

import argparse
import json

import torch

from zellige.costs import make_cost_model
from zellige.profile import load_profile
from zellige.profiler import rank_work
from zellige.profiler.memory import local_lengths_plan
from zellige.profiler.models import dit_config, model_spec
from zellige.profiler.timing import allocated_bytes, synchronize

# (label, sequence lengths), all local on one rank, 512 text tokens each
SHAPES = (
    ("19 images of 256", [256] * 19),
    ("one video of 5040", [5040]),
    ("21 videos of 3600", [3600] * 21),
    ("one video of 32760", [32760]),
    ("12 videos of 2730", [2730] * 12),
)
GIB = 2**30


def measure(blocks, inputs, free_grads_at_once: bool, device) -> tuple[int, int]:
    """(kept after forward, peak during backward), both above what was allocated before."""
    hooks = []
    if free_grads_at_once:
        for parameter in blocks.parameters():

            def drop(p):
                p.grad = None

            hooks.append(parameter.register_post_accumulate_grad_hook(drop))
    rank_work.train_step(blocks, inputs, checkpointing=True)  # warm-up
    synchronize(device)
    before = allocated_bytes(device)
    out = rank_work.forward_blocks(blocks, inputs, checkpointing=True)
    synchronize(device)
    kept = allocated_bytes(device) - before
    torch.cuda.reset_peak_memory_stats(device)
    out.backward(inputs.grad_TD)
    synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del out
    rank_work.clear_grads(blocks, inputs)
    for hook in hooks:
        hook.remove()
    return kept, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    dtype = torch.bfloat16
    config = dit_config("wan-14b", num_layers=2)
    spec = model_spec("wan-14b", num_layers=2)
    profile = load_profile(args.profile)
    cost_model = make_cost_model(spec, gpus=8, profile=profile)
    layer_grads_fp32 = spec.param_count / spec.num_layers * 4
    blocks = rank_work.make_blocks(config, 2, device, dtype)
    rows = []
    print(
        "shape                 tokens | kept  peak  grads@peak | model: shares  fp32 grads "
        "| peak-(shares+grads)  GiB"
    )
    for label, lengths in SHAPES:
        batch, plan = local_lengths_plan(lengths, 512)
        shares = sum(
            share.memory_bytes
            for sequence, placement in zip(batch.sequences, plan.placements, strict=True)
            for share in cost_model.shares(sequence, placement)
        )
        inputs = rank_work.plan_rank_inputs(
            batch=batch, plan=plan, rank=0, config=config, device=device, dtype=dtype
        )
        kept, peak = measure(blocks, inputs, False, device)
        _, peak_without_grads = measure(blocks, inputs, True, device)
        del inputs
        torch.cuda.empty_cache()
        grads = peak - peak_without_grads
        row = {
            "shape": label,
            "tokens": sum(lengths),
            "kept": kept,
            "peak": peak,
            "grads_at_peak": grads,
            "model_shares": shares,
            "model_grads": layer_grads_fp32,
        }
        rows.append(row)
        print(
            f"{label:<20} {sum(lengths):>7} | {kept / GIB:5.2f} {peak / GIB:5.2f} "
            f"{grads / GIB:6.2f}     | {shares / GIB:12.2f} {layer_grads_fp32 / GIB:10.2f} "
            f"| {(peak - shares - layer_grads_fp32) / GIB:+.2f}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(rows, stream, indent=1)


if __name__ == "__main__":
    main()
