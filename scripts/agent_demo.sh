#!/usr/bin/env bash
# The agent demo: install into .venv (first run only), then a tiny LM agent learns text FrozenLake
# with GiGPO, next to multi-turn GRPO. Extra arguments are config overrides for both runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m grouprl.demos.agent "$@"
