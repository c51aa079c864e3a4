"""The attention call table: what the coalesced engine's merge policy prices calls with.

Seconds of one dense attention call ([B, n, L, H] views of token-major rows, as the engine
makes them) by length L and total heads B * n, issued back to back as the engine issues a
pack's calls (the host queues ahead, so no launch gap is counted), unmasked and with a key
mask over the last 1/16 of the keys (a padded merge's call); and the rate of row gathers, the
copies a padded merge adds; and how many CUDA streams the engine should spread a pack's calls
over (measure_streams: a mixed-length pack timed on 1..MAX_STREAMS streams). runtime/merging.py
reads the file (`CallCosts.from_call_table`);
`zellige profile --attention-calls` and bench/attention_engine.py --call-table write it.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import torch

from zellige.profiler.timing import median_time_s
from zellige.runtime import kernels as K

CALL_LENGTHS = (512, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
CALL_HEADS = (24, 48, 96, 192, 384)  # B * n with n = HEADS_PER_PROBLEM
HEADS_PER_PROBLEM = 24
QUICK_LENGTHS, QUICK_HEADS, QUICK_HEADS_PER_PROBLEM = (16, 48), (2, 4), 2
TIMED_S = 2e-3  # each timed run repeats a call until it lasts about this long
NAMES = ("forward_s", "backward_s", "masked_forward_s", "masked_backward_s")


def shape_seconds(
    kernel: K.Kernel,
    masked: K.Kernel | None,
    *,
    length: int,
    batch: int,
    heads: int,
    head_dim: int,
    device: torch.device,
    repeats: int,
    generator: torch.Generator,
) -> dict[str, float]:
    """Seconds of one [batch, heads, length, head_dim] bf16 call, back to back: forward and
    backward, unmasked and (where `masked`) masked."""
    dtype = torch.bfloat16
    q, k, v, do = (
        torch.randn(
            batch, length, heads, head_dim, device=device, dtype=dtype, generator=generator
        ).transpose(1, 2)
        for _ in range(4)
    )
    scale = head_dim**-0.5
    o, lse = kernel.forward(q, k, v, scale)
    calls: dict[str, Callable[[], object]] = {
        "forward_s": lambda: kernel.forward(q, k, v, scale),
        "backward_s": lambda: kernel.backward(do, q, k, v, o, lse, scale),
    }
    if masked is not None:
        valid = torch.arange(length, device=device) < length - length // 16
        bias = K.key_mask(valid.expand(batch, length), dtype)
        mo, mlse = masked.forward(q, k, v, scale, bias)
        calls["masked_forward_s"] = lambda: masked.forward(q, k, v, scale, bias)
        calls["masked_backward_s"] = lambda: masked.backward(do, q, k, v, mo, mlse, scale, bias)
    seconds = {}
    for name, call in calls.items():
        one_s = median_time_s(call, device, warmup=1, repeats=1)
        reps = max(1, min(50, math.ceil(TIMED_S / max(one_s, 1e-6))))

        def run(call=call, reps=reps) -> None:
            for _ in range(reps):
                call()

        seconds[name] = median_time_s(run, device, warmup=1, repeats=repeats) / reps
    return seconds


def _gather_bytes_per_s(device, head_dim: int, repeats: int, generator) -> float:
    """Bytes read plus written per second by a gather of runs of rows (index_select)."""
    rows = torch.randn(1 << 20, head_dim, device=device, dtype=torch.bfloat16, generator=generator)
    index = torch.arange(rows.shape[0], device=device)  # runs of rows, as segments are
    seconds = median_time_s(lambda: rows.index_select(0, index), device, repeats=repeats)
    return 2 * rows.numel() * rows.element_size() / seconds


STREAM_PACK_LENGTHS = tuple(round(512 * 16 ** (i / 23)) for i in range(24))  # 512-8192 tokens
MAX_STREAMS = 4
STREAM_GAIN = 0.02  # more streams only where they beat fewer by this fraction of the time


def measure_streams(
    device: torch.device, *, head_dim: int, heads: int, quick: bool, repeats: int
) -> tuple[int, dict[int, float]]:
    """(chosen stream count, forward + backward seconds by count) of the coalesced engine on a
    pack of 24 sequences of 512-8192 tokens, one dense call each (coalesced._for_each_group:
    calls run concurrently, filling each other's last waves). The fewest streams within
    STREAM_GAIN of the fastest; 1 off CUDA, where streams do nothing."""
    from zellige.runtime import SegmentTable, coalesced_attention

    if device.type != "cuda":
        return 1, {}
    lengths = [max(1, x // 64) for x in STREAM_PACK_LENGTHS] if quick else STREAM_PACK_LENGTHS
    bounds = [0]
    for length in lengths:
        bounds.append(bounds[-1] + length)
    table = SegmentTable.packed(bounds, heads, device)
    generator = torch.Generator(device=device).manual_seed(1)
    q, k, v, do = (
        torch.randn(bounds[-1] * heads, head_dim, device=device, dtype=torch.bfloat16,
                    generator=generator)
        for _ in range(4)
    )  # fmt: skip
    for t in (q, k, v):
        t.requires_grad_(True)
    seconds: dict[int, float] = {}
    for streams in range(1, MAX_STREAMS + 1):

        def step(streams=streams) -> None:
            o = coalesced_attention(q, k, v, table, merge="groups", streams=streams)
            torch.autograd.grad(o, (q, k, v), do)

        seconds[streams] = median_time_s(step, device, warmup=2, repeats=max(5, repeats))
    fastest = min(seconds.values())
    chosen = min(n for n, s in seconds.items() if s <= fastest * (1 + STREAM_GAIN))
    return chosen, seconds


def measure_call_table(
    device: torch.device,
    *,
    head_dim: int = 128,
    quick: bool = False,
    repeats: int = 3,
    out_path: str | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> dict:
    """The call table of this device (see the module doc) as its JSON object; with `out_path`
    also written there after every length (a run cut short keeps what it measured)."""
    lengths = QUICK_LENGTHS if quick else CALL_LENGTHS
    head_counts = QUICK_HEADS if quick else CALL_HEADS
    n = QUICK_HEADS_PER_PROBLEM if quick else HEADS_PER_PROBLEM
    dtype = torch.bfloat16
    kernel = K.kernel_for(device, dtype, head_dim)
    masked = K.masked_kernel_for(kernel, device, dtype, head_dim)
    generator = torch.Generator(device=device).manual_seed(0)
    gather_bytes_per_s = _gather_bytes_per_s(device, head_dim, repeats, generator)
    cuda = device.type == "cuda"
    table: dict[str, list] = {name: [] for name in NAMES}
    count, stream_s = measure_streams(
        device, head_dim=head_dim, heads=n, quick=quick, repeats=repeats
    )
    streams = {"streams": count, "streams_seconds": {str(c): s for c, s in stream_s.items()}}
    if stream_s:
        progress(
            f"attention streams: {count} (fwd+bwd ms by count: "
            + ", ".join(f"{c}: {s * 1e3:.2f}" for c, s in stream_s.items())
            + ")"
        )

    def result(done: int) -> dict:
        return {
            "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
            "created": f"attention call table measured on {time.strftime('%Y-%m-%d %H:%M')} "
            f"UTC; torch {torch.__version__}, cuDNN "
            f"{torch.backends.cudnn.version() if cuda else None}; kernel {kernel.name}, key mask "
            f"{None if masked is None else getattr(masked, 'bias_layout', masked.name)}",
            "head_dim": head_dim,
            "dtype": "bfloat16",
            "lengths": list(lengths[:done]),
            "heads": list(head_counts),
            **{name: rows[:done] for name, rows in table.items()},
            "gather_bytes_per_s": gather_bytes_per_s,
            **streams,
        }

    for done, length in enumerate(lengths, start=1):
        rows: dict[str, list] = {name: [] for name in NAMES}
        for heads in head_counts:
            seconds = shape_seconds(
                kernel, masked, length=length, batch=heads // n, heads=n, head_dim=head_dim,
                device=device, repeats=repeats, generator=generator,
            )  # fmt: skip
            for name in NAMES:
                rows[name].append(seconds.get(name))
        for name in NAMES:
            table[name].append(rows[name])
        if out_path is not None:
            with open(out_path, "w") as f:
                json.dump(result(done), f, indent=1)
        flops = 4.0 * length * length * head_dim * head_counts[-1]
        masked_s = rows["masked_forward_s"][-1]
        progress(
            f"attention calls L={length}: {head_counts[-1]} heads fwd "
            f"{flops / rows['forward_s'][-1] / 1e12:.0f} TFLOP/s"
            + ("" if masked_s is None else f", masked {flops / masked_s / 1e12:.0f}")
        )
    return result(len(lengths))
