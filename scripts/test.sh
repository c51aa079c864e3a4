#!/usr/bin/env bash
# The whole test suite: C++ (GoogleTest via ctest) then Python (pytest, incl. multi-process gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
export PATH="$BIN:$PATH"
cmake -S . -B build/test -G Ninja -DCMAKE_BUILD_TYPE=Release -DZELLIGE_BUILD_TESTS=ON \
  -DZELLIGE_BUILD_PYTHON=OFF >/dev/null
cmake --build build/test -j "$(nproc)"
(cd build/test && ctest --output-on-failure)
"$PY" -m pytest -q "$@"
