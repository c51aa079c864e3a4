"""The host's issue time of a training step: the launch rows of a hardware profile, timed on two
tiny ranks (one sequence against LAUNCH_SEQUENCES distinct lengths), and the engine's ragged
flag said in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from zellige.profiler import rank_work
from zellige.profiler.memory import Progress, local_lengths_plan
from zellige.profiler.models import (
    dit_config,
    stack_layers,
)
from zellige.profiler.timing import (
    median_time_s,
    synchronize,
)
from zellige.runtime import EngineConfig, engine_runs_ragged

if TYPE_CHECKING:
    from zellige.profiler.measure import ProfileOptions

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
        batch, plan = local_lengths_plan(lengths, text_tokens)
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
        warm(step, device)
        warm(step, device)
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


def warm(fn: Callable[[], object], device) -> None:
    """One untimed run: compiles the per-token regions for a new kind of call (compiled mode)
    and builds kernel plans, so that no timing's warm-up sizes itself on a compilation."""
    fn()
    synchronize(device)
