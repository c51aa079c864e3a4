"""Rules on the C++ sources that no compiler checks."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_core_uses_no_iostreams():
    """A std::ostringstream in the zellige planner crashed (SIGSEGV in its locale facets) in
    every process that had loaded torch first, on the H200 machine's build; strings are built
    with std::to_string and snprintf instead."""
    pattern = re.compile(r"#include\s*<(sstream|iostream|ostream|istream|fstream|iomanip)>")
    offenders = [
        str(path.relative_to(ROOT))
        for folder in ("cpp/src", "cpp/include", "cpp/bindings")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".h", ".cc") and pattern.search(path.read_text())
    ]
    assert offenders == []
