#!/usr/bin/env bash
# Create (or reuse) the project virtual environment and install hp-rewrite into it.
# Sourced by tools/demo.sh and tools/test.sh. torch is pinned first: the CPU build of 2.13.0 is what
# pip finds locally, while an unpinned torch would pull a multi-GB CUDA build.
# Two runs in one clone share the environment: setups take turns under a lock, and one that finds it
# installed from the same pyproject.toml and this script installs nothing, so it never reinstalls
# hp-rewrite under a test run beside it (delete the folder to install afresh).
set -euo pipefail
VENV="${HP_REWRITE_VENV:-.venv}"
mkdir -p "$VENV"
stamp=$(python3 -c 'import hashlib, sys; print(hashlib.sha256(b"".join(open(f, "rb").read() for f in sys.argv[1:])).hexdigest())' \
    pyproject.toml tools/setup_env.sh)
(
    if command -v flock >/dev/null 2>&1; then flock 9; fi
    if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.hp-rewrite-installed" 2>/dev/null)" = "$stamp" ]; then
        exit 0
    fi
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
    "$VENV/bin/python" -m pip install --quiet -e ".[test]"
    echo "$stamp" > "$VENV/.hp-rewrite-installed"
) 9>"$VENV/.setup.lock"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
