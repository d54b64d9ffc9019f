#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: a tiny Qwen3-MoE model built from its
# transformers config, expert-parallel on 2 local gloo ranks, checked against the unmodified model.
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/setup_env.sh
hp-rewrite selfcheck --model-type qwen3_moe --nproc 2 "$@"
