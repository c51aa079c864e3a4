"""The attention call table: what the coalesced engine's merge policy prices calls with.

Seconds of one dense attention call ([B, n, L, H] views of token-major rows, as the engine
makes them) by length L and total heads B * n, issued back to back as the engine issues a
pack's calls (the host queues ahead, so no launch gap is counted), unmasked and with a key
mask over the last 1/16 of the keys (a padded merge's call); and the rate of row gathers, the
copies a padded merge adds. runtime/merging.py reads the file (`CallCosts.from_call_table`);
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
