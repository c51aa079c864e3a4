"""Where a training step's peak memory goes: trains CONFIG:RECIPE for a few steps and, in the
last step, records the CUDA allocator's history (torch.cuda.memory._record_memory_history with
Python stacks), finds the moment of the step's peak and prints what was live then, grouped by
the innermost zellige source line that allocated it (bytes, count, bytes per token), plus the
bytes saved for backward per token (unique storages, autograd's saved_tensors_hooks) and the
allocated bytes after each block's forward. On a CPU only the saved bytes are printed.

A diagnostic for a peak that grew between commits (run it at both and compare the groups):
    cd bench && python3 step_memory.py --run wan14b-width-h200:wan-stage2 --steps 2
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict

import torch

import zellige.train.loop as loop
from zellige.train.config import get_config


def _frame_of(frames: list[dict]) -> str:
    """The innermost frame in zellige's sources (else the innermost Python frame)."""
    for frame in frames:
        name = frame.get("filename", "")
        if "zellige" in name and "step_memory" not in name:
            return f"{name.split('zellige/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return frames[0].get("filename", "?") + f":{frames[0].get('line')}" if frames else "?"


def _live_at_peak(snapshot: dict, device: int) -> tuple[int, dict[str, list[int]]]:
    """Replays the device's alloc/free trace; (peak bytes above the trace's start, the
    allocations live at that moment grouped by source line: [bytes, count])."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in snapshot["device_traces"][device]:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = (event["size"], _frame_of(event.get("frames", [])))
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif action in ("free_requested", "free") and event["addr"] in live:
            current -= live.pop(event["addr"])[0]
    groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, where in at_peak.values():
        groups[where][0] += size
        groups[where][1] += 1
    return peak, groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", default="tiny-cpu:tiny", help="CONFIG:RECIPE")
    parser.add_argument("--steps", type=int, default=2, help="steps; the last one is recorded")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--mix-order",
        choices=["as-set", "strict", "off"],
        default="as-set",
        help="inductor's mix-order reduction in the compiled regions: as zellige.model.fused sets "
        "it (non-strict mode), its strict default, or off (a suspect of the regression to rule "
        "in or out)",
    )
    args = parser.parse_args()
    if args.mix_order != "as-set":
        from zellige.model import fused

        use_compiled = fused.use_compiled

        def patched(enabled: bool, backend: str = "inductor") -> None:
            use_compiled(enabled, backend)
            import torch._inductor.config as inductor

            inductor.triton.mix_order_reduction_non_strict_mode = False
            inductor.triton.mix_order_reduction = args.mix_order == "strict"

        fused.use_compiled = patched
    name, recipe = args.run.split(":")
    config = dataclasses.replace(get_config(name), recipe=recipe, steps=args.steps)

    state = {"step": 0}
    original = loop.step_loss

    def step_loss(model, step_input, total_tokens, timer):
        state["step"] += 1
        last = state["step"] == args.steps
        cuda = torch.cuda.is_available() and next(model.parameters()).is_cuda
        if not last:
            return original(model, step_input, total_tokens, timer)
        tokens = (
            sum(step_input.tokens.tokens_per_sequence)
            if hasattr(step_input.tokens, "tokens_per_sequence")
            else None
        )
        saved: dict[int, tuple[int, tuple, str]] = {}

        def pack(t):
            try:
                storage = t.untyped_storage()
                saved[storage.data_ptr()] = (storage.nbytes(), tuple(t.shape), str(t.dtype))
            except RuntimeError:  # FSDP's freed parameter storages
                pass
            return t

        after_block = []
        hooks = [
            b.register_forward_hook(
                lambda *_: after_block.append(torch.cuda.memory_allocated() if cuda else 0)
            )
            for b in model.blocks
        ]
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
            state["start"] = torch.cuda.memory_allocated()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = original(model, step_input, total_tokens, timer)
        for h in hooks:
            h.remove()
        total = sum(v[0] for v in saved.values())
        print(f"[step_memory] tokens {tokens}; saved for backward {total} B "
              f"({total / max(tokens or 1, 1):.0f} B/token, unique storages, parameters "
              "included)", file=sys.stderr)  # fmt: skip
        for nbytes, shape, dtype in sorted(saved.values(), reverse=True)[: args.top]:
            print(f"[step_memory]   saved {nbytes:>14} {dtype:>15} {shape}", file=sys.stderr)
        if cuda and tokens:
            steps = [
                b - a for a, b in zip([state["start"], *after_block[:-1]], after_block, strict=True)
            ]
            print("[step_memory] allocated per block forward, B/token: "
                  + ", ".join(f"{s / tokens:.0f}" for s in steps), file=sys.stderr)  # fmt: skip
            state["tokens"] = tokens
            state["recording"] = True
        return loss

    backward = torch.Tensor.backward

    def recorded_backward(self, *a, **k):
        out = backward(self, *a, **k)
        if state.pop("recording", False):
            torch.cuda.synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            peak, groups = _live_at_peak(snapshot, torch.cuda.current_device())
            tokens = state["tokens"]
            print(f"[step_memory] peak {peak / 2**30:.2f} GiB above the forward's start "
                  f"({peak / tokens:.0f} B/token); live at the peak by source line:",
                  file=sys.stderr)  # fmt: skip
            for where, (nbytes, count) in sorted(groups.items(), key=lambda g: -g[1][0])[
                : args.top
            ]:
                print(f"[step_memory]   {nbytes / 2**30:8.2f} GiB {nbytes / tokens:9.0f} B/token "
                      f"x{count:<4} {where}", file=sys.stderr)  # fmt: skip
        return out

    loop.step_loss = step_loss
    torch.Tensor.backward = recorded_backward
    try:
        history = loop.train(config, progress=False)
        for record in history:
            print(f"[step_memory] step {record['step']}: {record['tokens']} tokens, "
                  f"{record['sequences']} sequences, peak {record['peak_gib']} GiB, predicted "
                  f"{record['predicted_peak_gib']:.2f}, mix-order {args.mix_order}",
                  file=sys.stderr)  # fmt: skip
    finally:
        loop.step_loss = original
        torch.Tensor.backward = backward
    return 0


if __name__ == "__main__":
    sys.exit(main())
