#!/usr/bin/env bash
# Set up, then run the main job on the embedded default: write a tiny random-weight Qwen3-MoE
# checkpoint from its transformers config (no download), rewrite it with plans/auto-ep2.yaml, run it
# expert-parallel on 2 local gloo ranks and verify logits and every gradient against the unmodified
# model. Extra arguments go to `hp-rewrite apply` (e.g. --report report.json).
set -euo pipefail
cd "$(dirname "$0")/.."
. tools/setup_env.sh
MODEL_TYPE="${MODEL_TYPE:-qwen3_moe}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
hp-rewrite make-tiny "$MODEL_TYPE" "$WORK/model"
hp-rewrite apply plans/auto-ep2.yaml "$WORK/model" --out "$WORK/generated" --nproc 2 --verify "$@"
hp-rewrite inspect "$WORK/generated"
