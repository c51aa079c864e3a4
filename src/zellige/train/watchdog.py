"""When a run stops: a failure that reads as one line, and the rank that holds the others up.

TrainingFailed is what the loop raises for a non-finite loss or a stuck rank; RankWatch names
the stuck rank when a collective times out (heartbeats in torchrun's key-value store).
"""

from __future__ import annotations

import datetime
import os
import threading
import time

import torch.distributed as dist


class TrainingFailed(RuntimeError):
    """The run stopped (a non-finite loss, a stuck rank). `report`: this rank prints the message
    (one rank does, so a failure reads as one line)."""

    def __init__(self, message: str, report: bool) -> None:
        super().__init__(message)
        self.report = report


class RankWatch:
    """Names the stuck rank when a collective times out. Each rank counts heartbeats (a thread,
    once a second) and its step in the launcher's key-value store, which torchrun serves from
    its own process: a stopped or frozen rank's count stands still, a slow one's step lags."""

    _BEAT_S = 1.0

    def __init__(self, rank: int, num_ranks: int, timeout_s: float) -> None:
        self.rank, self.num_ranks, self.timeout_s = rank, num_ranks, timeout_s
        self._store = None
        if num_ranks > 1 and "MASTER_ADDR" in os.environ:
            self._store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=datetime.timedelta(seconds=30),
            )
        self._stop = threading.Event()
        self._thread = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True)
            self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self._BEAT_S):
            try:
                self._store.add(f"zellige/beats/{self.rank}", 1)
            except Exception:  # the store went away: the run is ending
                return

    def at_step(self, step: int) -> None:
        if self._store is not None:
            self._store.set(f"zellige/step/{self.rank}", str(step))

    def failure(self, step: int, error: RuntimeError) -> RuntimeError:
        """What to raise for `error` at `step`: a collective that timed out or lost a peer
        becomes one line (from one rank); anything else stays as it was."""
        text = str(error).lower()
        if "timed out" in text or "timeout" in text:
            return self.stuck(step)
        if any(words in text for words in ("connection closed", "connection reset", "broken pipe")):
            # a rank died; torchrun is about to stop this one too
            report = self._first_report()
            return TrainingFailed(
                f"step {step}: rank {self.rank} lost its connection to another rank (it died?)",
                report=report,
            )
        return error

    def _first_report(self) -> bool:
        if self._store is None:
            return True
        try:
            return self._store.add("zellige/failure_reported", 1) == 1
        except Exception:  # the store is gone with the launcher
            return True

    def stuck(self, step: int) -> TrainingFailed:
        """The failure to raise after a collective timed out at `step`."""
        prefix = (
            f"step {step}: rank {self.rank} waited over {self.timeout_s:g} s (--timeout-s) "
            "for the other ranks"
        )
        if self._store is None:
            return TrainingFailed(prefix, report=True)
        try:
            others = [r for r in range(self.num_ranks) if r != self.rank]
            before = {r: self._store.add(f"zellige/beats/{r}", 0) for r in others}
            time.sleep(3 * self._BEAT_S)
            frozen = [r for r in others if self._store.add(f"zellige/beats/{r}", 0) == before[r]]
            steps = {}
            for r in others:
                if self._store.check([f"zellige/step/{r}"]):
                    steps[r] = int(self._store.get(f"zellige/step/{r}").decode())
            behind = [r for r, s in steps.items() if s < step]
            if frozen:
                detail = f"rank {_ranks(frozen)} stopped responding (stopped, frozen or dead)"
            elif behind:
                detail = ", ".join(f"rank {r} is still at step {steps[r]}" for r in behind)
            else:
                detail = "every rank is alive at this step: a rank is stuck inside it"
            report = self._first_report()
        except Exception:  # the store itself is gone: say what this rank knows
            return TrainingFailed(prefix, report=True)
        return TrainingFailed(f"{prefix}: {detail}", report=report)

    def close(self) -> None:
        self._stop.set()


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
