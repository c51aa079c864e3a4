"""The README's commands work as written (issue 17): every fenced block marked with a line
`<!-- ci: run -->` is run, command by command, in a fresh directory; a block marked
`<!-- ci: file NAME -->` is written there as NAME first; a block marked `<!-- ci: output ... -->`
must equal what the run block before it printed (less its last column, wall time). Setup and
GPU commands are not marked.

On a machine set up by scripts/setup.sh (CI), `.venv/bin/` is the repository's own venv. In a
developer checkout without one, it stands for the running interpreter's bin directory, with this
tree's src/ first on PYTHONPATH, so the commands still exercise this tree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- ci: (run|file|output)\b\s*(\S*)[^>]*-->\s*$")
WALL_TIME_COLUMN = re.compile(r"\s+\d+\.\d+$")  # compare's `plan ms`, the last cell of a row


@dataclass
class Block:
    kind: str  # run | file | output
    arg: str  # the file name of a `file` block
    text: str
    line: int
    language: str = "bash"  # of a `run` block: bash commands, or one python program


def marked_blocks(readme: str) -> list[Block]:
    blocks, lines, i = [], readme.splitlines(), 0
    while i < len(lines):
        marker = MARKER.match(lines[i])
        if marker:
            j = i + 1
            while not lines[j].strip():
                j += 1
            assert lines[j].startswith("```"), f"README line {i + 1}: marker not before a block"
            end = lines.index("```", j + 1)
            text = "\n".join(lines[j + 1 : end])
            language = lines[j][3:].strip() or "bash"
            blocks.append(Block(marker[1], marker[2], text, i + 1, language))
            i = end
        i += 1
    return blocks


def commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped."""
    joined = block.replace("\\\n", " ")
    return [
        " ".join(line.split())
        for line in joined.splitlines()
        if line.strip() and not line.startswith("#")
    ]


def environment() -> tuple[str, dict[str, str]]:
    venv_bin = REPO / ".venv" / "bin"
    env = dict(os.environ)
    if not venv_bin.is_dir():
        venv_bin = Path(sys.executable).parent
        env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO / "src"), *filter(None, [env.get("PYTHONPATH")])]
        )
    return str(venv_bin) + "/", env


README_BLOCKS = marked_blocks((REPO / "README.md").read_text())


def test_the_readme_marks_the_cpu_commands():
    text = "\n".join(block.text for block in README_BLOCKS if block.kind == "run")
    for command in ("zellige compare", "torchrun", "zellige plan", "zellige show"):
        assert command in text
    # Every command of a marked block runs from the venv, as the README tells a newcomer to.
    for block in README_BLOCKS:
        if block.kind == "run" and block.language == "bash":
            for command in commands(block.text):
                assert command.startswith(".venv/bin/"), command


def test_readme_commands_run_as_written(tmp_path):
    venv_bin, env = environment()

    def run(command: str) -> str:
        result = subprocess.run(
            command.replace(".venv/bin/", venv_bin),
            shell=True,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, (command, result.stdout[-2000:], result.stderr)
        return result.stdout

    last_output = None
    for block in README_BLOCKS:
        if block.kind == "file":
            (tmp_path / block.arg).write_text(block.text + "\n")
        elif block.kind == "run" and block.language == "python":
            (tmp_path / "readme_block.py").write_text(block.text + "\n")
            last_output = run(".venv/bin/python readme_block.py")
        elif block.kind == "run":
            last_output = "".join(run(command) for command in commands(block.text))
        else:
            assert last_output is not None, f"README line {block.line}: output before any run"
            shown = [WALL_TIME_COLUMN.sub("", line) for line in block.text.splitlines()]
            printed = [WALL_TIME_COLUMN.sub("", line) for line in last_output.splitlines()]
            assert printed == shown, f"README line {block.line}: the output differs"


@pytest.mark.parametrize(
    "text", ["```bash\nx\n```", "<!-- ci: run -->\n```bash\na \\\n  b\n# c\n```"]
)
def test_block_parser(text):
    blocks = marked_blocks(text)
    if "ci:" in text:
        assert [commands(b.text) for b in blocks] == [["a b"]]
    else:
        assert blocks == []
