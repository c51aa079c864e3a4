"""`zellige show`: the per-rank picture of a plan, as text (one line per rank) and optionally as a
Gantt chart PNG drawn from the simulator's timeline."""

from __future__ import annotations

import argparse
from collections import defaultdict

from zellige import _core
from zellige._files import check_outputs, write_output
from zellige._json import output_line, require_int, require_str
from zellige.api import Setup, lower_bound, make_setup, require_finite
from zellige.commands._args import SEED_MAX, int_in
from zellige.commands._inputs import add_cluster_arguments, model_from_args
from zellige.model_spec import model_spec_from_dict
from zellige.plan_io import load_plan_with_context, require_plan_for_batch
from zellige.workload import batch_from_dict, load_batch, recipe_names

BAR_COLUMNS = 40
LINE_COLUMNS = 120
# Text bar characters and PNG colours per timeline phase.
PHASES = {
    "linear": ("#", "tab:blue"),
    "attention": ("=", "tab:orange"),
    "exchange": ("~", "tab:red"),
    "launch": (".", "tab:gray"),  # waiting for the host to issue kernels
}
# PNG legend labels: the timeline draws a rank's per-token layers as one block before attention.
PNG_LABELS = {
    "linear": "per-token layers (all layers, drawn as one block)",
    "attention": "attention (labelled as in the text view: id, u/r/h degree)",
    "exchange": "exchange (Ulysses all-to-all, ring k/v)",
    "launch": "waiting for the host to issue kernels",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("plan", metavar="PLAN.json", help="a plan written by `zellige plan --out`")
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--workload",
        metavar="NAME",
        help=f"rebuild the batch from this recipe, one of: {', '.join(recipe_names())}",
    )
    source.add_argument("--batch", metavar="FILE", help="the plan's Batch JSON file")
    parser.add_argument(
        "--seed", type=int_in(0, SEED_MAX), default=None, help="with --workload (default: 0)"
    )
    # The plan file records the cluster and model; these override it.
    add_cluster_arguments(parser, gpus_required=False)
    parser.add_argument(
        "--png",
        metavar="FILE",
        help="also draw a Gantt chart into this PNG (atomically; a symlink is replaced)",
    )


def setup_for_plan(args: argparse.Namespace, plan: _core.Plan, context: dict) -> Setup:
    """The batch and cost model the plan was made for: flags first, then the plan's context."""
    if args.gpus is not None and args.gpus != plan.num_ranks:
        raise ValueError(f"--gpus {args.gpus} does not match the plan's {plan.num_ranks} ranks")
    where = f"{args.plan} context"

    def flag_or_context(flag, read, key, default):  # context fields are type-checked
        return flag if flag is not None else read(context, key, where, default)

    model = model_from_args(args)
    if model is None and isinstance(context.get("model_spec"), dict):
        model = model_spec_from_dict(context["model_spec"], f"{where} model_spec")
    if model is None:
        model = require_str(context, "model", where, "")
    if not model:
        raise ValueError(f"{args.plan} does not name its model: pass --model")
    if args.workload is not None:
        source = args.workload
    elif args.batch is not None:
        source = load_batch(args.batch, model=model, num_ranks=plan.num_ranks)
    elif "workload" in context:
        source = require_str(context, "workload", where)
    elif "batch" in context:
        source = batch_from_dict(context["batch"], model=model, num_ranks=plan.num_ranks)
    else:
        raise ValueError(f"{args.plan} does not carry its batch: pass --batch or --workload")
    setup = make_setup(
        source,
        plan.num_ranks,
        gpus_per_node=flag_or_context(args.gpus_per_node, require_int, "gpus_per_node", 8),
        model=model,
        profile=flag_or_context(args.profile, require_str, "profile", "") or None,
        seed=flag_or_context(args.seed, require_int, "seed", 0),
        links=flag_or_context(args.links, require_str, "links", "nvlink"),
    )
    require_plan_for_batch(plan, context, setup.batch, plan.num_ranks, str(args.plan))
    return setup


def placement_label(placement: _core.Placement) -> str:
    """12 (local), 12u4 (Ulysses over 4), 12r2 (ring over 2), 12h2x2 (hybrid u x r)."""
    strategy = placement.strategy
    if strategy == _core.Strategy.local:
        return str(placement.sequence_id)
    if strategy == _core.Strategy.hybrid:
        return f"{placement.sequence_id}h{placement.ulysses_degree}x{placement.ring_degree}"
    return f"{placement.sequence_id}{strategy.name[0]}{placement.degree()}"


def bar_cells(parts: list[tuple[str, float]], scale: float) -> str:
    """The bar of one rank: `(character, seconds)` parts at `scale` columns per second, rounded
    so that the bar's length is its rounded total and every part with time shows at least one
    character (a short exchange would otherwise vanish from the text while the PNG shows it);
    under a hundredth of a column is rounding residue, not time."""
    total = round(sum(seconds for _, seconds in parts) * scale)
    counts = [max(1, round(s * scale)) if s * scale > 0.01 else 0 for _, s in parts]
    while sum(counts) > max(total, sum(1 for c in counts if c)):
        counts[counts.index(max(counts))] -= 1
    return "".join(char * count for (char, _), count in zip(parts, counts, strict=True))


