"""Step throughput and peak memory: grouprl vs TRL's GRPOTrainer on the same GRPO workload.

Workload (issue 6): a Qwen2-architecture model with random weights (hidden 256, 4 layers,
intermediate 1024; "small" = 259-token byte vocabulary, ~4.0M parameters; "large" = 32k
vocabulary, ~12.2M parameters), 8 prompts x 8 samples per step, 32-token completions
(temperature 1, no top-k / top-p), mu = 1, beta = 0 (no reference model), AdamW at the same
learning rate with a constant schedule, gradient clipping at 1.0, float32, no gradient
checkpointing, the same seed and the same initial weights (one save_pretrained folder read by
both). Prompts are the arithmetic task's ("12+34="); the reward is the fraction of digit
characters in the completion (benchmarks/_common.digit_reward), the same function on both sides.

Each side runs in its own fresh process from the benchmark environment .venv-bench (TRL pinned,
made by scripts/bench_env.sh; TRL is never a grouprl dependency), and the runs alternate
grouprl, TRL, grouprl, TRL ... so that drift of the machine's load hits both alike. In each run:
`--warmup` steps, then `--steps` timed steps. Per step: total wall time, the time inside text
generation (grouprl: the engine's generate; TRL: `_generate_single_turn`), and the rest
("update": rewards, advantages, the training forward/backward and the optimizer step).
Memory: the process's peak resident set (VmHWM) over the whole run, and the peak during the
training steps above the resident set just before the first step ("step memory").

    .venv/bin/python benchmarks/text_vs_trl.py            # or: grouprl bench text-vs-trl
    .venv/bin/python benchmarks/text_vs_trl.py --models small --steps 3 --reps 2 --threads 1

Prints a table and ends with `time_per_step_ratio grouprl/TRL: X` (the larger of the models'
ratios) and `peak_memory_ratio grouprl/TRL: Y` (on the 32k-vocabulary model when it ran);
writes text_vs_trl.json and text_vs_trl.png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()
PROMPTS, GROUP, MAX_NEW = 8, 8, 32


def _task_prompts(seed: int) -> list[dict]:
    from grouprl.envs.tasks import build_task

    return build_task("arithmetic", seed=seed, n_train=2000, n_eval=0).train


# ---- grouprl side --------------------------------------------------------------------------------


def run_grouprl(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from grouprl.config.loading import Config
    from grouprl.runtime.build import build_optimizer, build_sampler, seed_everything
    from grouprl.train import rollout_step, update
    from grouprl.workloads import build_policy, build_workload

    new_tokens = getattr(a, "max_new_tokens", MAX_NEW)  # hardware_limit.py passes none
    rollout = dict(prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=new_tokens)
    if a.engine:
        rollout["engine"] = a.engine
    cfg = Config.model_validate(
        dict(
            model=dict(name_or_path=str(a.model_dir)),
            task=dict(name="arithmetic", options=dict(seed=a.seed)),
            rollout=rollout,
            algorithm=dict(preset="grpo", kl_coef=0.0, epochs=1, minibatches=1),
            train=dict(lr=a.lr, steps=a.warmup + a.steps, max_grad_norm=1.0),
            run=dict(device="cpu", seed=a.seed),
        )
    )
    seed_everything(a.seed)
    policy = build_policy(cfg, torch.device("cpu"))
    optimizer, scheduler = build_optimizer(cfg, policy)
    sampler = build_sampler(cfg, _task_prompts(a.seed))
    reward_fns = {"digits": lambda completions, **_: C.digit_reward(completions)}
    weights = {"digits": 1.0}
    workload = build_workload(cfg, policy=policy, reward_fns=reward_fns, weights=weights)

    timer = C.Timer()
    engine = policy.engine
    inner = engine.generate

    def timed_generate(*args: Any, **kw: Any) -> Any:
        with timer("generate"):
            return inner(*args, **kw)

    def one_step(step: int) -> Any:
        r, _ = rollout_step(cfg, workload, policy, sampler, reward_fns, weights, step)
        workload.prepare(policy, r, weights)
        update(cfg, workload, policy, optimizer, scheduler, r)
        return r

    engine.generate = timed_generate
    steps, tokens = [], []
    before = _begin_memory()
    for step in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        r = one_step(step)
        total = time.perf_counter() - t0
        gen = timer.pop().get("generate", 0.0)
        steps.append({"total_s": total, "generate_s": gen, "update_s": total - gen})
        tokens.append(_token_counts(r.actions))
    out = {**_end_memory(before), "steps": steps, "tokens": tokens, "engine": cfg.rollout.engine}
    if getattr(a, "after_steps", None):  # hardware_limit.py: extra steps of its own (matmul floor)
        out["after_steps"] = a.after_steps(lambda: one_step(a.warmup + a.steps), engine)
    return out


def _token_counts(batch: Any) -> dict[str, int]:
    from grouprl.policies.text.fast_logprobs import prompt_runs

    runs = prompt_runs(batch.prompt_ids, batch.prompt_mask)  # [N] group of each row
    first = torch_first(runs)
    return {
        "generated": int(batch.completion_mask.sum()),
        "prompt": int(batch.prompt_mask.sum()),
        "prompt_once_per_group": int(batch.prompt_mask[first].sum()),
        "groups": int(first.sum()),
        "padded_prompt_len": int(batch.prompt_ids.shape[1]),
        "padded_completion_len": int(batch.completion_ids.shape[1]),
        "rows": int(batch.completion_ids.shape[0]),
    }


def torch_first(runs: Any) -> Any:
    """[N] bool: the first row of each run of identical prompts."""
    first = runs.new_ones(len(runs), dtype=bool)
    first[1:] = runs[1:] != runs[:-1]
    return first


def _begin_memory() -> dict[str, float]:
    import gc

    gc.collect()
    setup_peak = C.peak_rss_bytes()
    reset = C.reset_peak()
    return {"setup_peak": setup_peak, "rss_start": C.rss_bytes(), "reset": reset}


def _end_memory(before: dict[str, float]) -> dict[str, Any]:
    train_peak = C.peak_rss_bytes()
    return {
        "peak_rss_mib": max(before["setup_peak"], train_peak) / C.MIB,
        "rss_at_first_step_mib": before["rss_start"] / C.MIB,
        "step_memory_mib": (train_peak - before["rss_start"]) / C.MIB,
        "peak_reset_ok": bool(before["reset"]),
    }


# ---- TRL side ------------------------------------------------------------------------------------


def run_trl(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(a.seed)
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": ex["prompt"]} for ex in _task_prompts(a.seed)])

    def digits(completions: list[str], **_: Any) -> list[float]:
        return C.digit_reward(completions)

    out_dir = tempfile.mkdtemp(prefix="trl-bench-")
    args = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=PROMPTS * GROUP,  # completions per step
        gradient_accumulation_steps=1,
        num_generations=GROUP,
        max_completion_length=a.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        num_iterations=1,
        beta=0.0,
        epsilon=0.2,
        loss_type="grpo",  # per-sequence token mean, then mean over sequences (grouprl's grpo)
        scale_rewards="group",
        learning_rate=a.lr,
        lr_scheduler_type="constant",
        max_grad_norm=1.0,
        max_steps=a.warmup + a.steps,
        seed=a.seed,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=[digits], args=args, train_dataset=data,
        processing_class=tokenizer,
    )  # fmt: skip

    timer = C.Timer()
    inner = trainer._generate_single_turn

    def timed_generate(*args: Any, **kw: Any) -> Any:
        with timer("generate"):
            return inner(*args, **kw)

    trainer._generate_single_turn = timed_generate
    steps: list[dict[str, float]] = []
    state: dict[str, Any] = {}

    class StepTimer(TrainerCallback):
        def on_train_begin(self, *args: Any, **kw: Any) -> None:
            state["before"] = _begin_memory()

        def on_step_begin(self, *args: Any, **kw: Any) -> None:
            state["t0"] = time.perf_counter()

        def on_step_end(self, *args: Any, **kw: Any) -> None:
            total = time.perf_counter() - state["t0"]
            gen = timer.pop().get("generate", 0.0)
            steps.append({"total_s": total, "generate_s": gen, "update_s": total - gen})

    trainer.add_callback(StepTimer())
    trainer.train()
    return {**_end_memory(state["before"]), "steps": steps, "trl": trl.__version__}


# ---- the comparison ------------------------------------------------------------------------------


def summarize(runs: dict[str, list[dict]], warmup: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for side, rs in runs.items():
        timed = [s for r in rs for s in r["steps"][warmup:]]
        out[side] = {
            "s_per_step": C.median([s["total_s"] for s in timed]),
            "generate_s": C.median([s["generate_s"] for s in timed]),
            "update_s": C.median([s["update_s"] for s in timed]),
            "peak_rss_mib": C.median([r["peak_rss_mib"] for r in rs]),
            "step_memory_mib": C.median([r["step_memory_mib"] for r in rs]),
            "timed_steps": len(timed),
        }
    g, t = out["grouprl"], out["trl"]
    out["time_ratio"] = g["s_per_step"] / t["s_per_step"]
    out["memory_ratio"] = g["peak_rss_mib"] / t["peak_rss_mib"]
    out["step_memory_ratio"] = g["step_memory_mib"] / t["step_memory_mib"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small,large", help="comma list of: small, large")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per run")
    p.add_argument("--reps", type=int, default=2, help="runs per side, alternated A B A B")
    p.add_argument("--threads", type=int, default=2, help="torch threads in every run")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max-new-tokens", type=int, default=MAX_NEW,
                   help="completion length (the issue's workload: 32)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="", help="grouprl rollout.engine (default: config default)")
    p.add_argument("--out", type=Path, default=C.RESULTS)
    p.add_argument("--python", default="", help="interpreter with TRL (default: .venv-bench)")
    p.add_argument("--worker", choices=["grouprl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.worker:  # inside a fresh process: one run of one side
        C.worker_setup(a.threads)
        result = run_grouprl(a) if a.worker == "grouprl" else run_trl(a)
        C.write_json(a.result, result)
        return 0

    models = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = set(models) - set(C.MODELS)
    if unknown or not models:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; choose from {list(C.MODELS)}")
    python = a.python or C.bench_python()
    info = C.machine_info(a.threads)
    print(f"machine: {C.describe_machine(info)}")
    results: dict[str, Any] = {"machine": info, "settings": vars(a) | {"out": str(a.out)}}
    for name in models:
        model_dir = C.build_model_dir(a.out / "models" / name, name, seed=a.seed)
        common = ["--model-dir", str(model_dir), "--threads", str(a.threads), "--lr", str(a.lr),
                  "--seed", str(a.seed), "--steps", str(a.steps), "--warmup", str(a.warmup),
                  "--max-new-tokens", str(a.max_new_tokens)]  # fmt: skip
        if a.engine:
            common += ["--engine", a.engine]
        runs: dict[str, list[dict]] = {"grouprl": [], "trl": []}
        for rep in range(a.reps):
            for side in ("grouprl", "trl"):  # A B A B: drift of the machine hits both alike
                t0 = time.perf_counter()
                runs[side].append(C.run_worker(python, SCRIPT, ["--worker", side, *common]))
                print(f"  [{name}] run {rep + 1}/{a.reps} {side}: {time.perf_counter() - t0:.0f} s",
                      flush=True)  # fmt: skip
        results[name] = {"runs": runs, "summary": summarize(runs, a.warmup)}
    results["trl_version"] = results[models[0]]["runs"]["trl"][0].get("trl")
    results["grouprl_engine"] = results[models[0]]["runs"]["grouprl"][0].get("engine")
    report(results, models, a.out, a.max_new_tokens)
    return 0


def report(results: dict[str, Any], models: list[str], out: Path, new_tokens: int) -> None:
    rows = []
    for name in models:
        s = results[name]["summary"]
        for side in ("grouprl", "trl"):
            r = s[side]
            rows.append([name, side, f"{r['s_per_step']:.2f}", f"{r['generate_s']:.2f}",
                         f"{r['update_s']:.2f}", f"{r['peak_rss_mib']:.0f}",
                         f"{r['step_memory_mib']:.0f}"])  # fmt: skip
        rows.append([name, "grouprl/TRL", f"{s['time_ratio']:.2f}x",
                     f"{s['grouprl']['generate_s'] / s['trl']['generate_s']:.2f}x",
                     f"{s['grouprl']['update_s'] / s['trl']['update_s']:.2f}x",
                     f"{s['memory_ratio']:.2f}x", f"{s['step_memory_ratio']:.2f}x"])  # fmt: skip
    header = ["model", "side", "s/step (median)", "generate s", "update s", "peak RSS MiB",
              "step memory MiB"]  # fmt: skip
    print()
    print(f"TRL {results['trl_version']}; grouprl engine {results['grouprl_engine']!r}")
    print(C.format_table(header, rows))
    warn = C.warn_if_loaded(results["machine"])
    if warn:
        print(warn)
    C.write_json(out / "text_vs_trl.json", results)
    panels = [
        ("seconds per step (median)",
         {side: [results[m]["summary"][side]["s_per_step"] for m in models]
          for side in ("grouprl", "trl")}, models),
        ("generate s / update s",
         {f"{side} {part}": [results[m]["summary"][side][f"{part}_s"] for m in models]
          for side in ("grouprl", "trl") for part in ("generate", "update")}, models),
        ("peak RSS MiB",
         {side: [results[m]["summary"][side]["peak_rss_mib"] for m in models]
          for side in ("grouprl", "trl")}, models),
    ]  # fmt: skip
    C.bar_png(out / "text_vs_trl.png", panels, f"grouprl vs TRL {results['trl_version']}: "
              f"{PROMPTS}x{GROUP} samples, {new_tokens}-token completions")  # fmt: skip
    print(f"wrote {out / 'text_vs_trl.json'} and {out / 'text_vs_trl.png'}")
    time_ratio = max(results[m]["summary"]["time_ratio"] for m in models)
    mem_model = "large" if "large" in models else models[0]
    for m in models:
        s = results[m]["summary"]
        print(f"[{m}] time_per_step_ratio {s['time_ratio']:.3f}, peak_memory_ratio "
              f"{s['memory_ratio']:.3f}, step_memory_ratio {s['step_memory_ratio']:.3f}")  # fmt: skip
    print(f"time_per_step_ratio grouprl/TRL: {time_ratio:.3f}")
    print(f"peak_memory_ratio grouprl/TRL: {results[mem_model]['summary']['memory_ratio']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
