#!/usr/bin/env bash
# Download (here, with network) the wheels scripts/gpu_check.sh and scripts/gpu_configs.sh install on
# the GPU machine, which
# has torch, transformers, accelerate, peft, tokenizers, sentencepiece, numpy, pandas, pyarrow ...
# but not diffusers nor the rest of grouprl's dependencies, and no network. Into .whl/ (git-ignored;
# carry it to the GPU machine: `run(carry=[".whl"], ...)`). Versions: the ones this project's venv
# runs. Python 3.12 / manylinux x86_64, binary wheels only, no dependency resolution (each needed
# package is named).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/work/main/.venv/bin/python}
WHEELS=(
  diffusers==0.42.1 importlib_metadata==10.2.0                                   # pipelines
  pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5  # config
  gymnasium==1.4.0 Farama-Notifications==0.0.6                                    # envs
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2 # math rewards
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19                               # tasks
  trl==1.16.0                                  # gpu_check.sh's comparison (TRL imports datasets)
)
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d .whl "${WHEELS[@]}"
ls -la .whl
du -sh .whl
