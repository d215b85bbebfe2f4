"""Tree vs flat rollouts of the CPU diffusion demo at equal denoising steps sampled.

The demo (grouprl/demos/images.py, configs/diffusion/shapes_flow_grpo.yaml: a tiny flow model of
16x16 coloured shapes, Flow-GRPO, the color_area reward, 10 rollout steps, groups of 8) is
pretrained once (cached; `--pretrain-steps`, the demo's 1500 by default), then
fine-tuned from the same weights with
- flat: 5 prompts x 8 independent images per step, every image runs its 10 steps: 400 steps run;
- tree: 8 prompts x a tree per group, branching [2, 4] with the branch at step 5 (rollout.tree),
        depth-wise advantages (algorithm.tree_advantage branch_grpo): per group 2 x 5 + 8 x 5 = 50
        steps run, 8 x 50 = 400 per optimizer step;
- tree_leaf: the same tree with plain GRPO over its 8 leaves (tree_advantage leaf_group),
for `--steps` optimizer steps and each of `--seeds` (run.seed). Reported: held-out reward (the
demo's 12 prompts x 4 fixed seeds, 20 deterministic steps) before and after, and the denoising
steps sampled in all (the sum of rollout/sampled_actions). Runs are sequential in this process;
the wall seconds include the evaluations, and a tree step trains 64 leaf rows where a flat step
trains 40.

    .venv/bin/python benchmarks/tree_flows.py [--steps 30 --seeds 0 1 2 --pretrain-steps 1500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grouprl.config.loading import load_config  # noqa: E402
from grouprl.demos.images import CONFIG  # noqa: E402
from grouprl.demos.pretrain import PretrainSettings, cached_pretrain  # noqa: E402
from grouprl.train import train  # noqa: E402

ARMS = {
    "flat": ["rollout.prompts_per_step=5"],
    "tree": [
        "rollout.prompts_per_step=8",
        "rollout.tree={type: fixed, branching: [2, 4], branch_at: [5]}",
        "algorithm.tree_advantage=branch_grpo",
    ],
    "tree_leaf": [  # the same tree, plain GRPO over the leaves (separates sampling from credit)
        "rollout.prompts_per_step=8",
        "rollout.tree={type: fixed, branching: [2, 4], branch_at: [5]}",
    ],
}


def run_arm(arm: str, seed: int, steps: int, weights: Path, out: Path) -> dict:
    overrides = [
        *ARMS[arm], f"model.weights={weights}", f"run.seed={seed}", f"train.steps={steps}",
        f"eval.every={steps}", f"checkpoint.every={steps}", f"run.output_dir={out}",
        f"run.name={arm}-seed{seed}", "run.overwrite=true", "run.console=false",
    ]  # fmt: skip
    cfg = load_config(str(CONFIG), overrides)
    t0 = time.time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = train(cfg)
    rows = [json.loads(x) for x in (Path(result["run_dir"]) / "metrics.jsonl").read_text().splitlines()
            if x]  # fmt: skip
    sampled = sum(r.get("rollout/sampled_actions", 0.0) for r in rows if r["split"] == "train")
    return {"arm": arm, "seed": seed, "before": result["before"]["reward"],
            "after": result["after"]["reward"], "sampled": sampled, "seconds": time.time() - t0}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--pretrain-steps", type=int, default=PretrainSettings.steps)
    p.add_argument("--out", default=str(ROOT / "runs" / "tree_flows"))
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    weights = cached_pretrain(PretrainSettings(steps=args.pretrain_steps), out / "pretrain")
    results = [run_arm(arm, s, args.steps, weights, out) for s in args.seeds for arm in args.arms]
    print(f"\n{'arm':<10}{'seed':>5}{'before':>9}{'after':>9}{'steps sampled':>15}{'s':>7}")
    for r in results:
        print(f"{r['arm']:<10}{r['seed']:>5}{r['before']:>9.4f}{r['after']:>9.4f}"
              f"{r['sampled']:>15.0f}{r['seconds']:>7.0f}")  # fmt: skip
    for arm in args.arms:
        after = [r["after"] for r in results if r["arm"] == arm]
        sd = statistics.stdev(after) if len(after) > 1 else 0.0
        print(f"{arm}: held-out reward after {args.steps} steps {statistics.mean(after):.4f} "
              f"+- {sd:.4f} (sd over {len(after)} seeds)")  # fmt: skip
    (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
