"""Would outlier deferral pay? The predicted tokens per second of a run of global batches when
sequences of at least THETA tokens wait in a queue (released together once RELEASE of them are
waiting, or when the oldest has waited MAX_WAIT steps, and at the last step), against the same
stream of samples trained as drawn. Each step is planned by the zellige global-batch planner
(built-in H200 profile, wan-14b); the ratio is per token, so the queue's end effects cancel.

    PYTHONPATH=src:bench python bench/outlier_deferral.py [--mix heavy-tail] [--gpus 32]
        [--per-step 600] [--steps 8] [--thetas 200000,290000] [--releases 3,6] [--max-wait 3]

The mixes are bench/global_batch.py's (Pareto lengths). docs/global-batch.md reports what it
printed and why deferral is not built.
"""

from __future__ import annotations

import argparse

import zellige
from global_batch import MIXES, mix_sequences


def run(args, theta: int, release: int) -> tuple[float, int, int]:
    """(predicted seconds, tokens, longest wait in steps) of args.steps global batches."""
    cost_model = zellige.make_cost_model("wan-14b", args.gpus)
    source = mix_sequences(args.mix, args.gpus, args.seed)
    queue: list[tuple[zellige.Sequence, int]] = []  # (sequence, the step it was drawn for)
    seconds, tokens, longest_wait = 0.0, 0, 0
    for step in range(args.steps):
        drawn = [next(source) for _ in range(args.per_step)]
        kept = [s for s in drawn if not theta or s.num_tokens < theta]
        queue += [(s, step) for s in drawn if theta and s.num_tokens >= theta]
        released = []
        last = step == args.steps - 1
        if last or len(queue) >= release or (queue and step - queue[0][1] >= args.max_wait):
            released, queue = queue, []
        longest_wait = max([longest_wait, *(step - drawn_at for _, drawn_at in released)])
        sequences = kept + [s for s, _ in released]
        for index, sequence in enumerate(sequences):
            sequence.id = index
        batch = zellige.Batch()
        batch.sequences = sequences
        seconds += zellige.plan_global_batch("zellige", batch, cost_model).step_time_s
        tokens += sum(s.num_tokens for s in sequences)
    return seconds, tokens, longest_wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mix", default="heavy-tail", choices=sorted(MIXES))
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--per-step", type=int, default=600, help="samples drawn per step")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--thetas", default="200000,290000", help="outlier token thresholds")
    parser.add_argument("--releases", default="3,6", help="queue lengths that release it")
    parser.add_argument("--max-wait", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    seconds, tokens, _ = run(args, 0, 0)
    print(f"{args.mix}, {args.gpus} GPUs, {args.steps} steps of {args.per_step} samples")
    print(f"no deferral: {seconds:.3f} s predicted, {tokens / seconds:,.0f} tokens/s")
    for theta in (int(t) for t in args.thetas.split(",")):
        for release in (int(r) for r in args.releases.split(",")):
            s, t, wait = run(args, theta, release)
            print(
                f"theta {theta:,} release {release}: {s:.3f} s, longest wait {wait} steps, "
                f"tokens/s {t / s / (tokens / seconds):.4f}x no deferral"
            )


if __name__ == "__main__":
    main()
