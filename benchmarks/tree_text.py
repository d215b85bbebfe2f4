"""Tree rollouts against flat sampling on the CPU arithmetic task: compute saved and learning.

Same protocol as benchmarks/signal_methods.py (the demo's warm-up per seed, the demo config, the
first --max-train problems, held-out greedy accuracy after --steps): only the sampling and the
advantage change. Answers are 1-3 characters and an EOS, so the trees branch at the first and the
second completion token (segment_tokens 1):

  flat8       GRPO, 8 independent samples per prompt
  tree8       8 leaves of a binary tree of depth 3 (branching [2, 2, 2]), GRPO advantages of the
              leaves (tree_advantage leaf_group): the tree's sampling alone
  treerpo8    the same tree with the treerpo preset (sibling-standardised segment advantages,
              each shared segment counted once)
  treerpo16   branching [2, 2, 4]: 16 leaves for about the tokens flat8 samples

    .venv/bin/python benchmarks/tree_text.py [--steps 150] [--seeds 0 1 2] [--output-dir DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.console import Console
from signal_methods import collect, report, run
from transformers.utils import logging as hf_logging

TREE = "rollout.tree={type: fixed, branching: [2, 2, 2], segment_tokens: 1}"
METHODS: dict[str, list[str]] = {
    "flat8": ["algorithm.preset=grpo", "rollout.seeding=per_sample"],
    "tree8": ["algorithm.preset=grpo", "rollout.seeding=per_sample", TREE],
    "treerpo8": ["algorithm.preset=treerpo", "rollout.seeding=per_sample", TREE],
    "treerpo16": [
        "algorithm.preset=treerpo",
        "rollout.seeding=per_sample",
        "rollout.group_size=16",
        "rollout.tree={type: fixed, branching: [2, 2, 4], segment_tokens: 1}",
    ],
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--n-eval", type=int, default=300)
    p.add_argument("--max-train", type=int, default=640)
    p.add_argument("--warmup-max-steps", type=int, default=3000)
    p.add_argument("--output-dir", default="runs/tree-text")
    p.add_argument("--collect", nargs="+", metavar="DIR",
                   help="only report: merge these output directories (one per seed)")  # fmt: skip
    args = p.parse_args()
    if args.collect:
        merged = collect(args.collect, Path(args.output_dir), "tree_text.json")
        print(report({m: merged[m] for m in METHODS if m in merged}, Path(args.output_dir),
                     args.steps, baseline="flat8"))  # fmt: skip
        return
    torch.set_num_threads(1)
    hf_logging.disable_progress_bar()
    Path(args.output_dir).mkdir(parents=True, exist_ok=True)
    results = run(args, Console(), METHODS)
    print(report({m: results[m] for m in METHODS if m in results}, Path(args.output_dir),
                 args.steps, baseline="flat8"))  # fmt: skip


if __name__ == "__main__":
    main()
