#!/usr/bin/env bash
# Incremental developer build: C++ core, GoogleTest suite and zellige._core, copied into
# src/zellige/ so that `PYTHONPATH=src python -c "import zellige"` works from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
cmake -S . -B build/dev -G Ninja -DCMAKE_BUILD_TYPE=Release -DZELLIGE_BUILD_TESTS=ON \
  -DPython_EXECUTABLE="$(command -v "$PY")" >/dev/null
cmake --build build/dev -j "$(nproc)"
cp -f build/dev/_core*.so src/zellige/
# Keep the typing stubs of the private module in the tree, generated, never edited by hand.
"$PY" -c "import sys; sys.path.insert(0, 'src'); from nanobind.stubgen import main; \
main(['-q', '-m', 'zellige._core', '-o', 'src/zellige/_core.pyi'])"
