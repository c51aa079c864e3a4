"""`zellige profile`: measures what the cost model reads and writes it as a profile JSON object.

What is measured, and how it maps onto the cost model (cpp/src/cost_model.cc):
- attention forward/backward per head by segment length, through the engine's coalesced call,
  with segments of one length grouped as the engine groups them (a pack of about
  `PACK_TOKENS` tokens, so short segments are timed as they run: never alone);
- attention calls by length and total heads (`attention_call_*`): a call of few heads (a Ulysses
  shard, a lone sequence) runs slower per head than a full pack;
- the host time to issue one layer and one attention call (`launch_s_*`), from training steps
  of tiny ranks whose GPU work is shorter than their issue;
- the per-token layers of the model preset (real zellige.model blocks with both attention cores
  removed) by token count, stored as the GEMM rates that make the cost model's formula
  `flops / rate + elementwise bytes / bandwidth` reproduce the measured times;
- memory per token and layer kept for backward with and without activation checkpointing, and
  the transient of one layer's backward, from the allocator around real blocks;
- the device memory the process holds outside its tensors (context, library workspaces);
- all-to-all time by bytes and group size when several GPUs are visible (see exchange.py).

Times of kernels are GPU times (timing.gpu_time_s: host launch overhead hidden); the host's
issue time enters the cost model once, as the launch floor.
"""

from __future__ import annotations

import datetime
import math
import platform
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from zellige import _core
from zellige.profiler import rank_work
from zellige.profiler.launch import (
    profile_launch,
    ragged_line,
    warm,
)
from zellige.profiler.memory import (
    local_lengths_plan,
    local_pack_plan,
    measured_table,
    merge_memory,
    profile_memory,
)
from zellige.profiler.models import (
    block_kinds,
    dit_config,
    load_block_factory,
    model_flag,
    model_name,
    model_spec,
    stack_layers,
)
from zellige.profiler.timing import (
    gpu_time_s,
    median_time_s,
)
from zellige.runtime import EngineConfig

PACK_TOKENS = 16384  # tokens of equal-length segments one coalesced call sees on a typical rank
# The cost model's elementwise traffic per token and width per pass (kElementwiseBytesPerTokenWidth)
ELEMENTWISE_BYTES_PER_TOKEN_WIDTH = 24

FULL_ATTENTION_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
FULL_TOKEN_COUNTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
CALL_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
QUICK_ATTENTION_LENGTHS = (64, 128, 256)
QUICK_CALL_LENGTHS = (64, 256)
# check_in_step: whole training steps (of stack_layers(model) layers) of the per-token layers
# at these token counts, and of attention packs of these lengths (at least PACK_TOKENS tokens a
# pack).
IN_STEP_TOKENS = (16384, 32768, 65536)
QUICK_IN_STEP_TOKENS = (128, 256)
# profile_layouts: (sequence tokens, degree) of the Ulysses and ring shards timed
LAYOUT_POINTS = {
    "ulysses": ((32768, 2), (32768, 4), (65536, 8)),
    "ring": ((32768, 2), (65536, 4), (65536, 8)),
}
QUICK_LAYOUT_POINTS = {"ulysses": ((256, 2),), "ring": ((256, 2),)}
QUICK_TOKEN_COUNTS = (64, 128, 256)

Progress = Callable[[str], None]


@dataclass(kw_only=True, slots=True)
class ProfileOptions:
    model: str | _core.ModelSpec = "wan-14b"  # a preset name or a spec file's ModelSpec
    quick: bool = False  # a few small points: a smoke test (the only mode allowed on a CPU)
    device: str = "cuda"
    repeats: int = 5
    attention_backend: str | None = None  # engine kernel override; None = the engine's choice
    block: str | None = None  # module:factory of the user's block for the per-token layers
    # the blocks' per-token regions torch.compile'd (zellige.model.fused), as training runs
    # them on a GPU; the command sets fused.use_compiled from it before measuring
    compiled: bool = False


@dataclass(kw_only=True, slots=True)
class ProfileResult:
    profile: dict  # the profile JSON object (zellige.profile schema)
    details: dict = field(default_factory=dict)  # what the schema has no field for


def _versions(device: torch.device) -> str:
    parts = [f"torch {torch.__version__}", f"python {platform.python_version()}"]
    if device.type == "cuda":
        parts.append(f"CUDA {torch.version.cuda}")
        if torch.backends.cudnn.is_available():
            parts.append(f"cuDNN {torch.backends.cudnn.version()}")
    return ", ".join(parts)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()})"


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, size: int, repeats: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    seconds = median_time_s(lambda: a @ b, device, repeats=repeats)
    return 2.0 * size**3 / seconds


