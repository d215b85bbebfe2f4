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

import signal_methods

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
    signal_methods.main(__doc__, METHODS, "runs/tree-text", "tree_text.json", baseline="flat8")


if __name__ == "__main__":
    main()