def text_picture(setup: Setup, plan: _core.Plan) -> list[str]:
    cost = setup.cost_model.evaluate(setup.batch, plan)
    require_finite(setup, "plan", cost.makespan_s, *(rank.time_s for rank in cost.ranks))
    labels: dict[int, list[str]] = defaultdict(list)
    for placement in plan.placements:
        for rank in placement.ranks:
            labels[rank].append(placement_label(placement))
    scale = BAR_COLUMNS / cost.makespan_s
    legend = ", ".join(f"{char} {phase}" for phase, (char, _) in PHASES.items())
    lines = [
        f"{plan.planner} plan on {plan.num_ranks} ranks: makespan {cost.makespan_s:.4f} s; "
        f"bar: {legend}; sequences: id, u/r/h = ulysses/ring/hybrid over that many ranks"
    ]
    for rank, rank_cost in enumerate(cost.ranks):
        parts = []
        for phase, seconds in (
            ("linear", rank_cost.linear_s),
            ("attention", rank_cost.attention_s + rank_cost.call_s),
            ("exchange", rank_cost.exchange_s),
            (
                "launch",
                rank_cost.time_s
                - rank_cost.linear_s
                - rank_cost.attention_s
                - rank_cost.exchange_s
                - rank_cost.call_s,
            ),
        ):
            parts.append((PHASES[phase][0], seconds))
        bar = bar_cells(parts, scale)
        head = f"{rank:>4} {rank_cost.time_s:8.4f} s |{bar[:BAR_COLUMNS]:<{BAR_COLUMNS}}| "
        lines.append(head + _fit(labels[rank], LINE_COLUMNS - len(head)))
    return lines


def _fit(labels: list[str], columns: int) -> str:
    """Space-separated labels, cut to `columns` with a count of what was left out."""
    text = ""
    for i, label in enumerate(labels):
        more = f" +{len(labels) - i} more"
        if len(text) + 1 + len(label) + len(more) > columns and i < len(labels) - 1:
            return text + more
        text += (" " if text else "") + label
    return text


def draw_png(setup: Setup, plan: _core.Plan, path: str) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    segments = _core.simulate(setup.batch, plan, setup.cost_model)
    # one collection of rectangles per phase: an artist per rank rescales the axes each time,
    # which grows with the square of the ranks
    boxes: dict[str, list[list[tuple[float, float]]]] = defaultdict(list)
    for segment in segments:
        x0, x1, y0, y1 = segment.start_s, segment.end_s, segment.rank - 0.4, segment.rank + 0.4
        boxes[segment.phase].append([(x0, y0), (x0, y1), (x1, y1), (x1, y0)])
    makespan_s = max(segment.end_s for segment in segments)
    lower_bound_s = lower_bound(setup)
    height_in = min(40.0, 1.5 + 0.22 * plan.num_ranks)
    fig, ax = plt.subplots(figsize=(12, height_in))
    for phase, rectangles in boxes.items():
        ax.add_collection(
            PolyCollection(
                rectangles, facecolors=PHASES[phase][1], edgecolor="white", linewidth=0.3
            ),
            autolim=False,
        )
    ax.set_xlim(0.0, max(makespan_s, lower_bound_s) * 1.02)
    # Sequence ids on the attention blocks wide enough to hold them (a few ranks' worth of text).
    if plan.num_ranks <= 64:
        labels = {p.sequence_id: placement_label(p) for p in plan.placements}
        for segment in segments:
            width_s = segment.end_s - segment.start_s
            if segment.phase == "attention" and width_s > 0.03 * makespan_s:
                ax.text(
                    segment.start_s + width_s / 2,
                    segment.rank,
                    labels[segment.sequence_id],
                    ha="center",
                    va="center",
                    fontsize=7,
                )
    ax.axvline(makespan_s, color="black", linewidth=1.0)
    ax.axvline(lower_bound_s, color="black", linewidth=1.0, linestyle="--")
    ax.set_ylim(plan.num_ranks - 0.5, -0.5)
    ax.set_xlabel("time in the step (s)")
    ax.set_ylabel("rank")
    source = (
        f"{setup.workload} (seed {setup.seed})"
        if setup.workload
        else f"a batch of {len(setup.batch.sequences)} sequences"
    )
    ax.set_title(
        f"{plan.planner} on {plan.num_ranks} GPUs: {source}, {setup.model_name}; "
        f"makespan {makespan_s:.4f} s, lower bound {lower_bound_s:.4f} s"
    )
    present = set(boxes)  # no legend entry for a phase that is not drawn
    handles = [
        Patch(color=color, label=PNG_LABELS[phase])
        for phase, (_, color) in PHASES.items()
        if phase in present
    ]
    handles += [
        plt.Line2D([], [], color="black", linewidth=1.0, label="makespan"),
        plt.Line2D([], [], color="black", linewidth=1.0, linestyle="--", label="lower bound"),
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    write_output(path, image.getvalue())


def run(args: argparse.Namespace) -> int:
    check_outputs(
        {"--png": args.png},
        {
            "PLAN.json": args.plan,
            "--batch": args.batch,
            "--profile": args.profile,
            "--model-spec": args.model_spec,
        },
    )
    plan, context = load_plan_with_context(args.plan)
    setup = setup_for_plan(args, plan, context)
    _core.validate_plan(plan, setup.batch, plan.num_ranks, setup.cost_model.model.num_heads)
    for line in text_picture(setup, plan):
        print(output_line(line))
    if args.png:
        draw_png(setup, plan, args.png)
        print(output_line(f"wrote {args.png}"))
    return 0
