#!/usr/bin/env bash
# The whole test suite: C++ (GoogleTest via ctest) then Python (pytest, incl. multi-process gloo).
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k cli`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BIN=$(dirname "$PY")
export PATH="$BIN:$PATH"
cmake -S . -B build/test -G Ninja -DCMAKE_BUILD_TYPE=Release -DZELLIGE_BUILD_TESTS=ON \
  -DZELLIGE_BUILD_PYTHON=OFF >/dev/null
cmake --build build/test -j "$(nproc)"
(cd build/test && ctest --output-on-failure)
# pytest exits 5 when it collected no test (e.g. an empty tests/distributed); that is not a failure.
rc=0
"$PY" -m pytest -q "$@" || rc=$?
if [ "$rc" -eq 5 ]; then rc=0; fi
# The docs site (mkdocs.yml): --strict fails on a broken link or an API reference that is gone.
"$PY" -m mkdocs build --strict --site-dir build/site || rc=1
exit "$rc"
