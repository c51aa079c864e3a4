#!/usr/bin/env bash
# One-command setup on a fresh Debian machine: GoogleTest, a virtual environment in .venv with the
# CPU build of PyTorch, and zellige itself (C++ core built by scikit-build-core + nanobind).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -f /usr/include/gtest/gtest.h ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libgtest-dev >/dev/null
fi
[ -d .venv ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# Pinned: the CPU build (an unpinned torch pulls a CUDA build of several GB).
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q cmake ninja nanobind scikit-build-core
# The build requirements are installed just above, so build without an isolated environment.
.venv/bin/python -m pip install -q --no-build-isolation ".[test,train,milp,plot,docs]"
echo "setup done: source .venv/bin/activate"
