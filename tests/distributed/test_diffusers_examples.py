"""The diffusers examples as a user runs them: torchrun on CPU (gloo, float64), a hand-made plan
with a sequence under ring and one under Ulysses, --check against the unmodified diffusers model
in one process (loss and every parameter's gradient; examples/diffusers_*.py say how closely),
and a rank that holds no token of a step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("diffusers", reason="the diffusers extra is not installed (zellige[diffusers])")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _torchrun(script: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    return subprocess.run(
        [*command, str(script), *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "script,nproc", [("diffusers_wan.py", 3), ("diffusers_flux.py", 2)], ids=["wan-3", "flux-2"]
)
def test_diffusers_example_matches_the_unmodified_model(script, nproc) -> None:
    result = _torchrun(EXAMPLES / script, nproc, "--steps", "2", "--check")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "PASS" in result.stdout
    assert "(local, ring, ulysses)" in result.stdout  # both distributed strategies ran


def test_a_rank_without_tokens_runs_the_packed_models() -> None:
    result = _torchrun(Path(__file__).with_name("diffusers_empty_rank_worker.py"), 2)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "PASS" in result.stdout
