"""Command, machine, versions and commit of a benchmark run: the lines a script prints first and
writes at the top of its output (bench/ is on sys.path when a script in it runs)."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path


def machine() -> str:
    cpu = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.machine()}, {cpu}, {os.cpu_count()} cores"


def git_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def versions() -> str:
    """Python and zellige always; torch, CUDA, cuDNN and the GPU only where the script imported
    torch (a planner-only script must not pull it in)."""
    import importlib.metadata

    try:
        zellige_version = importlib.metadata.version("zellige")
    except importlib.metadata.PackageNotFoundError:
        zellige_version = "source tree"
    parts = [f"python {platform.python_version()}", f"zellige {zellige_version}"]
    torch = sys.modules.get("torch")
    if torch is not None:
        parts.append(f"torch {torch.__version__}")
        if torch.cuda.is_available():
            parts += [
                f"CUDA {torch.version.cuda}",
                f"cuDNN {torch.backends.cudnn.version()}",
                torch.cuda.get_device_name(),
            ]
    return ", ".join(parts)


def header(script: str, argv: list[str] | None = None) -> dict[str, str]:
    """What reproduces a run and where it ran; a script prints it first and puts it at the top of
    the file it writes."""
    arguments = shlex.join(argv if argv is not None else sys.argv[1:])
    return {
        "command": f"PYTHONPATH=src python bench/{script} {arguments}".rstrip(),
        "machine": machine(),
        "versions": versions(),
        "commit": git_commit(),
    }


def print_header(provenance: dict[str, str]) -> None:
    for key, value in provenance.items():
        print(f"{key}: {value}", flush=True)


def write_report(out: Path, title: str, script: str, argv: list[str] | None, text: str) -> None:
    """Writes `text` under a title and the command that reproduces it."""
    arguments = shlex.join(argv if argv is not None else sys.argv[1:])
    command = f"PYTHONPATH=src python bench/{script} {arguments}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {title}\n\nCommand: `{command}`\n\n{text}\n")
