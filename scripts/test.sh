#!/usr/bin/env bash
# README command two: install into .venv (first run only), lint, then the default test suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check grouprl tests scripts
.venv/bin/ruff format --check grouprl tests scripts
if [ "$#" -eq 0 ]; then set -- -m "not slow"; fi
exec .venv/bin/python -m pytest -q "$@"
