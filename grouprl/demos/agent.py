"""The agent demo: a tiny LM agent learns text FrozenLake over many turns, GiGPO next to GRPO.

1. Build a tiny Qwen2 (random weights) and a character-level tokenizer in code: nothing downloaded.
2. Supervised warm-up on valid moves: episodes on random maps (of the RL map's size) walked by a
   noisy expert (the shortest-path move with probability `expert_p`, else a random move) give one
   example per turn (the whole chat so far -> the shortest-path move from there). A short
   warm-up: the agent makes valid moves and reads a map roughly, but sampled at temperature 1 it
   rarely reaches the goal of the RL map, which leaves RL room to learn.
3. Two runs from that checkpoint, side by side (one process each, one CPU thread each):
   configs/agents/frozenlake_gigpo.yaml (GiGPO: episode + anchor-state step advantages, on
   gymnasium's 4x4 map) and the same config with `agent.credit=trajectory` (multi-turn GRPO: the
   episode return on every token).
4. Evaluation success curves of both in one PNG, and greedy episode transcripts as markdown.

    python -m grouprl.demos.agent [--config PATH] [dotted.key=value ...]   (overrides: both runs)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from transformers.utils import logging as hf_logging

from grouprl.config.loading import load_config
from grouprl.demos.sft import supervised_warmup
from grouprl.envs.frozenlake import ACTIONS
from grouprl.envs.gym import make_text_env
from grouprl.envs.tasks import build_task
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.rollouts.chat_delta import first_messages
from grouprl.rollouts.chat_probe import adapt_messages

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "agents" / "frozenlake_gigpo.yaml"
MODEL = dict(hidden_size=128, layers=2, heads=4, kv_heads=2, intermediate=256, max_position=1024)
RUNS = {"GiGPO": [], "GRPO": ["agent.credit=trajectory"]}  # label -> extra overrides


def expert_examples(
    env_id: str, env_kwargs: dict, seeds: list[int], tokenizer, *, expert_p: float, max_turns: int
) -> list[dict]:
    """One {"prompt", "answer"} per turn of noisy-expert episodes (prompt = rendered chat so far).

    The label is always the shortest-path move from the state reached; the move actually played
    is that move with probability expert_p, else a random one, so the data also covers states a
    perfect expert never visits (after a detour), as the agent's own episodes will. (Imitating
    the played moves instead was tried: the tiny model then learned the most frequent move,
    "down", and not to read the map.)
    """
    rng = random.Random(0)
    examples = []
    for seed in seeds:
        env = make_text_env(env_id, **env_kwargs)
        obs, _ = env.reset(seed=seed)
        messages = first_messages(tokenizer, env.unwrapped.system_prompt, obs)
        for _ in range(max_turns):
            path = env.unwrapped.optimal_actions()
            if not path:  # in a hole or on the goal
                break
            prompt = tokenizer.apply_chat_template(
                adapt_messages(tokenizer, messages), add_generation_prompt=True, tokenize=False
            )
            examples.append({"prompt": prompt, "answer": f"<action>{path[0]}</action>"})
            move = path[0] if rng.random() < expert_p else rng.choice(ACTIONS)
            reply = f"<action>{move}</action>"
            obs, _, terminated, truncated, _ = env.step(reply)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": obs}]
            if terminated or truncated:
                break
        env.close()
    return examples


def warmup_env_kwargs(env_kwargs: dict, args) -> dict:
    """The warm-up's environment: the RL run's, but on random maps of the same size (frozen
    tiles with probability `--warmup-frozen-prob`) unless `--warmup-maps same`, so the warm-up
    teaches reading a map and the RL run still has to learn its own map."""
    kwargs = dict(env_kwargs)
    if args.warmup_maps == "random":
        kwargs.update(random_map=True, frozen_prob=args.warmup_frozen_prob)
        kwargs.setdefault("size", 4)
    return kwargs


def warm_up(cfg, out_dir: Path, args, console: Console) -> Path:
    """Build the tiny agent, run the supervised warm-up on expert moves, save it."""
    if (out_dir / "config.json").exists():
        console.print(f"reusing the warm-up checkpoint in {out_dir}")
        return out_dir
    opts = cfg.task.options
    env_kwargs = warmup_env_kwargs(opts.get("env_kwargs", {}), args)
    tokenizer = char_tokenizer()
    seeds = [ex["seed"] for ex in build_task(cfg.task.name, **opts).train[: args.warmup_episodes]]
    examples = expert_examples(
        opts["env_id"], env_kwargs, seeds, tokenizer,
        expert_p=args.expert_p, max_turns=cfg.agent.max_turns,
    )  # fmt: skip
    model = tiny_qwen2(tokenizer, seed=cfg.run.seed, **MODEL)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(
        f"supervised warm-up of a {n_params / 1e6:.2f}M-parameter Qwen2: {args.warmup_steps} "
        f"batches of 32 of {len(examples)} noisy-expert moves ({len(seeds)} episodes)"
    )
    t0 = time.time()
    losses, _ = supervised_warmup(
        model, tokenizer, examples, max_steps=args.warmup_steps, batch_size=32,
        seed=cfg.run.seed,
    )  # fmt: skip
    console.print(f"warm-up done in {time.time() - t0:.0f} s, loss {losses[-1]:.3f}")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


def _n_params(model_dir: Path) -> int:
    """Parameters in a saved checkpoint (read from the safetensors header, no weights loaded)."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


