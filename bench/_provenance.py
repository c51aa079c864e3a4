"""Machine and commit lines for the table a benchmark prints last, and its markdown report
(bench/ is on sys.path when a script in it runs)."""

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


def write_report(out: Path, title: str, script: str, argv: list[str] | None, text: str) -> None:
    """Writes `text` under a title and the command that reproduces it."""
    arguments = shlex.join(argv if argv is not None else sys.argv[1:])
    command = f"PYTHONPATH=src python bench/{script} {arguments}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# {title}\n\nCommand: `{command}`\n\n{text}\n")
