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
import gc
import math
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from zellige import _core
from zellige.profile import MODEL_ROWS, MODEL_TABLES
from zellige.profiler import rank_work
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
    allocated_bytes,
    gpu_time_s,
    median_time_s,
    peak_allocated_bytes,
    release_burn,
    reset_peak,
    synchronize,
)
from zellige.runtime import EngineConfig, engine_runs_ragged

PACK_TOKENS = 16384  # tokens of equal-length segments one coalesced call sees on a typical rank
# The cost model's elementwise traffic per token and width per pass (kElementwiseBytesPerTokenWidth)
ELEMENTWISE_BYTES_PER_TOKEN_WIDTH = 24

FULL_ATTENTION_LENGTHS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
FULL_TOKEN_COUNTS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
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
LAUNCH_SEQUENCES = 8  # a tiny rank of this many distinct lengths, against one of one
LAUNCH_VISUAL_TOKENS = 32  # visual tokens of the tiny ranks' first sequence (then +1 each)
# an MMDiT's tiny ranks: text tokens of each sequence (both streams of a double-stream block
# issue their kernels, as in training, where no sequence is without text). Odd, as the text
# split of per_token_inputs: torch.compile's dynamic shapes take a size that equals another
# (e.g. 8 x 16 text rows = head_dim 128) for the same symbol and specialise the graph on it.
LAUNCH_TEXT_TOKENS = 15
# Host-bound steps scatter by +-25% from one to the next, and the host's speed drifts over
# seconds: the two tiny ranks are timed in alternating rounds (interleaved_step_times), so a
# drift falls on both alike and not on their difference (the per-call term).
LAUNCH_ROUNDS = 6
LAUNCH_STEPS_PER_ROUND = 8
QUICK_TOKEN_COUNTS = (64, 128, 256)
QUICK_MEMORY_TOKENS = (64, 128)
QUICK_REDUCE_TOKENS = (16, 32)
QUICK_CHECK_TOKENS = (96,)

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


