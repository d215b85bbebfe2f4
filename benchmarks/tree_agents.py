"""Tree vs flat episode groups on the CPU agent demo (text FrozenLake), at equal sampled tokens.

Both runs start from the demo's supervised warm-up checkpoint (grouprl/demos/agent.py) and use its
config (configs/agents/frozenlake_gigpo.yaml) with agent.credit=trajectory (multi-turn GRPO on the
episode return) and per-sample seeding; they differ only in the group:
  flat  8 independent episodes per env seed
  tree  rollout.tree {fixed, branching [2, 2, 2], branch_at [2, 4] turns} (8 leaf episodes whose
        first 2 and next 2 turns are shared) and algorithm.tree_advantage tree_grpo (Tree-GRPO,
        arXiv 2509.21240; rollouts/agent_fork.py)
A tree samples fewer tokens per step, so it runs more steps (--tree-steps, default 2.3 x --steps: ~0.45 x the tokens per step);
the table compares them at equal sampled tokens: flat after --steps steps against the tree at its
first step whose cumulative rollout/sampled_actions reaches flat's. Success = the training
episodes' success rate (sampled at temperature 1) averaged over the last --window steps up to
that point (row tree= : the tree at flat's step count instead, with fewer tokens); eval = the
sampled success of eval.pass_k episodes per held-out seed at the closest
evaluation. Runs go two at a time, one CPU thread each.

    python benchmarks/tree_agents.py [--steps 15] [--seeds 0 1 2] [--out runs/tree-agents]
    (grouprl bench tree-agents; the table: --report-only; rows also in benchmarks/results/tree_agents.json)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "agents" / "frozenlake_gigpo.yaml"
COMMON = ["agent.credit=trajectory", "rollout.seeding=per_sample", "eval.pass_k=8",
          "task.options.n_eval=4", "run.console=false", "run.num_threads=1", "run.overwrite=true",
          "checkpoint.every=0"]  # fmt: skip
TREE = ["rollout.tree={type: fixed, branching: [2, 2, 2], branch_at: [2, 4]}",
        "algorithm.tree_advantage=tree_grpo"]  # fmt: skip


def warm_checkpoint(out: Path) -> Path:
    """The demo's warm-up checkpoint (built once, reused)."""
    from rich.console import Console

    from grouprl.config.loading import load_config
    from grouprl.demos.agent import warm_up

    defaults = argparse.Namespace(warmup_episodes=400, warmup_steps=80, expert_p=0.7,
                                  warmup_maps="random", warmup_frozen_prob=0.8)  # fmt: skip
    cfg = load_config(CONFIG, [])
    out.mkdir(parents=True, exist_ok=True)
    return warm_up(cfg, out / "warmup", defaults, Console())


def launch(name: str, out: Path, model: Path, seed: int, steps: int, every: int, extra: list[str]):
    args = [*COMMON, *extra, f"model.name_or_path={model}", f"run.name={name}",
            f"run.output_dir={out}", f"run.seed={seed}", f"train.steps={steps}",
            f"eval.every={every}"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    log = open(out / f"{name}.log", "w")  # noqa: SIM115 (closed by the caller)
    cmd = [sys.executable, "-m", "grouprl", "train", str(CONFIG), *args]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env), log


def rows(run_dir: Path, split: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("split") == split or split in r]


def at_tokens(
    run_dir: Path, budget: float | None, window: int, max_step: int | None = None
) -> dict:
    """Training success over the last `window` steps up to the first step whose cumulative
    sampled tokens reach `budget` (None: the last step, or step `max_step`), and the closest
    sampled evaluation."""
    train = [r for r in rows(run_dir, "train") if "rollout/sampled_actions" in r]
    train = [r for r in train if max_step is None or r["step"] <= max_step]
    cum, upto = 0.0, len(train)
    for k, r in enumerate(train):
        cum += r["rollout/sampled_actions"]
        if budget is not None and cum >= budget:
            upto = k + 1
            break
    used = train[:upto]
    tokens = sum(r["rollout/sampled_actions"] for r in used)
    last = used[-window:]
    success = sum(r["episode/success"] for r in last) / len(last)
    step = used[-1]["step"]
    evals = [r for r in rows(run_dir, "eval/sampled_success")]
    ev = min(evals, key=lambda r: abs(r["step"] - step)) if evals else None
    return {"step": step, "tokens": tokens, "success": success,
            "eval": ev["eval/sampled_success"] if ev else math.nan,
            "eval_step": ev["step"] if ev else -1,
            "tokens_per_step": tokens / len(used)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--tree-steps", type=int, default=None)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--every", type=int, default=5, help="eval.every of both runs")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "tree-agents")
    p.add_argument("--report-only", action="store_true", help="tabulate finished runs")
    p.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "tree_agents.json"
    )
    a = p.parse_args(argv)
    tree_steps = a.tree_steps or math.ceil(2.3 * a.steps)
    model = warm_checkpoint(a.out)
    if not a.report_only:
        for seed in a.seeds:  # flat and tree of one seed side by side
            procs = [launch(f"flat-s{seed}", a.out, model, seed, a.steps, a.every, []),
                     launch(f"tree-s{seed}", a.out, model, seed, tree_steps, a.every, TREE)]  # fmt: skip
            for proc, log in procs:
                proc.wait()
                log.close()
                if proc.returncode != 0:
                    raise SystemExit(f"a run failed (exit {proc.returncode}); see {log.name}")
    head = (f"{'seed':>4} | {'group':5} | {'steps':>5} | {'sampled tokens':>14} | "
            f"{'tokens/step':>11} | {'train success':>13} | {'eval sampled (step)':>19}")  # fmt: skip
    print(head)
    print("-" * len(head))
    sums: dict[str, list[dict]] = {"flat": [], "tree": [], "tree=": []}
    for seed in a.seeds:
        flat = at_tokens(a.out / f"flat-s{seed}", None, a.window)
        tree = at_tokens(a.out / f"tree-s{seed}", flat["tokens"], a.window)
        same = at_tokens(a.out / f"tree-s{seed}", None, a.window, max_step=flat["step"])
        for label, m in (("flat", flat), ("tree", tree), ("tree=", same)):
            sums[label].append(m)
            print(f"{seed:>4} | {label:5} | {m['step']:>5} | {m['tokens']:>14.0f} | "
                  f"{m['tokens_per_step']:>11.0f} | {100 * m['success']:>12.1f}% | "
                  f"{100 * m['eval']:>9.1f}% ({m['eval_step']:>3})")  # fmt: skip
    for label, ms in sums.items():
        mean = {k: sum(m[k] for m in ms) / len(ms) for k in ("tokens", "success", "eval")}
        print(f"mean | {label:5} | {'':>5} | {mean['tokens']:>14.0f} | {'':>11} | "
              f"{100 * mean['success']:>12.1f}% | {100 * mean['eval']:>9.1f}%")  # fmt: skip
    print("tree: at flat's sampled tokens; tree=: at flat's step count (fewer tokens)")
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"steps": a.steps, "tree_steps": tree_steps, "seeds": a.seeds,
                                  "window": a.window, "runs": sums}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
