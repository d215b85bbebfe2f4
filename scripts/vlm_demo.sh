#!/usr/bin/env bash
# The VLM demo: install into .venv (first run only), then a tiny Qwen2-VL replica, warmed up on
# questions about rendered shapes, learns them with GRPO on 2 CPU cores.
# Extra arguments are config overrides, e.g.  bash scripts/vlm_demo.sh train.steps=30
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m grouprl.demos.vlm "$@"
