#!/usr/bin/env bash
# README command one: install into .venv (first run only), then run the CPU demo.
# Extra arguments are config overrides, e.g.  bash scripts/demo.sh algorithm.preset=dr_grpo
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m grouprl.demos.arithmetic "$@"
