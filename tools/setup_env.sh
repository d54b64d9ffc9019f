#!/usr/bin/env bash
# Create (or reuse) the project virtual environment and install hp-rewrite into it.
# Sourced by tools/demo.sh and tools/test.sh. torch is pinned first: the CPU build of 2.13.0 is what
# pip finds locally, while an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
VENV="${HP_REWRITE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
