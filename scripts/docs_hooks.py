"""mkdocs hook: the command line reference (docs/cli.md) is the CLI's own --help, run at build
time, so the page cannot drift from the parser."""

from __future__ import annotations

import os
import subprocess
import sys

MARKER = "<!-- zellige-cli-help -->"


def _help(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "100"}
    result = subprocess.run(
        [sys.executable, "-m", "zellige.cli", *args, "--help"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return result.stdout.rstrip()


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    from zellige.cli import COMMANDS

    parts = ["```text", _help(), "```"]
    for name in COMMANDS:
        parts += [f"## zellige {name}", "", "```text", _help(name), "```", ""]
    return markdown.replace(MARKER, "\n".join(parts))
