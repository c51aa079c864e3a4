"""`zellige check`: run one plan's distributed attention (forward + backward) on N processes and
compare output and gradients with single-process attention. PASS / FAIL, exit 1 on FAIL.

The model decides what is checked: joint attention over each sequence's [text, visual] tokens
for MMDiT presets (mmdit-11b, hunyuan-13b), self-attention plus cross-attention to the text for
Wan-style ones. When the plan leaves a distributed strategy unused (a planner that keeps every
sequence whole, say), hand-built plans with Ulysses (uneven heads), ring, hybrid and overlapping
rank sets for the same batch are checked too, in the same processes (--only-plan skips them)."""

from __future__ import annotations

import argparse
import dataclasses

from zellige import _core
from zellige.commands._args import MAX_TOKENS, int_in
from zellige.commands._inputs import add_batch_arguments, add_model_arguments, setup_from_args
from zellige.plan_io import load_plan_with_context, require_plan_for_batch

DEFAULT_MAX_TOKENS = {"cpu": 8192, "cuda": 1 << 22}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc", type=int_in(1, 1024), required=True, metavar="N", help="processes (ranks)"
    )
    add_batch_arguments(parser)
    planning = parser.add_mutually_exclusive_group(required=True)
    planning.add_argument("--planner", metavar="P", help="planner that places the batch")
    planning.add_argument("--plan", metavar="FILE", help="a Plan JSON file instead of a planner")
    parser.add_argument(
        "--heads", type=int_in(1, 4096), default=None, metavar="H", help="attention heads (model's)"
    )
    parser.add_argument(
        "--head-dim", type=int_in(1, 1024), default=16, metavar="D", help="head dimension (16)"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="gloo on cpu, NCCL on cuda (cpu)"
    )
    parser.add_argument(
        "--gpus-per-node",
        type=int_in(1, 1024),
        default=None,
        metavar="G",
        help="for planning (8, or N)",
    )
    add_model_arguments(
        parser,
        "planning, head count and attention kind (MMDiT presets: joint; Wan: self + cross); "
        "default: the workload's",
    )
    parser.add_argument(
        "--only-plan",
        action="store_true",
        help="check only the given plan, not the hand-built distributed plans added when it "
        "leaves Ulysses, ring or hybrid unused",
    )
    parser.add_argument(
        "--dtype", default=None, help="float64 | float32 | bfloat16 (float64 on cpu, bf16 on cuda)"
    )
    parser.add_argument(
        "--backend",
        default=None,
        help="attention kernel of the engine (cudnn, flash, efficient, cpu, math); "
        "default: chosen for the device",
    )
    parser.add_argument(
        "--max-tokens",
        type=int_in(1, MAX_TOKENS),
        default=None,
        metavar="T",
        help="scale token counts down to at most T in total (8192 on cpu); placements unchanged",
    )


def _scaled(batch: _core.Batch, max_tokens: int) -> tuple[_core.Batch, float]:
    """The batch with every sequence's tokens and text shortened in proportion (at least 1 token;
    text at least 1 where there was some), so a huge workload runs on CPU; grids become
    (1, 1, L). max_tokens bounds visual plus text tokens."""
    total = _core.total_tokens(batch) + sum(s.text_tokens for s in batch.sequences)
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
                text_tokens=max(min(seq.text_tokens, 1), int(seq.text_tokens * factor)),
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
        plan, context = load_plan_with_context(args.plan)
        require_plan_for_batch(plan, context, setup.batch, args.nproc, args.plan)
        return setup.batch, plan, setup.cost_model.model, f"plan file {args.plan}"
    plan = run_planner(setup, args.planner, args.seed or 0)
    return setup.batch, plan, setup.cost_model.model, args.planner