def measure_copy_bandwidth(device: torch.device, num_bytes: int, repeats: int) -> float:
    """Device copy rate counting bytes read plus bytes written."""
    source = torch.randn(num_bytes // 4, device=device)
    dest = torch.empty_like(source)
    seconds = median_time_s(lambda: dest.copy_(source), device, repeats=repeats)
    return 2.0 * source.numel() * 4 / seconds


def measure_attention(
    *,
    length: int,
    heads_per_call: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    backend: str | None,
    repeats: int,
) -> tuple[float, float]:
    """Forward and backward seconds PER HEAD of one coalesced call over `heads_per_call`
    (segment, head) pairs of `length` tokens (segments side by side, token-major rows)."""
    from zellige.runtime import SegmentTable, coalesced_attention

    num_heads = heads_per_call
    # One segment with all pairs as heads is the same dense batch the engine forms from
    # heads_per_call / N segments of N heads (heads are folded into the batch).
    table = SegmentTable.build([0], [0], [length], [length], [num_heads], device)
    rows = length * num_heads
    q, k, v = (
        torch.randn(rows, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "qkv"
    )
    grad_o = torch.randn(rows, head_dim, device=device, dtype=dtype)

    def forward():
        return coalesced_attention(q, k, v, table, backend=backend)

    forward_s = gpu_time_s(forward, device, repeats=repeats)
    out = forward()
    backward_s = gpu_time_s(
        lambda: torch.autograd.grad(out, (q, k, v), grad_o, retain_graph=True),
        device,
        repeats=repeats,
    )
    return forward_s / heads_per_call, backward_s / heads_per_call


def heads_per_call(length: int, num_heads: int) -> int:
    """(segment, head) pairs in one call: a pack of PACK_TOKENS tokens of this length."""
    return num_heads * max(1, PACK_TOKENS // length)


def _measure_call(
    options: ProfileOptions, device, dtype, head_dim: int, length: int, heads: int
) -> tuple[float, float]:
    """measure_attention with the profile's backend and repeats."""
    return measure_attention(
        length=length,
        heads_per_call=heads,
        head_dim=head_dim,
        device=device,
        dtype=dtype,
        backend=options.attention_backend,
        repeats=options.repeats,
    )


def profile_attention(
    options: ProfileOptions, device, dtype, num_heads: int, head_dim: int, progress: Progress
) -> tuple[dict, dict]:
    lengths = QUICK_ATTENTION_LENGTHS if options.quick else FULL_ATTENTION_LENGTHS
    forward, backward = [], []
    for length in lengths:
        pairs = heads_per_call(length, num_heads)
        f_s, b_s = _measure_call(options, device, dtype, head_dim, length, pairs)
        forward.append(f_s)
        backward.append(b_s)
        flops = 4.0 * length**2 * head_dim
        progress(
            f"attention L={length:>6} x {pairs:>4} heads: fwd {flops / f_s / 1e12:6.1f} "
            f"bwd {2.5 * flops / b_s / 1e12:6.1f} TFLOP/s"
        )
    return measured_table(lengths, forward), measured_table(lengths, backward)


def call_heads(length: int, num_heads: int) -> list[int]:
    """Total heads of the calls measured at `length`: few (Ulysses shards of num_heads / u), the
    model's heads, and doublings up to the full pack of the per-head table."""
    few = {1, 2, 4} | {max(1, num_heads // u) for u in (8, 4, 2)}
    full = heads_per_call(length, num_heads)
    doublings = {num_heads * 2**k for k in range(12) if num_heads * 2**k <= full}
    return sorted(h for h in few | doublings | {full} if h <= full)


def profile_attention_calls(
    options: ProfileOptions, device, dtype, num_heads: int, head_dim: int, progress: Progress
) -> tuple[list[int], list[dict], list[dict]]:
    """Seconds of one call by total heads (x) at each call length: the profile's call tables."""
    lengths = QUICK_CALL_LENGTHS if options.quick else CALL_LENGTHS
    forward_tables, backward_tables = [], []
    for length in lengths:
        heads = call_heads(length, num_heads)
        forward, backward = [], []
        for h in heads:
            f_s, b_s = _measure_call(options, device, dtype, head_dim, length, h)
            forward.append(f_s * h)
            backward.append(b_s * h)
        forward_tables.append(measured_table(heads, forward))
        backward_tables.append(measured_table(heads, backward))
        progress(
            f"attention calls L={length:>6}: per head at {heads[0]} / {num_heads} / {heads[-1]} "
            f"heads: fwd {forward[0] / heads[0] * 1e6:8.2f} / "
            f"{forward[heads.index(num_heads)] / num_heads * 1e6:8.2f} / "
            f"{forward[-1] / heads[-1] * 1e6:8.2f} us"
        )
    return list(lengths), forward_tables, backward_tables


def check_in_step(
    options: ProfileOptions, device, dtype, profile: dict, progress: Progress
) -> dict:
    """Kernels timed alone must run as they do inside a training step. Whole steps (checkpointing
    on) of local packs, with the self-attention core and with a stand-in, give per token count
    the ratio of the per-token layers' GEMM time in a step to the profile's, and per length that
    of attention. The ratios are reported, not applied: behind the timing's GEMM queue they came
    out 0.92-1.01 on the H200, within the noise of a difference of two step times (attention is
    a third of a 16k-token step), and scaling the tables by that noise misled the planners
    (bench/results/profile_h200_202611.md). A ratio far from 1 fails the run."""
    from zellige.costs import make_cost_model
    from zellige.profile import profile_from_dict

    config = dit_config(options.model)
    num_layers = stack_layers(options.model)
    spec = model_spec(options.model, num_layers=num_layers)
    cost_model = make_cost_model(spec, gpus=1, profile=profile_from_dict(profile))
    blocks = rank_work.make_blocks(config, num_layers, device, dtype)
    repeats = max(options.repeats, 3)

    def step_s(inputs) -> float:
        return median_time_s(
            lambda: rank_work.train_step(blocks, inputs, checkpointing=True),
            device,
            repeats=repeats,
        )

    points = QUICK_IN_STEP_TOKENS if options.quick else IN_STEP_TOKENS
    pack = points[-1] if options.quick else PACK_TOKENS
    linear_s, linear_factor, attention_factor = {}, {}, {}
    for tokens in sorted({*points, *(max(length, pack) for length in points)}):
        inputs = per_token_inputs(config, tokens, device, dtype)
        linear_s[tokens] = step_s(inputs)
    # The elementwise term of CostModel::linear_time_s is not a GEMM: left as it is.
    passes = 3  # forward, recompute, backward
    for tokens in points:
        elementwise_s = (
            ELEMENTWISE_BYTES_PER_TOKEN_WIDTH
            * config.width
            * dtype.itemsize
            * tokens
            * passes
            / profile["memory_bytes_per_s"]
            * num_layers
        )
        predicted = cost_model.linear_time_s(tokens) - elementwise_s
        linear_factor[tokens] = (linear_s[tokens] - elementwise_s) / predicted
    forward = profile_from_dict(profile).attention_forward_s_per_head
    backward = profile_from_dict(profile).attention_backward_s_per_head
    for length in points:
        tokens = max(length, pack)
        count = tokens // length
        batch, plan = local_pack_plan(count * length, 0, count)
        inputs = rank_work.plan_rank_inputs(
            batch=batch, plan=plan, rank=0, config=config, device=device, dtype=dtype
        )
        if not config.joint_attention:
            inputs.cross_attention = rank_work.no_cross_attention
        measured = step_s(inputs) - linear_s[tokens]
        # one forward and one backward: the recompute keeps attention's outputs (checkpointed())
        predicted = num_layers * count * config.num_heads * (forward(length) + backward(length))
        attention_factor[length] = measured / predicted
    progress(
        "in-step check (step / kernels alone): per-token GEMMs "
        + ", ".join(f"M={m}: {f:.3f}" for m, f in linear_factor.items())
        + "; attention "
        + ", ".join(f"L={n}: {f:.3f}" for n, f in attention_factor.items())
    )
    for factor in (*linear_factor.values(), *attention_factor.values()):
        if not options.quick and not 0.8 < factor < 1.25:  # quick: numbers mean nothing
            raise RuntimeError(
                f"a whole step runs {factor:.3f}x the time its kernels take alone (expected "
                "0.8-1.25): the GPU is busy with other work, or a measurement failed; re-run "
                "`zellige profile`"
            )
    return {
        "linear_factor": {str(k): v for k, v in linear_factor.items()},
        "attention_factor": {str(k): v for k, v in attention_factor.items()},
        "linear_step_s": {str(k): v for k, v in linear_s.items()},
    }


def ulysses_sent_bytes(
    length: int, degree: int, num_heads: int, head_dim: int, bytes_per_element: int
) -> tuple[float, float]:
    """(sent, received) bytes of rank 0 of a sequence of `length` tokens under Ulysses `degree`,
    in one pass (q, k, v out and o back), as CostModel::rank_terms counts them."""
    chunk = length // degree + (1 if length % degree else 0)
    heads = num_heads // degree + (1 if num_heads % degree else 0)
    qkv_send = chunk * (num_heads - heads) * head_dim * bytes_per_element
    qkv_recv = (length - chunk) * heads * head_dim * bytes_per_element
    return 3.0 * qkv_send + qkv_recv, 3.0 * qkv_recv + qkv_send


def _time_distributed_attention(step, config, device, dtype, repeats: int) -> tuple[float, float]:
    """GPU seconds of the engine's distributed attention of the rank of `step` over random q, k, v
    of its tokens: forward, and backward."""
    from zellige.runtime.attention import distributed_attention

    shape = (int(sum(step.program.chunk_num_tokens)), config.num_heads, config.head_dim)
    q, k, v = (torch.randn(*shape, device=device, dtype=dtype).requires_grad_(True) for _ in "qkv")
    grad = torch.randn(*shape, device=device, dtype=dtype)
    forward_s = gpu_time_s(lambda: distributed_attention(q, k, v, step), device, repeats=repeats)
    out = distributed_attention(q, k, v, step)
    backward_s = gpu_time_s(
        lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
        device,
        repeats=repeats,
    )
    return forward_s, backward_s


def _layout_point(
    options: ProfileOptions,
    device,
    dtype,
    memory_bytes_per_s: float,
    strategy: str,
    length: int,
    degree: int,
    call_cache: dict,
) -> dict:
    """One shard of a sequence of `length` tokens under `strategy` over `degree` ranks: rank 0's
    distributed attention (forward + backward, exchanges as local copies), the calls it runs
    and the copies, and the bytes it sends in that forward and backward, as CostModel counts
    them."""
    config = dit_config(options.model)
    batch, _ = local_lengths_plan([length], 0)
    plan = _core.Plan()
    plan.planner = "profile"
    plan.num_ranks = degree
    plan.placements = [
        _core.make_placement(0, getattr(_core.Strategy, strategy), list(range(degree)))
    ]
    step = rank_work.local_step(batch, plan, config.num_heads, device)
    forward_s, backward_s = _time_distributed_attention(
        step, config, device, dtype, options.repeats
    )

    def call_s(call_length: int, heads: int) -> float:
        key = (call_length, heads)
        if key not in call_cache:
            call_cache[key] = sum(
                _measure_call(options, device, dtype, config.head_dim, call_length, heads)
            )
        return heads * call_cache[key]

    bpe = dtype.itemsize
    if strategy == "ulysses":
        heads = config.num_heads // degree + (1 if config.num_heads % degree else 0)
        calls_s = call_s(length, heads)
        sent, received = ulysses_sent_bytes(length, degree, config.num_heads, config.head_dim, bpe)
        sent_bytes, copied_bytes = 2 * sent, 2 * received  # one forward and one backward pass
    else:  # ring: one call per step, every block but rank 0's own one comes in
        block = length // degree
        calls_s = degree * call_s(block, config.num_heads)
        kv_bytes = 2.0 * block * config.num_heads * config.head_dim * bpe
        sent_bytes = copied_bytes = 3 * (degree - 1) * kv_bytes  # k/v forward, + dk/dv backward
    copies_s = 2.0 * copied_bytes / memory_bytes_per_s  # each message read and written once
    extra_s = forward_s + backward_s - calls_s - copies_s
    return {
        "forward_s": forward_s,
        "backward_s": backward_s,
        "call_s": calls_s,
        "copies_s": copies_s,
        "sent_bytes": sent_bytes,
        "s_per_byte": max(0.0, extra_s) / sent_bytes,
    }


def profile_layouts(
    options: ProfileOptions, device, dtype, memory_bytes_per_s: float, progress: Progress
) -> tuple[dict[str, float], dict]:
    """Seconds per byte a rank sends in Ulysses and in ring exchanges that the engine spends
    laying rows out around them (packing send buffers, gathering the rows into the calls'
    layouts and back, merging ring steps' partial results): a shard's distributed attention
    with the exchanges as local copies (rank_work.LocalTransport), less its calls and those
    copies, per byte sent; the median over the points of LAYOUT_POINTS, at least 0. Returns
    ({"ulysses": s/B, "ring": s/B}, rows)."""
    call_cache: dict = {}
    values, rows = {}, {}
    for strategy, points in (QUICK_LAYOUT_POINTS if options.quick else LAYOUT_POINTS).items():
        per_byte = []
        for length, degree in points:
            row = _layout_point(
                options, device, dtype, memory_bytes_per_s, strategy, length, degree, call_cache
            )
            rows[f"{strategy} L={length},r={degree}"] = row
            per_byte.append(row["s_per_byte"])
        values[strategy] = float(np.median(per_byte))
        progress(
            f"{strategy} layout: {values[strategy] * 1e12:.2f} ps per byte sent ("
            + ", ".join(
                f"L={length}/{degree}: {b * 1e12:.2f}"
                for (length, degree), b in zip(points, per_byte, strict=True)
            )
            + ")"
        )
    return values, rows


def per_token_inputs(config, num_tokens: int, device, dtype):
    """One sequence of `num_tokens` tokens through the per-token layers only (both attention
    cores replaced by stand-ins, rank_work.per_token_inputs). An MMDiT's sequence carries its
    text as training's do, less than half of it (min(text_tokens, num_tokens // 2 - 1) text
    tokens first): a double-stream block then runs both streams' GEMMs, each on its own rows.
    Text and visual counts differ (and are odd at small sizes) so that the first call, which
    torch.compile traces with dynamic shapes, does not tie them to each other or to a weight's
    dimension (128 = head_dim) and specialise the graph."""
    if not config.joint_attention:
        return rank_work.per_token_inputs(
            config=config, num_tokens=num_tokens, device=device, dtype=dtype
        )
    from zellige.model.mmdit import TEXT, VISUAL

    num_text = min(config.text_tokens, num_tokens // 2 - 1)
    modality_T = torch.full((num_tokens,), VISUAL, dtype=torch.int64)
    modality_T[:num_text] = TEXT
    positions_T3 = torch.zeros(num_tokens, 3, dtype=torch.int64)
    positions_T3[:num_text, 0] = torch.arange(num_text)  # text k at (k, 0, 0), as the runtime
    positions_T3[num_text:, 2] = torch.arange(num_tokens - num_text)
    return rank_work.joint_rank_inputs(
        config=config,
        modality_T=modality_T,
        sequence_index_T=torch.zeros(num_tokens, dtype=torch.int64),
        positions_T3=positions_T3,
        attention=rank_work.no_self_attention,
        device=device,
        dtype=dtype,
    )


def _per_token_seconds(
    blocks, config, tokens: int, options: ProfileOptions, device, dtype
) -> tuple[float, float]:
    """GPU seconds of the forward and of the backward of `blocks`' per-token layers over one
    sequence of `tokens` tokens (per_token_inputs). The backward is a forward and backward less
    the forward: a compiled region's backward may run once per graph (its buffers are donated),
    so no graph is kept to run it again."""
    inputs = per_token_inputs(config, tokens, device, dtype)
    params = [inputs.x_TD, *blocks.parameters()]

    def forward():
        if options.block is not None:  # the user's own block: forward(x_TD, attention) -> y_TD
            return blocks(inputs.x_TD, rank_work.no_self_attention)
        return rank_work.forward_blocks(blocks, inputs, checkpointing=False)

    def forward_backward():
        torch.autograd.grad(forward(), params, inputs.grad_TD, allow_unused=True)

    warm(forward_backward, device)
    forward_s = gpu_time_s(forward, device, repeats=options.repeats)
    both_s = gpu_time_s(forward_backward, device, repeats=options.repeats)
    return forward_s, max(both_s - forward_s, 0.05 * both_s)


def profile_per_token_layers(
    options: ProfileOptions, device, dtype, memory_bytes_per_s: float, progress: Progress
) -> tuple[dict, dict, dict]:
    """GEMM rates (FLOP/s) of the per-token layers against the token count M, on one block of
    each kind the model has (models.block_kinds): an MMDiT's double- and single-stream blocks
    are timed apart and their times mixed in the model's proportion of layers, so the rate is
    that of the model's average layer (the cost model prices every layer alike)."""
    spec = model_spec(options.model)
    forward_flops_per_token = _core.layer_forward_flops(spec, 1, 0).linear
    if options.block is None:
        kinds = [
            (name, config, share, rank_work.make_blocks(config, 1, device, dtype))
            for name, config, share in block_kinds(options.model)
        ]
    else:
        config = dit_config(options.model)
        block = load_block_factory(options.block)(spec).to(device=device, dtype=dtype)
        kinds = [(options.block, config, 1.0, block)]
        progress(f"per-token layers: the user's block {options.block}")
    width = kinds[0][1].width
    token_counts = QUICK_TOKEN_COUNTS if options.quick else FULL_TOKEN_COUNTS
    forward_rates, backward_rates, seconds = [], [], {}
    for tokens in token_counts:
        forward_s = backward_s = 0.0
        by_kind = {}
        for name, config, share, blocks in kinds:
            kind_forward_s, kind_backward_s = _per_token_seconds(
                blocks, config, tokens, options, device, dtype
            )
            forward_s += share * kind_forward_s
            backward_s += share * kind_backward_s
            by_kind[name] = {"forward_s": kind_forward_s, "backward_s": kind_backward_s}
        # The cost model adds this elementwise time to flops / rate on every pass.
        elementwise_s = (
            ELEMENTWISE_BYTES_PER_TOKEN_WIDTH * width * dtype.itemsize * tokens / memory_bytes_per_s
        )
        flops = forward_flops_per_token * tokens
        forward_rates.append(flops / max(forward_s - elementwise_s, 0.05 * forward_s))
        backward_rates.append(2.0 * flops / max(backward_s - elementwise_s, 0.05 * backward_s))
        seconds[str(tokens)] = {"forward_s": forward_s, "backward_s": backward_s, **by_kind}
        progress(
            f"per-token layers M={tokens:>6}: fwd {forward_s * 1e3:8.3f} ms "
            f"({flops / forward_s / 1e12:5.1f} TFLOP/s), bwd {backward_s * 1e3:8.3f} ms "
            f"({2 * flops / backward_s / 1e12:5.1f} TFLOP/s)"
            + (
                ""
                if len(kinds) == 1
                else " ("
                + ", ".join(
                    f"{name} {flops / times['forward_s'] / 1e12:5.1f} / "
                    f"{2 * flops / times['backward_s'] / 1e12:5.1f}"
                    for name, times in by_kind.items()
                )
                + ")"
            )
        )
    return (
        measured_table(token_counts, forward_rates),
        measured_table(token_counts, backward_rates),
        seconds,
    )


def profile_device(options: ProfileOptions, progress: Progress = print) -> ProfileResult:
    device = torch.device(options.device)
    if device.type != "cuda" and not options.quick:
        raise ValueError(
            "zellige profile measures a GPU and found none (torch.cuda.is_available() is False); "
            "use --quick for a CPU smoke run whose numbers mean nothing"
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dit_config(options.model)
    spec = model_spec(options.model)
    started = datetime.datetime.now(datetime.UTC)
    progress(
        f"profiling {_device_name(device)} for {model_name(options.model)} ({_versions(device)})"
    )

    gemm_size = 1024 if options.quick else 8192
    matmul_flops_per_s = measure_matmul_peak(device, dtype, gemm_size, options.repeats)
    memory_bytes_per_s = measure_copy_bandwidth(
        device, (8 << 20) if options.quick else (2 << 30), options.repeats
    )
    progress(
        f"GEMM {gemm_size}^3: {matmul_flops_per_s / 1e12:.1f} TFLOP/s; device copy "
        f"{memory_bytes_per_s / 1e12:.2f} TB/s"
    )
    attention_forward, attention_backward = profile_attention(
        options, device, dtype, config.num_heads, config.head_dim, progress
    )
    call_lengths, call_forward, call_backward = profile_attention_calls(
        options, device, dtype, config.num_heads, config.head_dim, progress
    )
    launch = profile_launch(options, device, dtype, progress)
    attention_ragged = ragged_line(device, dtype, config.head_dim, progress)
    layout_s_per_byte, layouts = profile_layouts(
        options, device, dtype, memory_bytes_per_s, progress
    )
    longest = attention_forward["x"][-1]
    attention_flops_per_s = 4.0 * longest**2 * config.head_dim / attention_forward["y"][-1]
    matmul_forward, matmul_backward, layer_seconds = profile_per_token_layers(
        options, device, dtype, memory_bytes_per_s, progress
    )

    memory = None
    runtime_reserved_bytes = 0
    if device.type == "cuda":
        memory = profile_memory(options, device, dtype, progress)
        runtime_reserved_bytes = memory["runtime_reserved_bytes"]
        progress(f"runtime reserve (context, workspaces): {runtime_reserved_bytes / 2**20:.0f} MiB")
    else:
        progress("memory: skipped on CPU (no allocator statistics)")

    exchange_sizes, exchange_tables = [], []
    if device.type == "cuda" and torch.cuda.device_count() > 1 and not options.quick:
        from zellige.profiler.exchange import profile_exchanges

        exchange_sizes, exchange_tables = profile_exchanges(progress)
    else:
        progress("exchanges: one device visible, none measured (the cluster's links are used)")

    profile = {
        "device_name": _device_name(device),
        "created": (
            f"measured by `zellige profile {model_flag(options.model)}"
            f"{f' --block {options.block}' if options.block else ''}"
            f"{' --quick' if options.quick else ''}` on {started:%Y-%m-%d %H:%M} UTC; "
            f"{_versions(device)}; attention: engine coalesced call "
            f"({options.attention_backend or 'automatic backend'}), {dtype}; "
            f"{_compiled_text(options)}"
        ),
        "matmul_flops_per_s": matmul_flops_per_s,
        "attention_flops_per_s": attention_flops_per_s,
        "memory_bytes_per_s": memory_bytes_per_s,
        "attention_head_dim": config.head_dim,
        "attention_forward_s_per_head": attention_forward,
        "attention_backward_s_per_head": attention_backward,
        "attention_call_lengths": call_lengths,
        "attention_call_forward_s": call_forward,
        "attention_call_backward_s": call_backward,
        "attention_ragged": attention_ragged,
        "ulysses_layout_s_per_byte": layout_s_per_byte["ulysses"],
        "ring_layout_s_per_byte": layout_s_per_byte["ring"],
        "matmul_forward_flops_per_s": matmul_forward,
        "matmul_backward_flops_per_s": matmul_backward,
        "exchange_group_sizes": exchange_sizes,
        "exchange_intra_node_s": exchange_tables,
        "exchange_overlap": 0.0,
        "memory_models": [spec.name] if memory else [],
        "activation_bytes_per_token_layer": (
            [memory["activation_bytes_per_token_layer"]] if memory else []
        ),
        "checkpoint_bytes_per_token_layer": (
            [memory["checkpoint_bytes_per_token_layer"]] if memory else []
        ),
        "backward_bytes_per_token_layer": (
            [memory["backward_bytes_per_token_layer"]] if memory else []
        ),
        "text_bytes_per_token_layer": [memory["text_bytes_per_token_layer"]] if memory else [],
        "step_fixed_bytes": [memory["step_fixed_bytes"]] if memory else [],
        "reduce_fixed_bytes": [memory["reduce_fixed_bytes"]] if memory else [],
        "reduce_bytes_per_token": [memory["reduce_bytes_per_token"]] if memory else [],
        "ulysses_bytes_per_token": [memory["ulysses_bytes_per_token"]] if memory else [],
        "ring_bytes_per_token": [memory["ring_bytes_per_token"]] if memory else [],
        "ulysses_exchanged_bytes_per_token": (
            [memory["ulysses_exchanged_bytes_per_token"]] if memory else []
        ),
        "attention_phase_bytes_per_token": (
            [memory["attention_phase_bytes_per_token"]] if memory else []
        ),
        "backward_peak_bytes": [memory["backward_peak_bytes"]] if memory else [],
        # rows of the model measured (memory_models): none on a CPU, where memory is not measured
        "launch_s_per_layer": [launch["launch_s_per_layer"]] if memory else [],
        "launch_s_per_attention_call": [launch["launch_s_per_attention_call"]] if memory else [],
        "runtime_reserved_bytes": runtime_reserved_bytes,
    }
    details = {
        "model": model_name(options.model),
        "launch": launch,
        "layouts": layouts,
        "per_token_layer_seconds": layer_seconds,
        "memory": memory,
        "pack_tokens": PACK_TOKENS,
        "wall_s": (datetime.datetime.now(datetime.UTC) - started).total_seconds(),
    }
    details["in_step"] = check_in_step(options, device, dtype, profile, progress)
    _check_finite(profile)
    return ProfileResult(profile=profile, details=details)


def _check_finite(profile: dict) -> None:
    for key, value in profile.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            _check_finite({f"{key}[{i}]": table for i, table in enumerate(value)})
            continue
        values = value["y"] if isinstance(value, dict) else value
        if isinstance(values, float | int) and not isinstance(values, bool):
            values = [values]
        if isinstance(values, list) and values and isinstance(values[0], float | int):
            if not all(math.isfinite(v) and v >= 0 for v in np.asarray(values, dtype=float)):
                raise RuntimeError(f"profile field {key} has a non-finite or negative value")


def _compiled_text(options: ProfileOptions) -> str:
    return "per-token regions compiled" if options.compiled else "per-token regions eager"


def profile_memory_into(
    base: dict,
    options: ProfileOptions,
    progress: Progress = print,
    save: Callable[[dict], None] | None = None,
    *,
    per_token: bool = False,
) -> ProfileResult:
    """Measures only the per-model rows of `options.model` (memory, host launch time; with
    `per_token`, the per-token rate tables too, measured on its own blocks) and the runtime
    reserve, and returns `base` (a profile JSON object) with that model's row added or
    replaced. The attention, exchange and layout rows are the model's only through its head
    count and head dimension, which the cost model scales: they stay as measured in `base`.
    Memory needs a GPU's allocator: on a CPU (--quick) only the per-token and launch rows are
    measured and the memory rows stay 0 (analytic). `save`, if given, gets the profile as each
    part is measured (per-token tables, then memory rows; the rows still to come as in `base`),
    so a run cut short keeps what it measured."""
    device = torch.device(options.device)
    if device.type != "cuda" and not (per_token and options.quick):
        raise ValueError(
            "zellige profile --memory-only / --base reads the GPU allocator and found no GPU "
            "(a CPU smoke run: --quick --base FILE)"
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = model_spec(options.model)
    now = datetime.datetime.now(datetime.UTC)
    command = "--base" if per_token else "--memory-only"

    def with_rows(rows: dict, tables: dict, measured: str) -> dict:
        profile = merge_memory(base, spec.name, rows, tables)
        if "runtime_reserved_bytes" in rows:
            profile["runtime_reserved_bytes"] = rows["runtime_reserved_bytes"]
        profile["created"] = (
            f"{profile.get('created', '')}; {measured} of {spec.name} measured by `zellige "
            f"profile {command}{' --quick' if options.quick else ''}` on {now:%Y-%m-%d %H:%M} "
            f"UTC ({_versions(device)}; {_compiled_text(options)})"
        )
        _check_finite(profile)
        return profile

    tables, rows, parts = {}, {}, []
    details: dict = {"model": model_name(options.model)}
    if per_token:
        forward, backward, layer_seconds = profile_per_token_layers(
            options, device, dtype, base["memory_bytes_per_s"], progress
        )
        tables = {
            "model_matmul_forward_flops_per_s": forward,
            "model_matmul_backward_flops_per_s": backward,
        }
        details["per_token_layer_seconds"] = layer_seconds
        parts.append("per-token layers")
        if save is not None:
            save(with_rows(rows, tables, "per-token layers (the rest as before)"))
    if device.type == "cuda":
        memory = profile_memory(options, device, dtype, progress)
        rows.update(memory)
        tables["backward_peak_bytes"] = memory["backward_peak_bytes"]
        details["memory"] = memory
        parts.append("memory")
        if save is not None:
            save(with_rows(rows, tables, " and ".join(parts) + " (launch rows as before)"))
    else:
        progress("memory: skipped on CPU (no allocator statistics); its rows stay 0")
    launch = profile_launch(options, device, dtype, progress)
    rows["launch_s_per_layer"] = launch["launch_s_per_layer"]
    rows["launch_s_per_attention_call"] = launch["launch_s_per_attention_call"]
    details["launch"] = launch
    parts.append("launch")
    measured = ", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0]
    return ProfileResult(profile=with_rows(rows, tables, measured), details=details)


def profile_time_into(
    base: dict,
    options: ProfileOptions,
    progress: Progress = print,
    save: Callable[[dict], None] | None = None,
    *,
    call_tables: bool = True,
    launch_only: bool = False,
) -> ProfileResult:
    """Measures only the time rows and returns `base` (a profile JSON object) with them replaced,
    in this order: the host launch rows and per-token rate tables of `options.model` on its own
    blocks; the engine's per-head attention tables at the model's head count; with
    `call_tables`, the attention call tables, the stream count the engine runs on this device
    and the overlap its streams give (attention_calls.measure_stream_overlap). Those last two
    time many distinct call shapes (on an H200 the stream probe and the per-head tables alone
    took over two minutes, bench/results/mmdit_h200_202612.md). Memory rows, exchange
    and layout rows stay as in `base`. `save`, if given, gets the profile after each part, so a
    run cut short keeps what it measured (--details only comes with a finished run).
    `launch_only`: the launch rows alone (the host's issue speed, which moves from one process
    and lease to the next; the GPU's rates stay `base`'s)."""
    from zellige.profiler.attention_calls import measure_stream_overlap
    from zellige.runtime.merging import streams_for_device

    device = torch.device(options.device)
    if device.type != "cuda" and not options.quick:
        raise ValueError(
            "zellige profile --time-only measures a GPU and found none (a CPU smoke run: --quick)"
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = dit_config(options.model)
    spec = model_spec(options.model)
    now = datetime.datetime.now(datetime.UTC)
    profile = dict(base)
    parts: list[str] = []
    details: dict = {"model": model_name(options.model)}

    def stamped(part: str) -> dict:
        parts.append(part)
        profile["created"] = (
            f"{base.get('created', '')}; time rows ({', '.join(parts)}) of {spec.name} measured by "
            f"`zellige profile --time-only{' --quick' if options.quick else ''}` on "
            f"{now:%Y-%m-%d %H:%M} UTC ({_versions(device)}; {_compiled_text(options)})"
        )
        _check_finite(profile)
        if save is not None:
            save(profile)
        return profile

    launch = profile_launch(options, device, dtype, progress)
    details["launch"] = launch
    rows = {key: launch[key] for key in ("launch_s_per_layer", "launch_s_per_attention_call")}
    profile = merge_memory(profile, spec.name, rows)
    stamped("launch")
    if launch_only:
        return ProfileResult(profile=profile, details=details)
    rate_forward, rate_backward, layer_seconds = profile_per_token_layers(
        options, device, dtype, base["memory_bytes_per_s"], progress
    )
    details["per_token_layer_seconds"] = layer_seconds
    tables = {
        "model_matmul_forward_flops_per_s": rate_forward,
        "model_matmul_backward_flops_per_s": rate_backward,
    }
    profile = merge_memory(profile, spec.name, {}, tables)
    stamped("per-token layers")
    forward, backward = profile_attention(
        options, device, dtype, config.num_heads, config.head_dim, progress
    )
    profile.update(
        attention_ragged=ragged_line(device, dtype, config.head_dim, progress),
        attention_head_dim=config.head_dim,
        attention_forward_s_per_head=forward,
        attention_backward_s_per_head=backward,
        attention_flops_per_s=4.0 * forward["x"][-1] ** 2 * config.head_dim / forward["y"][-1],
    )
    stamped("attention per head")
    if not call_tables:
        return ProfileResult(profile=profile, details=details)
    call_lengths, call_forward, call_backward = profile_attention_calls(
        options, device, dtype, config.num_heads, config.head_dim, progress
    )
    profile.update(
        attention_call_lengths=call_lengths,
        attention_call_forward_s=call_forward,
        attention_call_backward_s=call_backward,
    )
    stamped("attention calls")
    streams = streams_for_device(device, EngineConfig.from_env())
    overlap = measure_stream_overlap(
        device, streams, num_heads=config.num_heads, head_dim=config.head_dim,
        quick=options.quick, repeats=options.repeats, progress=progress,
    )  # fmt: skip
    details["stream_overlap"] = overlap
    profile.update(
        attention_streams=streams,
        attention_stream_overlap=overlap["attention_stream_overlap"],
    )
    return ProfileResult(profile=stamped("attention streams"), details=details)
