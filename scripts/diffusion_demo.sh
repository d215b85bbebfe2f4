#!/usr/bin/env bash
# The image demo: install into .venv (first run only), then pretrain a tiny flow-matching model on
# synthetic coloured shapes (cached) and fine-tune it with Flow-GRPO on 2 CPU cores.
# Extra arguments are config overrides, e.g.  bash scripts/diffusion_demo.sh train.steps=60
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m grouprl.demos.images "$@"
