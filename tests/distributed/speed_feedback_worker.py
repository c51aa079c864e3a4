"""torchrun worker for test_speed_feedback.py: tiny-cpu in float64 on one fixed batch every step,
with one rank slowed by the test hook (ZELLIGE_TEST_SLOW_RANK, set by the test), planned with or
without measured-speed feedback; rank 0 writes each step's metrics record (JSONL).

usage: torchrun --nproc-per-node N speed_feedback_worker.py OUT.jsonl on|off STEPS
"""

from __future__ import annotations

import dataclasses
import sys

from zellige.runtime import end_rank_process
from zellige.train.config import tiny_cpu
from zellige.train.loop import train

# Images and short clips of several lengths, spread over the loaders: enough sequences that a
# plan can give a rank a third of the others' work and still balance.
SEQUENCES = [
    {
        "id": index,
        "num_tokens": t * 16,
        "grid": [t, 4, 4],
        "text_tokens": 4,
        "source_rank": index % 3,
    }
    for index, t in enumerate([1, 2, 3, 4, 5, 6] * 5)
]


def main() -> int:
    out, feedback, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = dataclasses.replace(
        tiny_cpu(),
        dtype="float64",
        steps=steps,
        warmup_steps=0,
        adapt_speeds=feedback == "on",
        adapt_speeds_start_step=1,
        speed_smoothing=0.5,
    )
    train(config, metrics_path=out, sequences=SEQUENCES, progress=False)
    return 0


if __name__ == "__main__":
    end_rank_process(main())
