#!/usr/bin/env bash
# One-command setup on a fresh Debian machine: GoogleTest, a virtual environment in .venv with the
# CPU build of PyTorch, and zellige itself (C++ core built by scikit-build-core + nanobind).
# Each step says what it does and how long it took: on two cores, 2 minutes in all (downloads
# cached) to 9.5 minutes under other builds' load, most of it compiling in step 5 (README, Set
# up). The C++ is compiled once, in build/core, for both the package and the GoogleTest suite;
# scripts/test.sh rebuilds that tree incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
step() { printf '[setup %s/5 %3ds] %s\n' "$1" $((SECONDS - START)) "$2"; }
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "setup: zellige needs Python >= 3.11; $PY is $("$PY" --version 2>&1)" >&2
  exit 2
fi
step 1 "GoogleTest (apt, only if missing)"
if [ ! -f /usr/include/gtest/gtest.h ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgtest-dev >/dev/null
fi
step 2 "virtual environment .venv ($("$PY" --version 2>&1))"
[ -d .venv ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
step 3 "PyTorch 2.13.0, CPU build (about 200 MB download)"
# Pinned: the CPU build (an unpinned torch pulls a CUDA build of several GB).
.venv/bin/python -m pip install -q torch==2.13.0
step 4 "build tools: cmake, ninja, nanobind, scikit-build-core"
.venv/bin/python -m pip install -q cmake ninja nanobind scikit-build-core
step 5 "zellige: compiling the C++ core, bindings and GoogleTest suite, installing the package"
# The build requirements are installed just above, so build without an isolated environment.
# scripts/test.sh builds and installs with the same settings: keep the two in step.
.venv/bin/python -m pip install -q --no-build-isolation -C build-dir=build/core \
  -C cmake.define.ZELLIGE_BUILD_TESTS=ON ".[test,train,milp,plot,docs,diffusers]"
printf '[setup done %3ds] commands are in .venv/bin (e.g. .venv/bin/zellige, .venv/bin/torchrun);\n' \
  $((SECONDS - START))
echo "  or: source .venv/bin/activate"
