"""`zellige check`: run one plan's distributed attention (forward + backward) on N processes and
compare output and gradients with single-process attention. PASS / FAIL, exit 1 on FAIL."""

from __future__ import annotations

import argparse

from zellige import _core
from zellige.commands._inputs import add_batch_arguments, add_model_arguments, setup_from_args
from zellige.plan_io import load_plan

DEFAULT_MAX_TOKENS = {"cpu": 8192, "cuda": 1 << 22}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int, required=True, metavar="N", help="processes (ranks)")
    add_batch_arguments(parser)
    planning = parser.add_mutually_exclusive_group(required=True)
    planning.add_argument("--planner", metavar="P", help="planner that places the batch")
    planning.add_argument("--plan", metavar="FILE", help="a Plan JSON file instead of a planner")
    parser.add_argument("--heads", type=int, default=None, metavar="H", help="(model's)")
    parser.add_argument("--head-dim", type=int, default=16, metavar="D", help="(16)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--gpus-per-node", type=int, default=None, metavar="G")
    add_model_arguments(parser, "for planning and the head count (default: the workload's)")
    parser.add_argument(
        "--dtype", default=None, help="float64 | float32 | bfloat16 (float64 on cpu, bf16 on cuda)"
    )
    parser.add_argument("--backend", default=None, help="attention kernel override")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        metavar="T",
        help="scale token counts down to at most T in total (8192 on cpu); placements unchanged",
    )


def _scaled(batch: _core.Batch, max_tokens: int) -> tuple[_core.Batch, float]:
    """The batch with every sequence shortened in proportion (at least 1 token), so a huge
    workload runs on CPU; grids become (1, 1, L)."""
    total = _core.total_tokens(batch)
    if total <= max_tokens:
        return batch, 1.0
    factor = max_tokens / total
    scaled = _core.Batch()
    sequences = []
    for seq in batch.sequences:
        tokens = max(1, int(seq.num_tokens * factor))
        sequences.append(
            _core.Sequence(
                id=seq.id,
                kind=seq.kind,
                num_tokens=tokens,
                text_tokens=seq.text_tokens,
                source_rank=seq.source_rank,
                grid_t=1,
                grid_h=1,
                grid_w=tokens,
            )
        )
    scaled.sequences = sequences
    return scaled, factor


def _batch_and_plan(
    args: argparse.Namespace,
) -> tuple[_core.Batch, _core.Plan, _core.ModelSpec, str]:
    """(batch, plan, model, where the plan came from). The cluster is --nproc GPUs."""
    from zellige.api import run_planner

    args.gpus, args.profile, args.links = args.nproc, None, None
    if args.gpus_per_node is None:
        args.gpus_per_node = min(8, args.nproc)
    setup = setup_from_args(args)
    if args.plan is not None:
        return setup.batch, load_plan(args.plan), setup.cost_model.model, f"plan file {args.plan}"
    plan = run_planner(setup, args.planner, args.seed or 0)
    return setup.batch, plan, setup.cost_model.model, args.planner


def run(args: argparse.Namespace) -> int:
    # torch loads only when the command runs (the CLI imports every command to build its help).
    import torch

    from zellige.runtime.verify import BOUND_FACTOR, ROUNDOFF_FACTOR, CheckConfig, spawn_check

    if args.nproc <= 0:
        raise ValueError(f"--nproc must be positive, got {args.nproc}")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is visible")
        if args.nproc > torch.cuda.device_count():
            raise ValueError(
                f"--nproc {args.nproc} exceeds the {torch.cuda.device_count()} visible GPUs"
            )
    batch, plan, model, plan_source = _batch_and_plan(args)
    num_heads = args.heads or model.num_heads
    dtype = args.dtype or ("float64" if args.device == "cpu" else "bfloat16")
    if dtype not in ("float64", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be float64, float32, bfloat16 or float16, got {dtype}")
    # The same validation the ranks do, before any process starts (they would all refuse alike).
    _core.validate_plan(plan, batch, args.nproc, num_heads)
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS[args.device]
    run_batch, factor = _scaled(batch, max_tokens)
    cfg = CheckConfig(
        num_heads=num_heads,
        head_dim=args.head_dim,
        dtype=dtype,
        device=args.device,
        backend=args.backend,
        seed=args.seed or 0,
    )
    strategies = sorted({_core.strategy_name(p) for p in plan.placements})
    print(
        f"check: {plan_source} on {args.nproc} processes "
        f"({'nccl' if args.device == 'cuda' else 'gloo'}, {args.device}), "
        f"{len(batch.sequences)} sequences, {_core.total_tokens(batch):,} tokens, "
        f"strategies {', '.join(strategies)}"
    )
    if factor < 1.0:
        print(
            f"  token counts scaled down x{factor:.3g} to {_core.total_tokens(run_batch):,} "
            f"tokens (--max-tokens {max_tokens}); placements unchanged"
        )
    result = spawn_check(run_batch, plan, cfg, args.nproc)
    print(
        f"  {num_heads} heads x {args.head_dim}, {dtype}, kernel {result.kernel}; "
        f"bound = {BOUND_FACTOR:g} x reference rounding + {ROUNDOFF_FACTOR:g} u"
    )
    print(f"  {'tensor':<6} {'rel. error':>11} {'ref. rounding':>14} {'bound':>11}")
    for name, (err, ref_err, bound) in result.errors.items():
        verdict = "ok" if err <= bound else "TOO LARGE"
        print(f"  {name:<6} {err:>11.3e} {ref_err:>14.3e} {bound:>11.3e}  {verdict}")
    print("PASS" if result.passed else "FAIL")
    return 0 if result.passed else 1