def _rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _evals(run_dir: Path, key: str = "eval/accuracy") -> list[tuple[int, float]]:
    """(step, value) of an evaluation metric logged so far by a run (greedy success by default)."""
    return [(int(r["step"]), float(r[key])) for r in _rows(run_dir) if key in r]


def run_both(config: Path, overrides: list[str], out: Path, console: Console) -> dict[str, Path]:
    """Train the GiGPO and GRPO runs at the same time, one CPU thread each; print evals as they land."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    procs, dirs, shown = {}, {}, {}
    for label, extra in RUNS.items():
        name = f"frozenlake-{label.lower()}"
        args = [*overrides, *extra, f"run.name={name}", f"run.output_dir={out}",
                "run.overwrite=true", "run.console=false", "run.num_threads=1"]  # fmt: skip
        dirs[label] = out / name
        if (dirs[label] / "metrics.jsonl").exists():  # an earlier demo's: not this run's progress
            (dirs[label] / "metrics.jsonl").unlink()
        log = open(out / f"{name}.log", "w")  # noqa: SIM115  (closed with the process)
        procs[label] = (subprocess.Popen(
            [sys.executable, "-m", "grouprl", "train", str(config), *args],
            stdout=log, stderr=subprocess.STDOUT, env=env,
        ), log)  # fmt: skip
        shown[label] = 0
    while True:
        for label, run_dir in dirs.items():
            rows = [r for r in _rows(run_dir) if "eval/accuracy" in r]
            for r in rows[shown[label] :]:
                sampled = r.get("eval/sampled_success")
                extra = "" if sampled is None else f", sampled {100 * sampled:.1f}%"
                console.print(
                    f"  {label:5s} step {r['step']:3d}: eval success greedy "
                    f"{100 * r['eval/accuracy']:.1f}%{extra}"
                )
            shown[label] = len(rows)
        if all(p.poll() is not None for p, _ in procs.values()):
            break
        time.sleep(2)
    for label, (p, log) in procs.items():
        log.close()
        if p.returncode != 0:
            sys.stderr.write((out / f"{dirs[label].name}.log").read_text()[-4000:])
            raise SystemExit(f"the {label} run failed (exit {p.returncode}); log above")
    return dirs


def env_title(env_kwargs: dict) -> str:
    """The maps the RL runs play, in words (for the plot and the console)."""
    if env_kwargs.get("random_map"):
        n = env_kwargs.get("size", 4)
        return f"random {n}x{n} maps"
    return f"gymnasium's {env_kwargs.get('map_name', '4x4')} map"


def plot_success(dirs: dict[str, Path], path: Path, title: str, window: int = 5) -> None:
    """Evaluation success (sampled and greedy) and training-episode success of every run, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (held, trained) = plt.subplots(1, 2, figsize=(11, 4))
    for (label, run_dir), color in zip(dirs.items(), ("C0", "C1")):
        for key, style, name in (
            ("eval/sampled_success", "-", "sampled"),
            ("eval/accuracy", ":", "greedy"),
        ):
            if rows := _evals(run_dir, key):
                steps, values = zip(*rows)
                held.plot(steps, [100 * v for v in values], style, color=color, marker="o",
                          label=f"{label}, {name}")  # fmt: skip
        train = [
            (r["step"], r["episode/success"]) for r in _rows(run_dir) if "episode/success" in r
        ]
        if train:
            steps, values = zip(*train)
            smooth = [sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
                      for i in range(len(values))]  # fmt: skip
            trained.plot(steps, [100 * v for v in smooth], color=color, label=label)
    held.set_title("evaluation episodes (new seeds): success (%)")
    trained.set_title(f"training episodes: success (%), mean of last {window} steps")
    for ax in (held, trained):
        ax.set_xlabel("optimizer step")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_transcripts(dirs: dict[str, Path], path: Path, n: int = 3) -> None:
    """The last evaluation's greedy episodes of each run, as one markdown file."""
    parts = ["# Greedy evaluation episodes after training\n"]
    for label, run_dir in dirs.items():
        rows = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
        last = max(r["step"] for r in rows)
        parts.append(f"## {label} (step {last})\n")
        parts += [r["transcript"] for r in rows if r["step"] == last][:n]
    path.write_text("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grouprl.demos.agent", description=__doc__)
    parser.add_argument("--warmup-episodes", type=int, default=400)
    parser.add_argument("--warmup-steps", type=int, default=80)
    parser.add_argument("--expert-p", type=float, default=0.7)
    parser.add_argument("--warmup-maps", choices=["random", "same"], default="random")
    parser.add_argument("--warmup-frozen-prob", type=float, default=0.8)
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("overrides", nargs="*", help="dotted.key=value config overrides")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # tiny model: a second thread only spins when the other core is busy
    hf_logging.disable_progress_bar()
    console = Console()
    t_start = time.time()
    cfg = load_config(args.config, args.overrides)
    recipe = [cfg.task.model_dump(), cfg.agent.max_turns, MODEL, cfg.run.seed,
              args.warmup_episodes, args.warmup_steps, args.expert_p, args.warmup_maps,
              args.warmup_frozen_prob]  # fmt: skip
    key = hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:8]
    out = Path(cfg.run.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = warm_up(cfg, out / f"frozenlake-warmup-{key}", args, console)
    console.print(f"GiGPO and GRPO runs, {cfg.train.steps} steps each, side by side")
    t0 = time.time()
    dirs = run_both(args.config, [*args.overrides, f"model.name_or_path={model_dir}"], out, console)
    env_kwargs = cfg.task.options.get("env_kwargs", {})
    title = (f"Text FrozenLake, {env_title(env_kwargs)}: a {_n_params(model_dir) / 1e6:.2f}M-"
             "parameter LM agent, GiGPO vs GRPO")  # fmt: skip
    plot_success(dirs, out / "frozenlake_success.png", title)
    write_transcripts(dirs, out / "frozenlake_transcripts.md")
    console.print(f"both runs: {time.time() - t0:.0f} s; demo total {time.time() - t_start:.0f} s")
    for label, run_dir in dirs.items():
        for key, name in (("eval/sampled_success", "sampled"), ("eval/accuracy", "greedy")):
            if rows := _evals(run_dir, key):
                print(f"{label}: eval success ({name}) {100 * rows[0][1]:.1f}% -> "
                      f"{100 * rows[-1][1]:.1f}%")  # fmt: skip
    console.print(f"curves: {out / 'frozenlake_success.png'}")
    console.print(f"transcripts: {out / 'frozenlake_transcripts.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
