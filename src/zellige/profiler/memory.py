"""Memory rows of a hardware profile: the peaks of packs and shards probed on one device, fitted
to the rows the cost model reads (profile_memory), and merged into a profile (merge_memory).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from zellige import _core
from zellige.profile import MODEL_ROWS, MODEL_TABLES
from zellige.profiler import rank_work
from zellige.profiler.models import (
    dit_config,
    stack_layers,
)
from zellige.profiler.timing import (
    allocated_bytes,
    peak_allocated_bytes,
    release_burn,
    reset_peak,
    synchronize,
)

if TYPE_CHECKING:
    from zellige.profiler.measure import ProfileOptions

# profile_memory's packs (two sequences of the model's text each): the backward peak's rows from
# the first two (large enough that the backward peak is the step's peak), the gradient
# reduction's from the next two (small enough that it is); the backward peak's table
# (backward_peak_bytes) from the first and the last ones together.
FULL_MEMORY_TOKENS = (16384, 65536)
FULL_REDUCE_TOKENS = (1280, 4096)  # not 1024: as many visual rows as text rows
FULL_CHECK_TOKENS = (8192, 32768, 98304)
# profile_memory: held tokens of the Ulysses and ring shards probed (a sequence of twice as
# many over 2 ranks) and of the local sequence they are compared with
FULL_SHARD_TOKENS = 16384
ULYSSES_WIDE_DEGREE = 8  # a second Ulysses shard probe, over this many ranks
QUICK_SHARD_TOKENS = 64
QUICK_MEMORY_TOKENS = (64, 128)
QUICK_REDUCE_TOKENS = (16, 32)
QUICK_CHECK_TOKENS = (96,)

Progress = Callable[[str], None]


def measured_table(x: list[float], y: list[float]) -> dict:
    return {"source": "measured", "x": [float(v) for v in x], "y": [float(v) for v in y]}


def local_lengths_plan(lengths: list[int], text_tokens: int) -> tuple[_core.Batch, _core.Plan]:
    """Sequences of these lengths, `text_tokens` each, all local on rank 0 of 1."""
    return rank_work.local_plan([(n, text_tokens) for n in lengths])


def local_pack_plan(
    num_tokens: int, text_tokens: int, num_sequences: int = 2
) -> tuple[_core.Batch, _core.Plan]:
    """`num_sequences` equal sequences of num_tokens in total, all local on rank 0 of 1. A pack,
    not one sequence: real ranks hold several, and the model's cross-attention gathers their
    rows (a single sequence takes a copy-free path that would under-count)."""
    return local_lengths_plan([num_tokens // num_sequences] * num_sequences, text_tokens)


def rank_plan(sequences: list[tuple[int, int, str, list[int]]]) -> tuple[_core.Batch, _core.Plan]:
    """A batch and plan from (visual tokens, text tokens, strategy, ranks) per sequence (source
    rank 0); the memory probes measure rank 0."""
    batch = _core.Batch()
    batch.sequences = [
        _core.sequence_from_tokens(i, "video", n, text, 0)
        for i, (n, text, _, _) in enumerate(sequences)
    ]
    plan = _core.Plan()
    plan.planner = "profile"
    plan.num_ranks = max(max(ranks) for *_, ranks in sequences) + 1
    plan.placements = [
        _core.make_placement(i, getattr(_core.Strategy, strategy), ranks)
        for i, (_, _, strategy, ranks) in enumerate(sequences)
    ]
    return batch, plan


def shard_probe_plans(held: int, text: int, wide_degree: int) -> dict[str, list]:
    """profile_memory's shard probes (rank_plan's sequences; attention_phase_rows reads them by
    name): `held` tokens as one local sequence, as a Ulysses or ring shard over 2 ranks and a
    Ulysses shard over `wide_degree`; each shard beside a local sequence of `held` (the
    attention's phases: attention_phase_rows)."""
    local = (held, text, "local", [0])
    plans = {
        "local_shard": [local],
        "ulysses_shard_2": [(2 * held, text, "ulysses", [0, 1])],
        "ring_shard_2": [(2 * held, text, "ring", [0, 1])],
    }
    if wide_degree > 2:
        plans[f"ulysses_shard_{wide_degree}"] = [
            (wide_degree * held, text, "ulysses", list(range(wide_degree)))
        ]
    for strategy in ("ring", "ulysses"):
        plans[f"{strategy}_beside_local"] = [(2 * held, text, strategy, [0, 1]), local]
    return plans


CALLS_SEQUENCES = 8  # profile_memory's check pack of distinct lengths


def _distinct_lengths(total: int) -> list[int]:
    """CALLS_SEQUENCES distinct lengths, rising, that sum to `total` (>= 8 * CALLS_SEQUENCES)."""
    base = total // (2 * CALLS_SEQUENCES)
    step = max(1, (total - CALLS_SEQUENCES * base) * 2 // (CALLS_SEQUENCES * (CALLS_SEQUENCES - 1)))
    lengths = [base + i * step for i in range(CALLS_SEQUENCES)]
    lengths[-1] += total - sum(lengths)
    return lengths


@dataclass(frozen=True, slots=True)
class MemoryProbe:
    """Bytes of one memory probe (one pack on FSDP blocks, as validate-profile runs a rank)."""

    inputs: int  # the step's inputs: layer input, text, modulation, RoPE tables, layout
    kept: int  # kept after forward without checkpointing
    transient: int  # peak above that during backward
    kept_checkpointing: int  # the same with checkpointing
    transient_checkpointing: int

    @property
    def step_peak(self) -> int:
        """Peak above what the rank held before the step, with checkpointing."""
        return self.inputs + self.kept_checkpointing + self.transient_checkpointing


def _memory_probe(blocks, inputs, checkpointing: bool, device) -> tuple[int, int]:
    """(bytes kept after forward, peak bytes above that during backward)."""
    synchronize(device)
    before = allocated_bytes(device)
    out = rank_work.forward_blocks(blocks, inputs, checkpointing)
    after_forward = reset_peak(device)
    loss = rank_work.output_loss(out)
    del out  # training holds no output beside the graph either
    loss.backward()
    peak = peak_allocated_bytes(device)
    rank_work.clear_grads(None, inputs)  # FSDP keeps its sharded gradients, as in training
    return after_forward - before, peak - after_forward


def pack_probe(
    blocks, batch: _core.Batch, plan: _core.Plan, config, device, dtype, rank: int = 0
) -> MemoryProbe:
    """The memory probe of `rank` under `plan` on `blocks` (make_fsdp_blocks), its exchanges
    replaced by local copies of the same sizes (rank_work.LocalTransport): a rank of a Ulysses
    group or ring is emulated on one device with the buffers it holds there."""
    synchronize(device)
    before_inputs = allocated_bytes(device)
    inputs = rank_work.plan_rank_inputs(
        batch=batch,
        plan=plan,
        rank=rank,
        config=config,
        device=device,
        dtype=dtype,
        output_grad=False,
    )
    synchronize(device)
    inputs_bytes = allocated_bytes(device) - before_inputs
    rank_work.train_step(blocks, inputs, checkpointing=True)  # warm-up: workspaces
    kept, transient = _memory_probe(blocks, inputs, False, device)
    kept_ckpt, transient_ckpt = _memory_probe(blocks, inputs, True, device)
    return MemoryProbe(inputs_bytes, kept, transient, kept_ckpt, transient_ckpt)


def rank_attention_calls(
    batch: _core.Batch, plan: _core.Plan, num_heads: int, joint_attention: bool, rank: int = 0
) -> tuple[int, list[float]]:
    """`rank`'s held tokens and its attention calls in the order its backward runs them (local
    table, exchanged table, ring steps; one after another on one stream), each as its query
    token-heads / num_heads: the tokens of a call of every head with as many query rows."""
    from zellige.runtime.layout import prepare_step

    step = prepare_step(
        batch, plan, num_heads, "cpu", rank=rank, check_agreement=False,
        joint_attention=joint_attention,
    )  # fmt: skip

    def calls(table) -> list[float]:
        groups = () if table is None else (*table.padded, *table.groups)
        return [g.count * g.q_len * g.num_heads / num_heads for g in groups]

    found = calls(step.local_table) + calls(step.exchange_table)
    if step.ring.num_rows:
        found += calls(step.ring.step0) + [c for s in step.ring.steps for c in calls(s.table)]
    return int(step.num_held_tokens), found


def attention_phase_rows(
    probes: dict[str, dict], one_phase_peak: Callable[[float], float] | None = None
) -> dict:
    """HardwareProfile::attention_phase_bytes_per_token and the shard rows from probes of one
    rank (`probes`: name -> {"held_tokens", "calls", "step_peak"}, bench/memory_calls_probe.py
    and profile_memory name them alike), n held tokens each unless said:
    - "local_shard" (one local sequence), "ring_shard_2" / "ulysses_shard_2" (a shard over 2
      ranks), "ulysses_shard_<u>" (over u > 2): ring_bytes_per_token, ulysses_bytes_per_token
      and ulysses_exchanged_bytes_per_token, what a shard holds beyond a local sequence of as
      many tokens;
    - "<s>_beside_local" (the shard beside a local sequence of n), s = ring, ulysses: the cost
      model prices it as a rank of one phase of 2n tokens (`one_phase_peak(2n)`: the packs' step
      peaks read linearly between them, as it reads backward_peak_bytes) plus the shard row x n,
      less this row x n (the local calls' buffers are gone before the shard's phase): the row is
      the mean over s of what the pair holds less, per token of its smaller phase, never below 0;
    - reported only: "per_call_bytes_per_token" ("one_call" against "eight_calls", equal
      attended tokens: what a rank of several calls in one phase holds less per token outside
      its largest call; the cost model charges it none), and "<s>_shard_2_double" (one shard
      of 2n) as "<s>_bytes_per_token_at_2n" (the shard row where its shard holds 2n)."""

    def peak(name: str) -> float:
        return float(probes[name]["step_peak"])

    def held(name: str) -> float:
        return float(probes[name]["held_tokens"])

    rows: dict = {}
    if "local_shard" in probes:
        n = held("local_shard")
        for strategy in ("ulysses", "ring"):
            if f"{strategy}_shard_2" in probes:
                rows[f"{strategy}_bytes_per_token"] = (
                    peak(f"{strategy}_shard_2") - peak("local_shard")
                ) / n
        wide = sorted(
            int(name.rsplit("_", 1)[1])
            for name in probes
            if name.startswith("ulysses_shard_") and name.rsplit("_", 1)[1].isdigit()
        )
        if "ulysses_bytes_per_token" in rows and wide and wide[-1] > 2:
            u = wide[-1]
            beyond = (peak(f"ulysses_shard_{u}") - peak("local_shard")) / n
            rows["ulysses_exchanged_bytes_per_token"] = (
                beyond - rows["ulysses_bytes_per_token"]
            ) / ((u - 1) / u - 0.5)
    phase = {}
    for strategy in ("ring", "ulysses"):
        row, pair = f"{strategy}_bytes_per_token", f"{strategy}_beside_local"
        if row not in rows or pair not in probes or one_phase_peak is None:
            continue
        n = held(pair) / 2
        phase[strategy] = (one_phase_peak(held(pair)) + rows[row] * n - peak(pair)) / n
        double = f"{strategy}_shard_2_double"
        if double in probes:
            rows[f"{row}_at_2n"] = (peak(double) - one_phase_peak(held(double))) / held(double)
    if phase:
        rows["attention_phase_bytes_per_token"] = max(0.0, sum(phase.values()) / len(phase))
        rows["attention_phase_bytes_per_token_by_shard"] = phase
    if "one_call" in probes and "eight_calls" in probes:
        one, eight = probes["one_call"], probes["eight_calls"]
        outside = max(one["calls"]) - max(eight["calls"])
        if one["held_tokens"] == eight["held_tokens"] and outside > 0:
            rows["per_call_bytes_per_token"] = (one["step_peak"] - eight["step_peak"]) / outside
    return rows


def linear_peaks(points: dict[float, float]) -> Callable[[float], float]:
    """Step peaks of one-phase packs (held tokens -> bytes) read linearly between them and along
    the end segments beyond (CostModel::backward_peak_correction's reading)."""
    x = sorted(points)
    if len(x) < 2:
        raise ValueError("linear_peaks needs packs at two token counts or more")

    def at(tokens: float) -> float:
        i = max(0, min(len(x) - 2, int(np.searchsorted(x, tokens, side="right")) - 1))
        a, b = x[i], x[i + 1]
        return points[a] + (points[b] - points[a]) / (b - a) * (tokens - a)

    return at


def memory_rows(
    probes: dict[int, MemoryProbe],
    with_text: MemoryProbe | None,
    *,
    num_layers: int,
    num_sequences: int,
    text_tokens: int,
    extra_text_tokens: int,
) -> dict:
    """The cost model's memory rows from probes at two token counts (`probes`, each a pack of
    `num_sequences` sequences of `text_tokens` text tokens) and one at the lower count with
    `extra_text_tokens` more text tokens per sequence. Per token: slopes, so constants drop out;
    the step's fixed bytes: what is left of the lower probe's peak at zero tokens.
    with_text None: a joint-attention model, whose text tokens are attended tokens like the
    visual ones (the cost model charges them per token; its text rows are for cross-attention
    and stay 0)."""
    low, high = min(probes), max(probes)

    def slope(field: str) -> float:
        return (getattr(probes[high], field) - getattr(probes[low], field)) / (high - low)

    activation = slope("kept") / num_layers
    checkpoint = slope("kept_checkpointing") / num_layers
    step_slope = slope("step_peak")
    # Under checkpointing the last layer's recompute rebuilds its activations around what it
    # kept (its input and attention outputs are among them) before its backward; what the step
    # holds beyond the other layers' checkpoints and that activation is the backward row (the
    # cost model's rank_peak_bytes adds them up the same way).
    # The layer's backward frees its activations as it goes, so this can come out below 0
    # (wan-14b on the H200: about -17 KB a token); stored as 0, the cost model's peak errs
    # above, not below.
    backward = max(0.0, step_slope - (num_layers - 1) * checkpoint - activation)
    if with_text is None:
        text = text_kept = 0.0
        step_fixed = probes[low].step_peak - step_slope * (low + num_sequences * text_tokens)
    else:
        text_added = num_sequences * extra_text_tokens
        # one layer's share of the peak (kept + backward buffers), as the cost model charges it
        text = (with_text.step_peak - probes[low].step_peak) / text_added
        text_kept = (with_text.kept - probes[low].kept) / text_added / num_layers
        step_fixed = probes[low].step_peak - step_slope * low - text * num_sequences * text_tokens
    return {
        "activation_bytes_per_token_layer": activation,
        "checkpoint_bytes_per_token_layer": checkpoint,
        "backward_bytes_per_token_layer": backward,
        "backward_bytes_per_token_layer_without_checkpointing": slope("transient")
        + slope("inputs"),
        "text_bytes_per_token_layer": text,
        "text_kept_bytes_per_token_layer": text_kept,
        "step_fixed_bytes": max(0.0, step_fixed),
    }


def reduce_rows(probes: dict[int, MemoryProbe], *, attended_text_tokens: int) -> dict:
    """The rows of the step's other peak moment (HardwareProfile::reduce_fixed_bytes): right
    after the backward of the stack's largest layer (an MMDiT's double-stream block, the first of
    the stack), its gradients being reduced, where a small pack peaks. The line through the step
    peaks of two small packs (`probes`, token count -> probe): per held token, and the bytes at 0
    tokens. `attended_text_tokens`: the text tokens each pack holds besides (a joint model's text
    is held tokens, counted like the visual ones; 0 for a cross-attention model, whose text is
    the same in both packs and so lands in the fixed bytes)."""
    low, high = min(probes), max(probes)
    per_token = (probes[high].step_peak - probes[low].step_peak) / (high - low)
    fixed = probes[low].step_peak - per_token * (low + attended_text_tokens)
    return {"reduce_bytes_per_token": max(0.0, per_token), "reduce_fixed_bytes": max(0.0, fixed)}


def backward_peak_table(
    packs: dict[int, MemoryProbe],
    rows: dict,
    *,
    num_layers: int,
    attended_text_tokens: int,
    text_bytes: float,
) -> dict:
    """HardwareProfile::backward_peak_bytes from packs (token count -> probe) whose peak is the
    backward's: at each pack's held tokens x (a joint model's text among them), its step peak
    minus the layers' kept activations as the rows charge them ((num_layers - 1) checkpoints and
    one layer's activations per token) and minus a cross model's text bytes (`text_bytes`, the
    pack's text at the text row): what the rows' step_fixed_bytes + x * backward_bytes charge
    instead (equal at the two packs the rows come from)."""
    kept_per_token = (num_layers - 1) * rows["checkpoint_bytes_per_token_layer"] + rows[
        "activation_bytes_per_token_layer"
    ]
    x, y = [], []
    for tokens, probe in sorted(packs.items()):
        held = tokens + attended_text_tokens
        x.append(float(held))
        y.append(max(1.0, probe.step_peak - kept_per_token * held - text_bytes))
    return measured_table(x, y)


def profile_memory(options: ProfileOptions, device, dtype, progress: Progress) -> dict:
    """Per token and layer: kept without checkpointing (activation), kept with checkpointing
    (checkpoint), what else the step holds at its peak (backward: one layer's backward
    buffers, the inputs' RoPE tables), per TEXT token what cross-attention adds (text), and the
    step's bytes that do not grow with tokens (step_fixed: gathered weights, weight gradients,
    reduce-scatter buffers). The model's stack (stack_layers: an MMDiT's double and single
    blocks in its proportion) sharded as in training (FSDP2 over a group of one, as
    validate-profile measures ranks), the output's gradient from a loss (rank_work.train_step).
    The step has two peak moments whose lines cross at a few thousand tokens (an MMDiT: about
    10k): the backward of the last layer (recomputed activations, the other layers' checkpoints:
    many bytes per token), and the gradient reduction right after the largest layer's backward
    (its unsharded gradients and reduce-scatter buffers: many fixed bytes, few per token). The
    rows above come from two large packs (FULL_MEMORY_TOKENS), the reduction's (reduce_rows) from
    two small ones (FULL_REDUCE_TOKENS); packs in between (FULL_CHECK_TOKENS) are printed against
    max(both lines) as a check."""
    config = dit_config(options.model)
    num_layers = stack_layers(options.model)
    num_sequences = 2

    def probe(blocks, batch: _core.Batch, plan: _core.Plan) -> MemoryProbe:
        return pack_probe(blocks, batch, plan, config, device, dtype)

    token_counts = QUICK_MEMORY_TOKENS if options.quick else FULL_MEMORY_TOKENS
    reduce_counts = QUICK_REDUCE_TOKENS if options.quick else FULL_REDUCE_TOKENS
    check_counts = QUICK_CHECK_TOKENS if options.quick else FULL_CHECK_TOKENS
    shard_tokens = QUICK_SHARD_TOKENS if options.quick else FULL_SHARD_TOKENS
    low = token_counts[0]
    probes, small, checks = {}, {}, {}
    shards = {}
    # training's process group (NCCL on a GPU) is alive for the probes and the runtime reserve
    with rank_work.process_group_of_one(device):
        blocks = rank_work.make_fsdp_blocks(config, num_layers, device, dtype)
        for counts, into in (
            (token_counts, probes),
            (reduce_counts, small),
            (check_counts, checks),
        ):
            for tokens in counts:
                into[tokens] = probe(
                    blocks, *local_pack_plan(tokens, config.text_tokens, num_sequences)
                )
                progress(
                    f"memory M={tokens:>6}: kept {into[tokens].kept / tokens / num_layers:9.0f} "
                    f"B/token/layer, with checkpointing "
                    f"{into[tokens].kept_checkpointing / tokens / num_layers:7.0f}, step peak "
                    f"{into[tokens].step_peak / 2**20:9.1f} MiB"
                )
        # a check of the per-token rows on a rank of many distinct lengths (one attention call
        # each) instead of one call over the pack: as many attended tokens as the low pack
        distinct = _distinct_lengths(
            max(8 * CALLS_SEQUENCES, low + (num_sequences - CALLS_SEQUENCES) * config.text_tokens)
        )
        calls = probe(blocks, *local_lengths_plan(distinct, config.text_tokens))
        progress(
            f"memory {CALLS_SEQUENCES} distinct lengths {distinct}: step peak "
            f"{calls.step_peak / 2**20:9.1f} MiB (the M={low} pack's: "
            f"{probes[low].step_peak / 2**20:9.1f} MiB, as many attended tokens in one call)"
        )
        with_text = None
        if not config.joint_attention:
            with_text = probe(
                blocks, *local_pack_plan(low, config.text_tokens + low, num_sequences)
            )
        # A joint model's text is held tokens: without it, the shards and the local sequence
        # hold the same shard_tokens (a cross model's text is the same on all three).
        shard_text = 0 if config.joint_attention else config.text_tokens
        wide_degree = min(ULYSSES_WIDE_DEGREE, config.num_heads)  # a head or more per rank
        shard_calls = {}
        for name, sequences in shard_probe_plans(shard_tokens, shard_text, wide_degree).items():
            batch, plan = rank_plan(sequences)
            shards[name] = probe(blocks, batch, plan)
            shard_calls[name] = rank_attention_calls(
                batch, plan, config.num_heads, config.joint_attention
            )
            progress(
                f"memory {name} ({shard_calls[name][0]} held): kept with checkpointing "
                f"{shards[name].kept_checkpointing / 2**20:.1f} MiB, step peak "
                f"{shards[name].step_peak / 2**20:.1f} MiB"
            )
        runtime_reserved_bytes = 0
        if device.type == "cuda":
            own_bytes = rank_work.persistent_bytes(blocks)
            runtime_reserved_bytes = measure_runtime_reserved(device, own_bytes)
        del blocks
    rows = memory_rows(
        probes,
        with_text,
        num_layers=num_layers,
        num_sequences=num_sequences,
        text_tokens=config.text_tokens,
        extra_text_tokens=low,
    )
    attended_text = num_sequences * config.text_tokens if config.joint_attention else 0
    rows.update(reduce_rows(small, attended_text_tokens=attended_text))
    rows["backward_peak_bytes"] = backward_peak_table(
        {**probes, **checks},
        rows,
        num_layers=num_layers,
        attended_text_tokens=attended_text,
        text_bytes=rows["text_bytes_per_token_layer"] * num_sequences * config.text_tokens,
    )
    high = token_counts[-1]
    line_slope = (probes[high].step_peak - probes[low].step_peak) / (high - low)

    def backward_line(tokens: int) -> float:
        return probes[low].step_peak + line_slope * (tokens - low)

    def reduce_line(tokens: int) -> float:
        return rows["reduce_fixed_bytes"] + rows["reduce_bytes_per_token"] * (
            tokens + attended_text
        )

    check_lines = {}
    for tokens, p in sorted({**small, **probes, **checks}.items()):
        backward_at, reduce_at = backward_line(tokens), reduce_line(tokens)
        check_lines[str(tokens)] = {
            "step_peak": p.step_peak,
            "backward_line": backward_at,
            "reduce_line": reduce_at,
        }
        progress(
            f"memory M={tokens:>6}: step peak {p.step_peak / 2**20:9.1f} MiB; backward line "
            f"{backward_at / 2**20:9.1f}, reduction line {reduce_at / 2**20:9.1f}, max of both "
            f"{(max(backward_at, reduce_at) - p.step_peak) / 2**20:+7.1f} MiB off"
        )
    # what a shard holds beyond a local sequence of its tokens, what a wider Ulysses group
    # exchanges more, and the attention buffers held one phase at a time (attention_phase_rows)
    rows.update({"ulysses_exchanged_bytes_per_token": 0.0, "attention_phase_bytes_per_token": 0.0})
    one_phase = linear_peaks(
        {t + attended_text: p.step_peak for t, p in {**probes, **checks}.items()}
    )
    rows.update(
        attention_phase_rows(
            {
                name: {
                    "held_tokens": shard_calls[name][0],
                    "calls": shard_calls[name][1],
                    "step_peak": p.step_peak,
                }
                for name, p in shards.items()
            },
            one_phase,
        )
    )
    progress(
        f"memory per text token: {rows['text_bytes_per_token_layer']:.0f} B; step fixed "
        f"(gathered weights, gradients) {rows['step_fixed_bytes'] / 2**30:.2f} GiB; beyond a "
        f"local sequence: Ulysses {rows['ulysses_bytes_per_token']:.0f} B/token, ring "
        f"{rows['ring_bytes_per_token']:.0f} B/token (2 ranks, {shard_tokens} held), Ulysses "
        f"{rows['ulysses_exchanged_bytes_per_token']:.0f} B/token more per share exchanged; "
        f"attention buffers of one phase {rows['attention_phase_bytes_per_token']:.0f} B/token; at "
        f"the largest layer's gradient reduction {rows['reduce_fixed_bytes'] / 2**30:.2f} GiB + "
        f"{rows['reduce_bytes_per_token']:.0f} B/token"
    )
    return {
        **rows,
        "runtime_reserved_bytes": runtime_reserved_bytes,
        "shard_probes": {name: asdict(p) for name, p in shards.items()},
        "ulysses_wide_degree": wide_degree,
        "probes": {str(t): asdict(p) for t, p in probes.items()},
        "reduce_probes": {str(t): asdict(p) for t, p in small.items()},
        "check_probes": {str(t): asdict(p) for t, p in checks.items()},
        "lines": check_lines,
        "calls_probe": {"lengths": distinct, **asdict(calls)},
        "num_layers": num_layers,
        "probe_with_text": (
            {} if with_text is None else {f"{low}+{config.text_tokens + low}": asdict(with_text)}
        ),
    }


def measure_runtime_reserved(device: torch.device, own_bytes: int = 0) -> int:
    """Device bytes the process holds outside the caching allocator (CUDA context, cuBLAS and
    cuDNN handles, communicators) plus the allocator's bytes still allocated apart from our
    tensors (library workspaces): `own_bytes` are those of ours still alive (the probes' blocks,
    as validate-profile leaves them out of a rank's peak). Assumes this process is alone on the
    GPU."""
    release_burn()  # the timing's GEMM operands are ours, not the runtime's
    gc.collect()
    synchronize(device)
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    outside = total_bytes - free_bytes - torch.cuda.memory_reserved(device)
    return int(outside + torch.cuda.memory_allocated(device) - own_bytes)


def merge_memory(base: dict, model: str, memory: dict, tables: dict | None = None) -> dict:
    """`base` (a profile JSON object) with `model`'s row added or replaced by the fields of
    `memory` (others keep their value; 0, not modelled, in a new row), and its per-token tables
    (`tables`: MODEL_TABLES keys) set where given (others keep theirs; empty, the shared table,
    in a new row)."""
    profile = dict(base)
    models = list(profile.get("memory_models", []))
    columns = {key: list(profile.get(key, [])) for key in MODEL_ROWS}
    for values in columns.values():  # optional columns may be empty: 0 means analytic
        values.extend([0.0] * (len(models) - len(values)))
    table_lists = {key: list(profile.get(key, [])) for key in MODEL_TABLES}
    for values in table_lists.values():  # likewise: an empty table means the shared one
        values.extend(measured_table([], []) for _ in range(len(models) - len(values)))
    if model not in models:
        models.append(model)
        for values in columns.values():
            values.append(0.0)
        for values in table_lists.values():
            values.append(measured_table([], []))
    row = models.index(model)
    for key, values in columns.items():
        values[row] = memory.get(key, values[row])
        profile[key] = values
    for key, values in table_lists.items():
        values[row] = (tables or {}).get(key, values[row])
        # all empty (no model has its own): the field stays empty, as in profiles before it
        profile[key] = values if any(table["x"] for table in values) else []
    profile["memory_models"] = models
    return profile
