#!/usr/bin/env bash
# Make (or refresh) .venv-bench: a separate virtual environment for the benchmarks that compare
# grouprl with TRL. TRL is never a dependency of grouprl itself; it lives only here, pinned.
# torch is installed FIRST and pinned (an unpinned torch pulls a multi-GB CUDA build), then TRL
# and transformers at versions known to work with grouprl, then grouprl itself (editable).
# pip's output goes to .venv-bench/install.log; it is printed only if the install fails.
# Prints the environment's python path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
TRL_PIN="trl==1.16.0"
TRANSFORMERS_PIN="transformers==5.19.0"
VENV=.venv-bench
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "*" > "$VENV/.gitignore"  # git never sees the environment
stamp="$VENV/.bench-installed"
want="$TORCH_PIN $TRL_PIN $TRANSFORMERS_PIN"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || [ pyproject.toml -nt "$stamp" ]; then
  echo "installing $want and grouprl into $VENV (first run only, a few minutes; log: $VENV/install.log)" >&2
  if ! {
    "$VENV/bin/python" -m pip install -q --upgrade pip &&
      "$VENV/bin/python" -m pip install -q "$TORCH_PIN" &&
      "$VENV/bin/python" -m pip install -q "$TORCH_PIN" "$TRL_PIN" "$TRANSFORMERS_PIN" -e .
  } > "$VENV/install.log" 2>&1; then
    cat "$VENV/install.log" >&2
    echo "installation of $VENV failed (log above)" >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
echo "$PWD/$VENV/bin/python"
