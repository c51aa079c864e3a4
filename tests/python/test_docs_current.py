"""docs/api.md and docs/cli.md are generated (scripts/gen_docs.py) and checked in, so they read
as they stand in the repository; this fails when either differs from what the code says now."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_generated_reference_pages_are_current() -> None:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_docs.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr


def test_the_api_page_has_no_directives_left() -> None:
    text = (REPO / "docs" / "api.md").read_text()
    assert ":::" not in text and "make_placement" in text and "plan_from_dict" in text