def _table(x: list[float], y: list[float]) -> dict:
    return {"source": "measured", "x": [float(v) for v in x], "y": [float(v) for v in y]}


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
    return _table(lengths, forward), _table(lengths, backward)


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
        forward_tables.append(_table(heads, forward))
        backward_tables.append(_table(heads, backward))
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
    a third of a 16k-token step), and scaling the tables by that noise misled the planners (run 4
    of bench/results/profile_h200_202611.md). A ratio far from 1 fails the run."""
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
        batch, plan = _local_pack_plan(count * length, 0, count)
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


def _local_plan(lengths: list[int], text_tokens: int) -> tuple[_core.Batch, _core.Plan]:
    """Sequences of these lengths, `text_tokens` each, all local on rank 0 of 1."""
    return rank_work.local_plan([(n, text_tokens) for n in lengths])


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
    batch, _ = _local_plan([length], 0)
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


def profile_launch(options: ProfileOptions, device, dtype, progress: Progress) -> dict:
    """Host seconds to issue one layer apart from its attention calls, and per attention call:
    training steps (checkpointing on) of the model's stack (stack_layers: an MMDiT's double and
    single blocks in its proportion) over tiny ranks, one of 1 sequence and one of
    LAUNCH_SEQUENCES distinct lengths (each a self- and a cross-attention call, or one joint
    attention call), whose GPU work is far shorter than their issue, so their time is the
    issue time; the two timed in alternating rounds (interleaved_step_times)."""
    config = dit_config(options.model)
    num_layers = stack_layers(options.model)
    blocks = rank_work.make_blocks(config, num_layers, device, dtype)

    # An MMDiT's text joins the attended tokens: a few per sequence (its text stream issues its
    # kernels), and one attention call per distinct length; cross-attention models issue two
    # (self + cross).
    text_tokens, calls_per_length = (
        (LAUNCH_TEXT_TOKENS, 1) if config.joint_attention else (config.text_tokens, 2)
    )

    # The rows are per dense call (the cost model counts a ragged table as one of them): the
    # tiny ranks' tables run as groups whatever this machine's merge policy, else the many-length
    # rank's tables would be single ragged calls and the per-call slope would measure nothing.
    groups = EngineConfig.from_env().replace(merge="groups")

    def train_step(lengths: list[int]) -> Callable[[], None]:
        batch, plan = _local_plan(lengths, text_tokens)
        inputs = rank_work.plan_rank_inputs(
            batch=batch, plan=plan, rank=0, config=config, device=device, dtype=dtype,
            engine=groups,
        )  # fmt: skip
        return lambda: rank_work.train_step(blocks, inputs, checkpointing=True)

    steps = [
        train_step([LAUNCH_VISUAL_TOKENS]),
        train_step([LAUNCH_VISUAL_TOKENS + i for i in range(LAUNCH_SEQUENCES)]),
    ]
    for step in steps:
        _warm(step, device)
        _warm(step, device)
    rounds, per_round = (
        (2, max(2, options.repeats))  # a CPU smoke run: its numbers mean nothing
        if options.quick
        else (LAUNCH_ROUNDS, max(options.repeats, LAUNCH_STEPS_PER_ROUND))
    )
    one, many = (
        float(np.median(times))
        for times in interleaved_step_times(steps, device, rounds, per_round)
    )
    per_layer, per_call = launch_rows(
        one, many, calls_per_length, calls_per_length * LAUNCH_SEQUENCES, num_layers
    )
    progress(
        f"host issue time: {per_layer * 1e3:.2f} ms per layer + {per_call * 1e3:.3f} ms per "
        f"attention call (tiny ranks: {one * 1e3:.1f} ms with 1 sequence, {many * 1e3:.1f} ms "
        f"with {LAUNCH_SEQUENCES}, {num_layers} layers)"
    )
    return {
        "launch_s_per_layer": per_layer,
        "launch_s_per_attention_call": per_call,
        "step_s": {"1": one, str(LAUNCH_SEQUENCES): many},
    }


def ragged_line(device, dtype, head_dim: int, progress: Progress) -> bool:
    """The profile's attention_ragged: whether the engine here runs a table of several calls as
    one ragged call (runtime.engine_runs_ragged), said in one line."""
    ragged = engine_runs_ragged(device, dtype, head_dim)
    progress(
        "attention engine: "
        + (
            "a table of several calls runs as one ragged call (cuDNN frontend): "
            "attention_ragged true"
            if ragged
            else "dense calls (no checked ragged kernel, or merge policy groups): "
            "attention_ragged false"
        )
    )
    return ragged


def launch_rows(
    one_s: float, many_s: float, calls_one: int, calls_many: int, num_layers: int
) -> tuple[float, float]:
    """(seconds per layer, per attention call) of host issue from the steps of two tiny ranks
    that make `calls_one` and `calls_many` attention calls a layer: the per-call term is their
    difference, the per-layer term what is left of the first (neither below 0)."""
    per_call = max(0.0, (many_s - one_s) / (calls_many - calls_one) / num_layers)
    return max(0.0, one_s / num_layers - calls_one * per_call), per_call


def interleaved_step_times(
    fns: list[Callable[[], object]], device, rounds: int, per_round: int
) -> list[list[float]]:
    """Seconds of every timed run of each fn (timing.median_time_s's runs), timed in `rounds`
    rounds that each run fn 0 `per_round` times, then fn 1, ...: a drift of the host's speed
    during the measurement falls on every fn alike. The fns are warm (no warm-up here)."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, samples in zip(fns, times, strict=True):
            median_time_s(fn, device, warmup=0, repeats=per_round, samples=samples)
    return times


def _warm(fn: Callable[[], object], device) -> None:
    """One untimed run: compiles the per-token regions for a new kind of call (compiled mode)
    and builds kernel plans, so that no timing's warm-up sizes itself on a compilation."""
    fn()
    synchronize(device)


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

    _warm(forward_backward, device)
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
    return _table(token_counts, forward_rates), _table(token_counts, backward_rates), seconds


def _local_pack_plan(
    num_tokens: int, text_tokens: int, num_sequences: int = 2
) -> tuple[_core.Batch, _core.Plan]:
    """`num_sequences` equal sequences of num_tokens in total, all local on rank 0 of 1. A pack,
    not one sequence: real ranks hold several, and the model's cross-attention gathers their
    rows (a single sequence takes a copy-free path that would under-count)."""
    return _local_plan([num_tokens // num_sequences] * num_sequences, text_tokens)


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
    return _table(x, y)


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
                    blocks, *_local_pack_plan(tokens, config.text_tokens, num_sequences)
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
        calls = probe(blocks, *_local_plan(distinct, config.text_tokens))
        progress(
            f"memory {CALLS_SEQUENCES} distinct lengths {distinct}: step peak "
            f"{calls.step_peak / 2**20:9.1f} MiB (the M={low} pack's: "
            f"{probes[low].step_peak / 2**20:9.1f} MiB, as many attended tokens in one call)"
        )
        with_text = None
        if not config.joint_attention:
            with_text = probe(
                blocks, *_local_pack_plan(low, config.text_tokens + low, num_sequences)
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
        values.extend(_table([], []) for _ in range(len(models) - len(values)))
    if model not in models:
        models.append(model)
        for values in columns.values():
            values.append(0.0)
        for values in table_lists.values():
            values.append(_table([], []))
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
    took over two minutes, bench/results/mmdit_h200_202612.md run 8). Memory rows, exchange
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
