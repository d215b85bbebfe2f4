#!/usr/bin/env bash
# The GPU check of issue 18 (item 7): a GRPO step of grouprl beside TRL 1.16's GRPOTrainer on a
# Qwen2.5-0.5B-architecture replica, 64 prompts x 8 samples, 512 new tokens (benchmarks/gpu_check.py
# says exactly what runs). Under 8 minutes on one H200-class GPU, no network.
#
#   bash scripts/gpu_check.sh --prepare     # here, with network: the wheels into .whl/ (git-ignored)
#   bash scripts/gpu_check.sh               # on the GPU machine: carry .whl (device run: carry=[".whl"])
#   bash scripts/gpu_check.sh --tiny        # CPU: a tiny Qwen2, 1 step per side (tests/test_gpu_check.py)
#   other options go to benchmarks/gpu_check.py: --frameworks grouprl  --steps N  --warmup N ...
#
# The GPU machine has torch, transformers, accelerate and peft but not TRL, datasets, pydantic
# (grouprl's config), gymnasium, math-verify ... : --prepare downloads their wheels (about 15 MiB;
# scripts/gpu_wheels.sh names each, pinned), and this script installs them into /tmp/site there.
# The table goes to stdout and, as gpu_check.md / gpu_check.json, to $OUT when it is set (else
# benchmarks/results/). The shipped-configs smoke check that had this name is scripts/gpu_configs.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if [ "${1:-}" = "--prepare" ]; then
  shift
  exec bash scripts/gpu_wheels.sh "$@"
fi
extra=()
if ! "$PY" -c "import pydantic, gymnasium, datasets, trl" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null && "$PY" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))"; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  elif "$PY" -c "import pydantic, gymnasium" 2>/dev/null && [[ " $* " == *" --tiny "* ]]; then
    echo "gpu_check: TRL is not installed and there is no .whl/ folder: grouprl only" >&2
    extra=(--frameworks grouprl)
  else
    echo "gpu_check: TRL or a grouprl dependency is missing and there is no .whl/ folder for" \
      "this Python 3.12 (run: bash scripts/gpu_check.sh --prepare, on a machine with network)" >&2
    exit 1
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1 PYTHONUNBUFFERED=1
exec "$PY" benchmarks/gpu_check.py "${extra[@]}" "$@"
