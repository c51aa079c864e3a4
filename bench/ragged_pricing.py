"""What the cost model's attention_ragged prices, measured in the step program on one GPU.

1. Packs (bench/attention_engine.py make_pack, six recipes, self and joint lengths): one rank
   holding every sequence of the pack whole, its self-attention through the step program
   (zellige.runtime.distributed_attention on the rank's local table), forward and backward GPU
   time and host issue time, under the merge policy "groups" (dense calls) and "auto" (one
   ragged call where the cuDNN frontend is installed and checked; JSON key "ragged").
2. Launch: the host issue time of a training step of the model's stack (profiler launch rows'
   tiny ranks: 1 sequence, and LAUNCH_SEQUENCES distinct lengths) under "groups" and "auto":
   what a ragged call costs the host against the dense calls it replaces.
The predictions are computed from the JSON afterwards (the lengths are in it).

    python bench/ragged_pricing.py --out ragged.json [--packs all|joint|self|none]
        [--models wan-14b,mmdit-11b (empty: no launch part)] [--quick]
--quick: a CPU smoke run (shrunk packs, the math ragged kernel under "ragged" in place of "auto").
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from zellige.profiler import launch, rank_work
from zellige.profiler.models import dit_config, stack_layers
from zellige.runtime import EngineConfig, distributed_attention, engine_runs_ragged, prepare_step

HEADS, HEAD_DIM = 24, 128


def timed(fn, device, repeats: int) -> tuple[float, float]:
    """(GPU seconds, host seconds to issue), medians of `repeats` runs after one warm-up."""
    fn()
    gpu, host = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        began = time.perf_counter()
        fn()
        host.append(time.perf_counter() - began)
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize(device)
            gpu.append(start.elapsed_time(end) / 1e3)
        else:
            gpu.append(host[-1])
    return float(np.median(gpu)), float(np.median(host))


def pack_times(lengths, device, dtype, merge: str, backend, repeats: int) -> dict:
    batch, plan = rank_work.local_plan([(n, 0) for n in lengths])
    step = prepare_step(
        batch, plan, HEADS, device, rank=0, engine=EngineConfig.from_env().replace(merge=merge)
    )
    total = sum(lengths)
    gen = torch.Generator(device=device).manual_seed(0)  # on the device: packs of ~100k tokens
    q, k, v, do = (
        torch.randn(total, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
        for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_()

    def attend():
        return distributed_attention(q, k, v, step, backend=backend)

    forward = timed(attend, device, repeats)
    out = attend()
    backward = timed(
        lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True), device, repeats
    )
    return {"forward_s": forward[0], "backward_s": backward[0], "host_s": [forward[1], backward[1]]}


def launch_times(model: str, device, dtype, merge: str, quick: bool) -> dict:
    """Host seconds of a training step of the tiny ranks (launch.profile_launch's), by merge."""
    config = dit_config(model)
    blocks = rank_work.make_blocks(config, stack_layers(model), device, dtype)
    text = launch.LAUNCH_TEXT_TOKENS if config.joint_attention else config.text_tokens

    def step_of(lengths):
        batch, plan = rank_work.local_plan([(n, text) for n in lengths])
        inputs = rank_work.plan_rank_inputs(
            batch=batch, plan=plan, rank=0, config=config, device=device, dtype=dtype,
            engine=EngineConfig.from_env().replace(merge=merge),
        )  # fmt: skip
        return lambda: rank_work.train_step(blocks, inputs, checkpointing=True)

    first = launch.LAUNCH_VISUAL_TOKENS
    steps = [
        step_of([first]),
        step_of([first + i for i in range(launch.LAUNCH_SEQUENCES)]),
    ]
    for fn in steps:
        fn()
        fn()
    rounds, per_round = (2, 2) if quick else (3, 5)
    one, many = (
        float(np.median(t)) for t in launch.interleaved_step_times(steps, device, rounds, per_round)
    )
    return {"layers": stack_layers(model), "one_s": one, "many_s": many}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="wan-14b,mmdit-11b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--packs", choices=("all", "joint", "self", "none"), default="all", help="which packs"
    )
    args = parser.parse_args()
    import attention_engine  # bench/, next to this file

    device = torch.device("cpu" if args.quick else "cuda")
    dtype = torch.float32 if args.quick else torch.bfloat16
    backend, ragged_merge = ("math", "ragged") if args.quick else (None, "auto")
    result = {
        "ragged": engine_runs_ragged(device, dtype, HEAD_DIM) or args.quick,
        "torch": torch.__version__,
        "packs": [],
        "launch": {},
    }
    print(f"engine runs ragged calls: {result['ragged']}", flush=True)
    shrink = 64 if args.quick else 1
    kinds = {"all": (True, False), "joint": (True,), "self": (False,), "none": ()}[args.packs]
    for joint in kinds:
        for recipe in attention_engine.RECIPES[:2] if args.quick else attention_engine.RECIPES:
            lengths = attention_engine.make_pack(recipe, 98304, 0, joint, shrink)
            row = {"recipe": recipe, "joint": joint, "lengths": lengths}
            for key, merge in (("groups", "groups"), ("ragged", ragged_merge)):
                row[key] = pack_times(lengths, device, dtype, merge, backend, args.repeats)
            result["packs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "lengths"}), flush=True)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    for model in args.models.split(",") if args.models else []:
        model = "tiny" if args.quick else model
        result["launch"][model] = {
            key: launch_times(model, device, dtype, merge, args.quick)
            for key, merge in (("groups", "groups"), ("ragged", ragged_merge))
        }
        print(model, json.dumps(result["launch"][model]), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if args.quick:
            break


if __name__ == "__main__":
    main()
