"""Measured-time feedback: per-rank speed factors estimated from each step's times.

The cost model predicts every rank's time for its share of a step (at the cluster's own speeds:
1.0, or a cluster file's). A rank that runs slower than predicted (a throttled GPU, a shared NIC)
leaves the others waiting. SpeedEstimate keeps, per rank, an exponential moving average of
measured over predicted time; its speed factors (the inverse ratios, normalised to mean 1 and
clamped to [MIN_SPEED_FACTOR, MAX_SPEED_FACTOR]) multiply the cluster's speeds of the plans made
after it, so a slow rank gets less work and a recovered rank gets its share back.

Every rank updates its estimate from the same all-gathered measurements of the same steps, in the
same order, so all ranks plan with the same speeds and their plans agree. A step is planned
ahead (the loader worker plans up to its prefetch depth ahead, and a step's metrics are read one
step late), so a measurement reaches the plans a few steps after it was taken (docs/training.md).

SlowRank is a test-only hook (ZELLIGE_TEST_SLOW_RANK) that makes one rank slower.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

from zellige.pipeline import StepForecast

# A rank's factor against the mean rank's: a rank measured 20x slower still gets a tenth of a
# mean share (its estimate stays measurable), and one measured fast cannot take everything.
MIN_SPEED_FACTOR = 0.1
MAX_SPEED_FACTOR = 10.0
# a rank predicted to do less than this is not measured (no share, or one too small to time)
MIN_MEASURED_PREDICTED_S = 1e-12

SLOW_RANK_ENV = "ZELLIGE_TEST_SLOW_RANK"


@dataclass(frozen=True, slots=True)
class RankTimes:
    """One step's measured seconds per rank (all-gathered: the same on every rank).

    layers_s: the per-token layers (projections, MLP, norms; never waiting for another rank);
    attention_s: self- and cross-attention with their exchanges (which include waiting for the
    slowest member of each exchange)."""

    layers_s: tuple[float, ...]
    attention_s: tuple[float, ...]

    @property
    def busy_s(self) -> tuple[float, ...]:
        return tuple(a + b for a, b in zip(self.layers_s, self.attention_s, strict=True))


class SpeedEstimate:
    """Per-rank EMA of measured over predicted time, and the speed factors derived from it.

    smoothing: the weight of the newest step in the average (1: the last step only).
    start_step: the first step (1-based) measured; earlier steps (compilation, warm caches) are
    not, and plans use no factors until a measured step has reached them.

    Example:
        >>> estimate = SpeedEstimate(4, smoothing=0.5, start_step=1)
        >>> estimate.update(1, forecast, times)   # every rank, the same gathered times
        >>> estimate.speed_factors()              # (0.4, 1.2, 1.2, 1.2): rank 0 is slow
    """

    def __init__(self, num_ranks: int, *, smoothing: float, start_step: int) -> None:
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"speed smoothing must be in (0, 1], got {smoothing!r}")
        if start_step < 1:
            raise ValueError(f"the first measured step must be at least 1, got {start_step!r}")
        self.num_ranks = num_ranks
        self.smoothing = smoothing
        self.start_step = start_step
        # measured / predicted seconds per rank (None: not measured yet); layers and attention
        # apart, for the log: they tell a slow device from a slow link
        self._ratio: list[float | None] = [None] * num_ranks
        self._layers_ratio: list[float | None] = [None] * num_ranks
        self._attention_ratio: list[float | None] = [None] * num_ranks

    def update(self, step: int, forecast: StepForecast, times: RankTimes) -> None:
        """Folds step `step` (1-based) into the averages; a rank predicted no work keeps its
        average (a ratio of nothing over nothing measures no speed)."""
        if step < self.start_step:
            return
        assert len(forecast.rank_time_s) == self.num_ranks == len(times.layers_s)
        busy_s = times.busy_s
        for rank in range(self.num_ranks):
            predicted_s = forecast.rank_time_s[rank]
            layers_s = forecast.rank_layers_s[rank]
            if predicted_s > MIN_MEASURED_PREDICTED_S:
                self._ratio[rank] = self._average(self._ratio[rank], busy_s[rank] / predicted_s)
            if layers_s > MIN_MEASURED_PREDICTED_S:
                ratio = times.layers_s[rank] / layers_s
                self._layers_ratio[rank] = self._average(self._layers_ratio[rank], ratio)
            attention_s = predicted_s - layers_s
            if attention_s > MIN_MEASURED_PREDICTED_S:
                ratio = times.attention_s[rank] / attention_s
                self._attention_ratio[rank] = self._average(self._attention_ratio[rank], ratio)

    def _average(self, previous: float | None, newest: float) -> float:
        if previous is None:  # the first measurement starts the average
            return newest
        return (1.0 - self.smoothing) * previous + self.smoothing * newest

    @property
    def measured(self) -> bool:
        return any(ratio is not None for ratio in self._ratio)

    def speed_factors(self) -> tuple[float, ...] | None:
        """Per rank, predicted over measured time against the mean rank's, clamped to
        [MIN_SPEED_FACTOR, MAX_SPEED_FACTOR]; a rank not measured yet counts as the mean. None
        before any measurement."""
        return _factors(self._ratio)

    def layers_speed_factors(self) -> tuple[float, ...] | None:
        """The same from the per-token layers alone (for the log)."""
        return _factors(self._layers_ratio)

    def attention_speed_factors(self) -> tuple[float, ...] | None:
        """The same from attention and its exchanges alone (for the log)."""
        return _factors(self._attention_ratio)


def _factors(ratios: Sequence[float | None]) -> tuple[float, ...] | None:
    speeds = [1.0 / r if r is not None and r > 0 and math.isfinite(r) else None for r in ratios]
    known = [s for s in speeds if s is not None]
    if not known:
        return None
    mean = sum(known) / len(known)
    return tuple(
        1.0 if s is None else min(MAX_SPEED_FACTOR, max(MIN_SPEED_FACTOR, s / mean)) for s in speeds
    )


def imbalance(rank_s: Sequence[float]) -> float:
    """The slowest rank's time over the mean rank's (1: balanced)."""
    mean = sum(rank_s) / len(rank_s)
    return max(rank_s) / mean if mean > 0 else 1.0


@dataclass(frozen=True, slots=True)
class SlowRank:
    """Test-only: one rank made `factor` times slower, by a sleep inside its step that counts
    as its work (the metrics' busy time). Read from ZELLIGE_TEST_SLOW_RANK, in one place
    (from_env):

    - "RANK:FACTOR": rank RANK sleeps (FACTOR - 1) x its measured busy time of the step: its
      real work, FACTOR times slower.
    - "RANK:FACTOR:SCALE": every rank emulates a device whose time follows the cost model: it
      sleeps SCALE x its nominal predicted seconds (x FACTOR on rank RANK). On CPU, where the
      cost model's GPU times do not hold, this gives timings that follow the plan, as a GPU's
      do (tests/distributed/test_speed_feedback.py).
    """

    rank: int
    factor: float
    scale: float | None = None

    @classmethod
    def from_env(cls, num_ranks: int) -> SlowRank | None:
        text = os.environ.get(SLOW_RANK_ENV)
        if not text:
            return None
        parts = text.split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            rank, factor = int(parts[0]), float(parts[1])
            scale = float(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise ValueError(
                f"{SLOW_RANK_ENV}={text!r}: expected RANK:FACTOR or RANK:FACTOR:SCALE"
            ) from None
        if not 0 <= rank < num_ranks:
            raise ValueError(f"{SLOW_RANK_ENV}: rank {rank} is not in [0, {num_ranks})")
        if not (math.isfinite(factor) and factor >= 1.0):
            raise ValueError(f"{SLOW_RANK_ENV}: factor must be a number >= 1, got {factor}")
        if scale is not None and not (math.isfinite(scale) and scale >= 0.0):
            raise ValueError(f"{SLOW_RANK_ENV}: scale must be a number >= 0, got {scale}")
        return cls(rank=rank, factor=factor, scale=scale)

    def delay_s(self, rank: int, measured_busy_s: float, forecast: StepForecast) -> float:
        """Seconds `rank` sleeps this step."""
        factor = self.factor if rank == self.rank else 1.0
        if self.scale is not None:
            return self.scale * factor * forecast.rank_time_s[rank]
        return (factor - 1.0) * measured_busy_s
