#!/usr/bin/env bash
# README command two: install into .venv (first run only), lint, then the default test suite.
# Extra arguments go to pytest, e.g.  bash scripts/test.sh -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check grouprl tests scripts
.venv/bin/ruff format --check grouprl tests scripts
if [ "$#" -eq 0 ]; then
  # The in-process vLLM engine leaves process-wide state behind (a torch.distributed group, env
  # variables), so the vllm-marked tests run in a pytest process of their own, after the rest.
  status=0
  .venv/bin/python -m pytest -q -m "not slow and not vllm" || status=$?
  .venv/bin/python -m pytest -q -m "vllm and not slow" --ignore=tests/test_vllm_push.py || status=$?
  # vLLM builds its expert-parallel group only when the first engine of a process is an MoE
  # model: the MoE push tests fail ("expert parallel group is not initialized") after a dense
  # engine in the same process, so they get a process of their own.
  .venv/bin/python -m pytest -q -m "vllm and not slow" tests/test_vllm_push.py || status=$?
  exit "$status"
fi
exec .venv/bin/python -m pytest -q "$@"
