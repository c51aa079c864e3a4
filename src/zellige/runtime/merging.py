"""Which groups of a coalesced call run merged as one padded call: the choice by measured cost.

A pack of many distinct lengths makes many small dense calls, and a small call runs below the
rate of a large one (fewer waves to hide its start and its last wave). Merging nearby lengths
into one call padded to the longest (coalesced.PaddedGroup: padded keys masked, padded queries
dropped, results those of the separate calls) buys the large call's rate for padded FLOPs, a
masked kernel and the copies that gather and scatter the rows. Whether that pays depends on the
lengths and the device, so it is priced, not guessed:

- a call's kernel seconds at (query length, key length, total heads), unmasked and masked: a call
  table measured on the device with calls issued back to back as the engine issues them
  (bench/attention_engine.py --call-table; shipped per device model in zellige/profiles/). The
  profile's attention call tables time each call alone behind a busy GPU, which is right for the
  planner's step time but overstates the small call's penalty within a run of calls;
- copies: their bytes (read + written) over the table's measured row-gather rate.

plan_padded_merges splits the groups, sorted by shape, into runs that minimize the priced
forward + backward seconds (dynamic programming over the sorted order); runs of one group stay
plain groups. The engine applies it to disjoint tables on CUDA when the profile is of this device
(coalesced_attention, merge="auto") when such a table exists for the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from zellige.runtime.engine import EngineConfig

MAX_RUN = 24  # groups one padded call may take (bounds the planning work, O(groups * MAX_RUN))
LogTable = tuple[np.ndarray, np.ndarray]  # (log total heads, log seconds) at one call length


@dataclass(frozen=True, slots=True)
class CallCosts:
    """Measured seconds of dense attention calls and copies on one device (see module doc).
    Per measured call length: unmasked and masked forward / backward tables by total heads."""

    log_lengths: np.ndarray  # log of the measured call lengths (increasing)
    forward: tuple[LogTable, ...]
    backward: tuple[LogTable, ...]
    masked_forward: tuple[LogTable, ...]
    masked_backward: tuple[LogTable, ...]
    bytes_per_s: float  # row gathers / copies, bytes read plus written
    source: str = ""
    # CUDA streams the engine spreads a table's calls over (coalesced._for_each_group): the
    # count that ran packs of many lengths fastest on this device (the table's optional
    # "streams" entry, from bench/attention_engine.py --stream-counts); 1 without one
    streams: int = 1
    # the least key count of a group whose forward the engine splits at a multiple of 128 keys
    # (coalesced.forward_into: cuDNN's forward runs faster on such key counts), from the
    # table's optional "key_split" entry; 0: no split
    key_split: int = 0

    @staticmethod
    def from_call_table(data: dict, where: str) -> CallCosts:
        """From a call table measured by `bench/attention_engine.py --call-table` (lengths,
        heads, forward_s / backward_s / masked_forward_s / masked_backward_s [length][heads],
        gather_bytes_per_s). Raises ValueError naming what is wrong."""
        try:
            lengths = [float(x) for x in data["lengths"]]
            heads = np.log(np.asarray([float(h) for h in data["heads"]]))
            grids = {
                name: np.log(np.asarray(data[name], dtype=np.float64))
                for name in ("forward_s", "backward_s", "masked_forward_s", "masked_backward_s")
            }
            bytes_per_s = float(data["gather_bytes_per_s"])
            streams = data.get("streams", 1)
            key_split = data.get("key_split", 0)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{where}: not an attention call table ({error})") from None
        ok = (
            len(lengths) >= 1
            and all(b > a for a, b in zip(lengths, lengths[1:], strict=False))
            and all(g.shape == (len(lengths), len(heads)) and np.isfinite(g).all()
                    for g in grids.values())
            and bytes_per_s > 0
        )  # fmt: skip
        if not ok:
            raise ValueError(
                f"{where}: lengths must increase and every table must hold a positive time for "
                "each (length, heads), gather_bytes_per_s > 0"
            )
        if not (isinstance(streams, int) and not isinstance(streams, bool) and 1 <= streams <= 8):
            raise ValueError(f"{where}: streams must be an integer from 1 to 8, got {streams!r}")
        if not (isinstance(key_split, int) and not isinstance(key_split, bool) and key_split >= 0):
            raise ValueError(f"{where}: key_split must be an integer >= 0, got {key_split!r}")

        def tables(name: str) -> tuple[LogTable, ...]:
            return tuple((heads, row) for row in grids[name])

        return CallCosts(
            log_lengths=np.log(np.asarray(lengths)),
            forward=tables("forward_s"),
            backward=tables("backward_s"),
            masked_forward=tables("masked_forward_s"),
            masked_backward=tables("masked_backward_s"),
            bytes_per_s=bytes_per_s,
            source=f"{where} ({data.get('created', '')})",
            streams=streams,
            key_split=key_split,
        )

    def _seconds(self, tables, q_len: int, k_len: int, heads: int) -> float:
        """Seconds of one call: per length, log-log in heads (beyond the largest call measured at
        its per-head rate, below the smallest held); between lengths, the seconds per head and
        per L^2 linear in log L (held beyond the measured lengths)."""
        area = float(q_len) * float(k_len)
        log_length, log_heads = 0.5 * math.log(area), math.log(heads)

        def log_per_head_area(i: int) -> float:
            log_x, log_y = tables[i]
            if log_heads >= log_x[-1]:
                log_s = log_y[-1] - log_x[-1]
            else:
                log_s = float(np.interp(log_heads, log_x, log_y)) - log_heads
            return log_s - 2.0 * self.log_lengths[i]

        lengths = self.log_lengths
        if log_length <= lengths[0]:
            value = log_per_head_area(0)
        elif log_length >= lengths[-1]:
            value = log_per_head_area(len(lengths) - 1)
        else:
            i = int(np.searchsorted(lengths, log_length, side="right")) - 1
            t = (log_length - lengths[i]) / (lengths[i + 1] - lengths[i])
            value = (1.0 - t) * log_per_head_area(i) + t * log_per_head_area(i + 1)
        return math.exp(value) * area * heads

    def call_s(
        self, q_len: int, k_len: int, heads: int, masked: bool = False
    ) -> tuple[float, float]:
        """(forward, backward) kernel seconds of one dense call of `heads` (problem, head) pairs,
        with a key mask if `masked`."""
        forward, backward = (
            (self.masked_forward, self.masked_backward) if masked else (self.forward, self.backward)
        )
        return (
            self._seconds(forward, q_len, k_len, heads),
            self._seconds(backward, q_len, k_len, heads),
        )

    def copy_s(self, rows: int, head_dim: int, itemsize: int) -> float:
        """Seconds to read and write `rows` rows once."""
        return 2.0 * rows * head_dim * itemsize / self.bytes_per_s


def group_cost_s(costs: CallCosts, g, head_dim: int, itemsize: int) -> float:
    """Forward + backward seconds of one group as the engine runs it (coalesced.forward_into /
    backward_into): the call, o and lse written into the rows, dq / dk / dv likewise, and the
    gathers of segments that do not sit side by side."""
    forward_s, backward_s = costs.call_s(g.q_len, g.k_len, g.count * g.num_heads)
    q_rows, k_rows = g.count * g.q_len * g.num_heads, g.count * g.k_len * g.num_heads
    copies = q_rows + q_rows + 2 * k_rows  # o out; dq, dk, dv out
    if not isinstance(g.q_index, slice):
        copies += 3 * q_rows  # q (forward, backward), o, do gathered
    if not isinstance(g.k_index, slice):
        copies += 4 * k_rows  # k, v in the forward and again in the backward
    return forward_s + backward_s + costs.copy_s(copies, head_dim, itemsize)


def padded_cost_s(costs: CallCosts, groups: Sequence, head_dim: int, itemsize: int) -> float:
    """Forward + backward seconds of `groups` as one padded call (coalesced.PaddedGroup): the
    call at the longest shape (masked where some member has fewer keys), the gathers of
    q / k / v (forward) and q / k / v / o / do (backward) into the padded rows, the zeroing of
    padded output gradients, and the results selected and written back (o, lse; dq, dk, dv)."""
    count = sum(g.count for g in groups)
    n = groups[0].num_heads
    q_len, k_len = max(g.q_len for g in groups), max(g.k_len for g in groups)
    keys_padded = any(g.k_len < k_len for g in groups)  # else no mask (coalesced.PaddedGroup)
    forward_s, backward_s = costs.call_s(q_len, k_len, count * n, masked=keys_padded)
    padded_q, padded_k = count * q_len * n, count * k_len * n
    real_q = sum(g.count * g.q_len for g in groups) * n
    real_k = sum(g.count * g.k_len for g in groups) * n
    gathers = (padded_q + 2 * padded_k) + (4 * padded_q + 2 * padded_k)  # backward: do * keep
    scatters = 2 * (real_q + real_q + 2 * real_k)  # select, then index_copy: o; dq, dk, dv
    return forward_s + backward_s + costs.copy_s(gathers + scatters, head_dim, itemsize)


def plan_padded_merges(
    groups: Sequence, costs: CallCosts, head_dim: int, itemsize: int
) -> tuple[list[list[int]], float, float]:
    """(buckets, planned seconds, seconds as plain groups): the runs of two or more groups
    (indices into `groups`) that minimize the priced forward + backward time. Groups are taken
    in order of (heads, key length, query length), largest first; a run holds one head count."""
    order = sorted(
        range(len(groups)),
        key=lambda i: (groups[i].num_heads, groups[i].k_len, groups[i].q_len),
        reverse=True,
    )
    alone = [group_cost_s(costs, groups[i], head_dim, itemsize) for i in order]
    best = [0.0] * (len(order) + 1)  # best[j]: seconds of order[:j]
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        best[j], cut[j] = best[j - 1] + alone[j - 1], j - 1
        heads = groups[order[j - 1]].num_heads
        for i in range(j - 2, max(-1, j - 1 - MAX_RUN), -1):
            if groups[order[i]].num_heads != heads:
                break
            run = [groups[order[m]] for m in range(i, j)]
            seconds = best[i] + padded_cost_s(costs, run, head_dim, itemsize)
            if seconds < best[j]:
                best[j], cut[j] = seconds, i
    buckets, j = [], len(order)
    while j > 0:
        i = cut[j]
        if j - i >= 2:
            buckets.append(sorted(order[i:j]))
        j = i
    return buckets[::-1], best[-1], sum(alone)


# Call tables shipped with the package (zellige/profiles/), by the CUDA device name they were
# measured on; EngineConfig.call_table names another file (for this device, whatever its name).
CALL_TABLES = {"NVIDIA H200": "h200_attention_calls.json"}
_device_costs: dict[str, CallCosts | None] = {}


def costs_for_device(device: torch.device, call_table: str | None = None) -> CallCosts | None:
    """The call costs measured on this device's model (or read from `call_table`, a file), or
    None (no measured basis: no merges, the engine runs plain groups). CPU runs never merge."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    key = f"{name}|{call_table}"
    if key not in _device_costs:
        from importlib import resources

        from zellige._json import parse_json

        if call_table is not None:
            with open(call_table) as f:
                text, where = f.read(), call_table
        elif name in CALL_TABLES:
            source = resources.files("zellige") / "profiles" / CALL_TABLES[name]
            text = source.read_text() if source.is_file() else None
            where = f"built-in {CALL_TABLES[name]}"
        else:
            text = None
        _device_costs[key] = (
            None if text is None else CallCosts.from_call_table(parse_json(text, where), where)
        )
    return _device_costs[key]


def streams_for_device(device: torch.device, engine: EngineConfig) -> int:
    """How many CUDA streams the engine spreads a table's calls over on `device`: the engine's
    `streams` if set, else the device's measured call table's count (see CallCosts.streams),
    else 1 (no measured basis; CPU always 1)."""
    if engine.streams is not None:
        return engine.streams
    costs = costs_for_device(device, engine.call_table)
    return 1 if costs is None else costs.streams


def key_split_for_device(device: torch.device, engine: EngineConfig) -> int:
    """The least key count of a group whose forward the engine splits at a multiple of 128 keys
    on `device` (CallCosts.key_split): the engine's `key_split` if set, else the device's
    measured call table's value, else 0 (no split)."""
    if engine.key_split is not None:
        return engine.key_split
    costs = costs_for_device(device, engine.call_table)
    return 0 if costs is None else costs.key_split
