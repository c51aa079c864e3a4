"""torchrun worker for test_speed_feedback.py: tiny-cpu in float64 on one fixed batch every step,
with one rank slowed by the test hook (ZELLIGE_TEST_SLOW_RANK, set by the test), planned with or
without measured-speed feedback; rank 0 writes each step's metrics record (JSONL).

usage: torchrun --nproc-per-node N speed_feedback_worker.py OUT.jsonl on|off STEPS
"""

from __future__ import annotations

import sys

from zellige.runtime import end_rank_process
from zellige.train.config import tiny_cpu
from zellige.train.loop import train

# Clips of 1 to 30 frames of one latent token, each length once, spread over the loaders: plans
# can give a rank any share of the work, so the imbalance measured is the feedback's, not the
# batch's granularity.
SEQUENCES = [
    {
        "id": index,
        "num_tokens": frames,
        "grid": [frames, 1, 1],
        "text_tokens": 4,
        "source_rank": index % 3,
    }
    for index, frames in enumerate(range(1, 31))
]


def main() -> int:
    out, feedback, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = tiny_cpu().with_fields(
        dtype="float64",
        steps=steps,
        warmup_steps=0,
        gpus_per_node=3,
        adapt_speeds=feedback == "on",
        adapt_speeds_start_step=1,
        speed_smoothing=0.5,
    )
    train(config, metrics_path=out, sequences=SEQUENCES, progress=False)
    return 0


if __name__ == "__main__":
    end_rank_process(main())