def _distributed_plans(
    batch: _core.Batch, num_ranks: int, num_heads: int
) -> tuple[list[_core.Plan], str]:
    """Hand-built plans for `batch` that use every distributed strategy the rank and head counts
    allow: sequence i of plan k gets strategy (i + k) mod 4 of [Ulysses over a degree that does
    not divide the head count where one exists, ring, hybrid (ring over 2 where fewer than 4
    ranks), local], on ranks rotated by i, so rank sets overlap. Returns the plans and a line
    saying what they cover."""
    if num_ranks < 2:
        return [], ""
    ranks = list(range(num_ranks))
    degrees = range(2, min(num_ranks, num_heads) + 1)
    uneven = [u for u in degrees if num_heads % u != 0]
    u_degree = uneven[-1] if uneven else (max(degrees) if num_heads >= 2 else 0)
    # Callers give these plans a head count the largest degree does not divide where the
    # model's does (see _uneven_heads), so this finds the uneven split.
    hybrid = num_ranks >= 4 and num_heads >= 2
    plans = []
    for k in range(3):
        placements = []
        for i, seq in enumerate(batch.sequences):
            rotated = ranks[i % num_ranks :] + ranks[: i % num_ranks]
            kind = (i + k) % 4
            if kind == 0 and u_degree:
                placement = _core.make_placement(seq.id, _core.Strategy.ulysses, rotated[:u_degree])
            elif kind == 1 or (kind == 2 and not hybrid) or (kind == 0 and not u_degree):
                ring_ranks = rotated[::-1] if kind == 1 else rotated[:2]
                placement = _core.make_placement(seq.id, _core.Strategy.ring, ring_ranks)
            elif kind == 2:
                r_degree = num_ranks // 2
                placement = _core.make_placement(
                    seq.id, _core.Strategy.hybrid, rotated[: 2 * r_degree], 2
                )
            else:
                placement = _core.make_placement(seq.id, _core.Strategy.local, rotated[:1])
            placements.append(placement)
        plans.append(
            _core.Plan(planner=f"hand-{k + 1}", num_ranks=num_ranks, placements=placements)
        )
    covered = []
    if u_degree:
        split = ",".join(str(n) for n in _core.balanced_split(num_heads, u_degree))
        covered.append(f"Ulysses over {u_degree} ranks ({num_heads} heads split {split})")
    covered.append(f"ring over {num_ranks} ranks" + (" and 2" if num_ranks > 2 else ""))
    if hybrid:
        covered.append(f"hybrid(2,{num_ranks // 2})")
    covered.append("local, on overlapping rank sets")
    return plans, ", ".join(covered)


def _uneven_heads(num_heads: int, num_ranks: int) -> int:
    """A head count close to the model's that some Ulysses degree 2..num_ranks splits unevenly
    (the model's own when it already does), for the hand-built plans."""
    for heads in range(num_heads, num_heads + num_ranks + 1):
        if any(heads % u for u in range(2, min(num_ranks, heads) + 1)):
            return heads
    return num_heads


def _print_result(result, label: str) -> None:
    print(f"  {label}, kernel {result.kernel}")
    print(f"    {'tensor':<9} {'rel. error':>11} {'ref. rounding':>14} {'bound':>11}")
    for name, (err, ref_err, bound) in result.errors.items():
        verdict = "ok" if err <= bound else "TOO LARGE"
        print(f"    {name:<9} {err:>11.3e} {ref_err:>14.3e} {bound:>11.3e}  {verdict}")


