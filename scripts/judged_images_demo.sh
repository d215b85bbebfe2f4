#!/usr/bin/env bash
# The judged-images demo: install into .venv (first run only), then Flow-GRPO on the shapes model
# with color_area alone and with color_area plus a VLM judge, side by side (2 CPU cores).
# Extra arguments are config overrides for both runs, e.g.  bash scripts/judged_images_demo.sh train.steps=60
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m grouprl.demos.judged_images "$@"
