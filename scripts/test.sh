#!/usr/bin/env bash
# The test suite, in two tiers; both run the whole C++ suite (GoogleTest via ctest) first and
# build the docs site last:
#   bash scripts/test.sh          the fast tier: pytest without the tests marked `slow`
#                                 (tests/conftest.py lists them); every layer is still covered.
#   bash scripts/test.sh --full   every test: what .ci/run runs.
# Other arguments go to pytest (e.g. `bash scripts/test.sh -k cli`). PYTHON is the interpreter
# of the environment to install into and test (default .venv/bin/python, made by setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
BUILD=build/core  # the C++ build tree scripts/setup.sh made; one tree for _core and the C++ tests
full=0
pytest_args=()
for arg in "$@"; do
  if [ "$arg" = "--full" ]; then full=1; else pytest_args+=("$arg"); fi
done
if [ ! -x "$PY" ] || [ ! -f "$BUILD/CMakeCache.txt" ]; then
  echo "test.sh: $PY or the C++ build in $BUILD is missing: run 'bash scripts/setup.sh' first" >&2
  exit 2
fi
export PATH="$(dirname "$PY"):$PATH"
# Install this tree into the venv before testing it: ninja recompiles only what a C++ edit touched
# (core, bindings and GoogleTest suite share the tree), and edited Python files are copied in.
# The same settings as scripts/setup.sh, so nothing is reconfigured or compiled twice.
"$PY" -m pip install -q --no-build-isolation --no-deps -C build-dir="$BUILD" \
  -C cmake.define.ZELLIGE_BUILD_TESTS=ON .
# In parallel: the randomised never-worse test alone takes most of the C++ suite's time.
(cd "$BUILD" && ctest --output-on-failure -j "$(nproc)")
# pytest exits 5 when it collected no test (e.g. an empty tests/distributed); that is not a failure.
rc=0
if [ "$full" -eq 1 ]; then
  "$PY" -m pytest -q "${pytest_args[@]}" || rc=$?
else
  "$PY" -m pytest -q -m "not slow" "${pytest_args[@]}" || rc=$?
fi
if [ "$rc" -eq 5 ]; then rc=0; fi
# The docs site (mkdocs.yml): --strict fails on a broken link or an API reference that is gone.
"$PY" -m mkdocs build --strict --site-dir build/site || rc=1
exit "$rc"