def run(args: argparse.Namespace) -> int:
    # torch loads only when the command runs (the CLI imports every command to build its help).
    import torch

    from zellige.runtime.verify import (
        BOUND_FACTOR,
        ROUNDOFF_FACTOR,
        CheckConfig,
        spawn_check,
        unit_roundoff,
    )

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
    num_heads = args.heads if args.heads is not None else model.num_heads
    if num_heads <= 0 or args.head_dim <= 0:
        raise ValueError(
            f"--heads and --head-dim must be positive, got {num_heads} and {args.head_dim}"
        )
    joint = model.joint_attention
    kind = (
        "joint attention over [text, visual]"
        if joint
        else "self-attention + cross-attention to the text"
    )
    dtype = args.dtype or ("float64" if args.device == "cpu" else "bfloat16")
    if dtype not in ("float64", "float32", "bfloat16", "float16"):
        raise ValueError(f"--dtype must be float64, float32, bfloat16 or float16, got {dtype}")
    # The same validation the ranks do, before any process starts (they would all refuse alike).
    _core.validate_plan(plan, batch, args.nproc, num_heads)
    if args.max_tokens is not None and args.max_tokens <= 0:
        raise ValueError(f"--max-tokens must be positive, got {args.max_tokens}")
    max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS[args.device]
    run_batch, factor = _scaled(batch, max_tokens)
    cfg = CheckConfig(
        num_heads=num_heads,
        head_dim=args.head_dim,
        dtype=dtype,
        device=args.device,
        backend=args.backend,
        seed=args.seed or 0,
        joint_attention=joint,
        cross_attention=not joint,
    )
    strategies = sorted({_core.strategy_name(p) for p in plan.placements})
    print(
        f"check: {plan_source} on {args.nproc} processes "
        f"({'nccl' if args.device == 'cuda' else 'gloo'}, {args.device}), "
        f"{len(batch.sequences)} sequences, {_core.total_tokens(batch):,} tokens, {model.name}, "
        f"strategies {', '.join(strategies)}"
    )
    if factor < 1.0:
        print(
            f"  token and text counts scaled down x{factor:.3g} to "
            f"{_core.total_tokens(run_batch):,} tokens (--max-tokens {max_tokens}, text "
            "included); placements unchanged"
        )
    checks, labels = [(plan, cfg)], [plan_source]
    distributed = set(strategies) - {"local"}
    wanted = {"ulysses", "ring"} | ({"hybrid"} if args.nproc >= 4 else set())
    used = {name.split("(")[0] for name in distributed}
    if not args.only_plan and not wanted <= used:
        extra_heads = _uneven_heads(num_heads, args.nproc)
        extra, covered = _distributed_plans(run_batch, args.nproc, extra_heads)
        if extra_heads != num_heads:
            covered += f" ({extra_heads} heads: the model's {num_heads} split evenly)"
        if extra:
            missing = ", ".join(sorted(wanted - used))
            what = "places every sequence locally" if not distributed else f"uses no {missing}"
            print(
                f"  the plan {what}: also checking {len(extra)} hand-built plans for the same "
                f"batch on {args.nproc} processes: {covered} (--only-plan skips them)"
            )
            extra_cfg = dataclasses.replace(cfg, num_heads=extra_heads)
            checks += [(p, extra_cfg) for p in extra]
            labels += [p.planner for p in extra]
        else:
            print("  one process: nothing distributed to check (use --nproc 2 or more)")
    elif not distributed:
        print(
            "  warning: the plan places every sequence locally and --only-plan is set: this "
            "checks no distributed attention"
        )
    results = spawn_check(run_batch, checks, args.nproc)
    print(
        f"  {num_heads} heads x {args.head_dim}, {dtype}, {kind}; "
        f"bound = {BOUND_FACTOR:g} x reference rounding + {ROUNDOFF_FACTOR:g} u, where the "
        "reference rounding is how far single-process attention moves when its keys are "
        f"reordered and u is {dtype}'s unit roundoff ({unit_roundoff(getattr(torch, dtype)):.1e})"
    )
    for label, (plan_checked, plan_cfg), result in zip(labels, checks, results, strict=True):
        strategies_checked = sorted({_core.strategy_name(p) for p in plan_checked.placements})
        _print_result(
            result, f"{label} ({', '.join(strategies_checked)}; {plan_cfg.num_heads} heads)"
        )
    passed = all(r.passed for r in results)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1
