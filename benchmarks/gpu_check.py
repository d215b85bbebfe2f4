"""GPU check (issue 18, item 7): a GRPO step of grouprl beside TRL's GRPOTrainer on one GPU.

Workload: a Qwen2.5-0.5B-architecture replica built in code with random weights
(Qwen2ForCausalLM, hidden 896, 24 layers, 14 attention heads / 2 KV heads, intermediate 4864,
vocabulary 151936, tied embeddings, RoPE theta 1e6, saved in bfloat16; tokenizer: grouprl's
Qwen2.5 tokenizer replica with the Qwen2.5 chat template, grouprl/replicas/text.py, its BPE
vocabulary tiny, so the rows past it are never prompt tokens but can be sampled, as the real
model's padding rows can). 64 prompts x 8 samples per step, exactly 512 new tokens per completion,
temperature 1, no top-k / top-p, GRPO with mu = 1 and beta = 0, AdamW lr 1e-6 constant, gradient
clipping 1.0, micro-batches of 16 completions (gradient accumulation to one optimizer step of
512 completions on both sides), bfloat16 compute with float32 master weights on both sides
(grouprl: model.dtype bfloat16; TRL: the model loaded in float32, bf16=True, i.e. autocast),
no gradient checkpointing, no reference model. Prompts: arithmetic questions as chat messages;
the reward is the share of digit characters in the completion (benchmarks/_common.digit_reward),
the same function on both sides.

Exactly 512 tokens: grouprl has no min_new_tokens option, so its engine's stop ids are emptied for
this check (`policy.engine.eos_ids = []`: it never stops before max_new_tokens); TRL gets
`generation_kwargs={"min_new_tokens": 512}` (transformers masks the EOS logits until then). The
output checks it: mean completion length per side.

Engines: grouprl's default `fast` engine (its own KV-cache decoder on the training model); TRL's
transformers `generate` path (use_vllm=False): the GPU machine has no vLLM.

Each side runs in its own fresh process (its own CUDA context and peak-memory counter), grouprl
first, then TRL; per side `--warmup` untimed steps, then `--steps` timed steps.
  grouprl: `grouprl.train.train` itself; per step the loop's own perf/ metrics (perf/step_s,
           perf/generate_s = sampling + rewards, update = perf/prepare_s + perf/update_s +
           perf/weight_sync_s, perf/generated_tokens_per_s, perf/mfu at the H200's dense bf16
           peak, runtime/throughput.py).
  TRL:     wall time per optimizer step (TrainerCallback), generate = time inside
           `GRPOTrainer._generate_single_turn`, update = the rest.
Peak GPU memory: torch.cuda.max_memory_allocated over the whole run (CPU: the process's peak RSS).

    bash scripts/gpu_check.sh --prepare     # here, with network: wheels into .whl/ (git-ignored)
    bash scripts/gpu_check.sh               # on the GPU machine (carry .whl)
    bash scripts/gpu_check.sh --tiny        # CPU: a tiny Qwen2 (hidden 64, 2 layers), 1 step each

Prints one table (s/step, generate s, update s, generated tokens/s, peak memory, completion
length, MFU) and writes gpu_check.json / gpu_check.md into --out ($OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

SCRIPT = Path(__file__).resolve()

# Qwen2.5-0.5B's config.json (architecture only)
QWEN25_05B = dict(
    hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768,
)  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=0, max_position_embeddings=4096)  # fmt: skip
FULL_SIZES = dict(prompts=64, samples=8, max_new_tokens=512, micro=16, steps=2, warmup=1)
TINY_SIZES = dict(prompts=2, samples=4, max_new_tokens=8, micro=4, steps=1, warmup=0)


def build_model_dir(out: Path, tiny: bool, seed: int = 0) -> Path:
    """The replica folder: the Qwen2.5 tokenizer replica and a random Qwen2ForCausalLM of the
    0.5B's architecture (tiny: hidden 64, 2 layers, the tokenizer's own vocabulary)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grouprl.replicas.chat_templates import TEMPLATES
    from grouprl.replicas.text import QWEN25_ADDED, qwen_tokenizer, save_replica

    if (out / "config.json").exists():
        return out
    tok, _, _ = qwen_tokenizer(QWEN25_ADDED, TEMPLATES["qwen2.5"])
    eot, eos = tok.convert_tokens_to_ids("<|endoftext|>"), tok.convert_tokens_to_ids("<|im_end|>")
    sizes = dict(TINY if tiny else QWEN25_05B)
    if tiny:
        sizes["vocab_size"] = len(tok)
    cfg = Qwen2Config(
        rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True,
        use_sliding_window=False, attention_dropout=0.0, bos_token_id=eot, eos_token_id=eos,
        dtype="bfloat16", **sizes,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    gen = dict(bos_token_id=eot, eos_token_id=[eos, eot], pad_token_id=eot, do_sample=True)
    return save_replica(model, tok, gen, out, torch.bfloat16)


def prompts(n: int, seed: int) -> list[dict]:
    """Arithmetic questions as one-message chats (both sides apply the chat template)."""
    from grouprl.envs.tasks import build_task

    rows = build_task("arithmetic", seed=seed, n_train=max(n * 8, 64), n_eval=0).train
    q = "Compute {} and explain each step before giving the final answer."
    return [{"prompt": [{"role": "user", "content": q.format(r["prompt"].rstrip("="))}]}
            for r in rows]  # fmt: skip


def digits(completions: list[Any], **_: Any) -> list[float]:
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return C.digit_reward(texts)


def _peak_memory_mib(cuda: bool) -> float:
    import torch

    if cuda:
        return torch.cuda.max_memory_allocated() / C.MIB
    return C.peak_rss_bytes() / C.MIB


# ---- grouprl ---------------------------------------------------------------------------------


def run_grouprl(a: argparse.Namespace) -> dict[str, Any]:
    import torch

    from grouprl.config.loading import validate
    from grouprl.envs.tasks import TaskData
    from grouprl.train import Given, train
    from grouprl.workloads import build_policy

    cuda = a.device == "cuda"
    out = Path(tempfile.mkdtemp(prefix="gpu-check-grouprl-"))
    raw = {
        "workload": {"type": "text"},
        "model": {"name_or_path": str(a.model_dir), "dtype": "bfloat16" if cuda else "float32"},
        "task": {"name": "arithmetic"},
        "rollout": {"prompts_per_step": a.prompts, "group_size": a.samples,
                    "max_new_tokens": a.max_new_tokens, "temperature": 1.0},
        "algorithm": {"preset": "grpo", "kl_coef": 0.0, "epochs": 1, "minibatches": 1},
        "train": {"steps": a.warmup + a.steps, "lr": 1e-6, "max_grad_norm": 1.0,
                  "micro_batch_size": a.micro},
        "eval": {"every": 0},
        "checkpoint": {"every": 0, "keep_last": 1},
        "run": {"output_dir": str(out), "name": "run", "device": a.device, "seed": a.seed,
                "console": False, "peak_flops": "auto" if cuda else None},
    }  # fmt: skip
    cfg = validate(raw)
    task = TaskData(train=prompts(a.prompts, a.seed), eval=[], reward_fns={"digits": digits})

    def policy(cfg: Any, device: Any) -> Any:
        p = build_policy(cfg, device)
        p.engine.eos_ids = []  # never stop before max_new_tokens (module docstring)
        return p

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    train(cfg, Given(task=lambda _: task, policy=policy))
    wall = time.perf_counter() - t0
    lines = (out / "run" / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if r["split"] == "train"]
    steps = [
        {
            "total_s": r["perf/step_s"],
            "generate_s": r["perf/generate_s"],
            "update_s": r["perf/prepare_s"] + r["perf/update_s"] + r["perf/weight_sync_s"],
            "generated_tokens": r["rollout/sampled_actions"],
            "completion_len": r["response_length/mean"],
            "mfu": r.get("perf/mfu"),
        }
        for r in rows
    ]
    return {"steps": steps, "peak_mib": _peak_memory_mib(cuda), "wall_s": wall,
            "engine": cfg.rollout.engine}  # fmt: skip


# ---- TRL -------------------------------------------------------------------------------------


def run_trl(a: argparse.Namespace) -> dict[str, Any]:
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cuda = a.device == "cuda"
    torch.manual_seed(a.seed)
    tokenizer = AutoTokenizer.from_pretrained(a.model_dir)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    data = Dataset.from_list(prompts(a.prompts, a.seed))
    batch = a.prompts * a.samples
    if batch % a.micro:
        raise SystemExit(f"--micro {a.micro} must divide prompts x samples = {batch}")
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="gpu-check-trl-"),
        per_device_train_batch_size=a.micro,
        gradient_accumulation_steps=batch // a.micro,  # one optimizer step per generation batch
        num_generations=a.samples,
        max_completion_length=a.max_new_tokens,
        generation_kwargs={"min_new_tokens": a.max_new_tokens},
        temperature=1.0, top_p=1.0, top_k=0,
        num_iterations=1, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        learning_rate=1e-6, lr_scheduler_type="constant", max_grad_norm=1.0,
        max_steps=a.warmup + a.steps, seed=a.seed,
        use_cpu=not cuda, bf16=cuda, fp16=False, gradient_checkpointing=False,
        logging_steps=1, report_to="none", save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=[digits], args=args, train_dataset=data,
                          processing_class=tokenizer)  # fmt: skip
    timer = C.Timer()
    inner = trainer._generate_single_turn
    lengths: list[float] = []

    def timed_generate(*args: Any, **kw: Any) -> Any:
        with timer("generate"):
            if cuda:
                torch.cuda.synchronize()
            out = inner(*args, **kw)
            if cuda:
                torch.cuda.synchronize()
        ids = out[0]
        lengths.append(sum(len(c) for c in ids) / max(len(ids), 1))
        return out

    trainer._generate_single_turn = timed_generate
    steps: list[dict[str, Any]] = []
    t: dict[str, float] = {}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args: Any, **kw: Any) -> None:
            t["t0"] = time.perf_counter()

        def on_step_end(self, *args: Any, **kw: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            total = time.perf_counter() - t["t0"]
            gen = timer.pop().get("generate", 0.0)
            length = sum(lengths) / len(lengths) if lengths else 0.0
            steps.append({"total_s": total, "generate_s": gen, "update_s": total - gen,
                          "generated_tokens": length * batch, "completion_len": length,
                          "mfu": None})  # fmt: skip
            lengths.clear()

    trainer.add_callback(StepTimer())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    return {"steps": steps, "peak_mib": _peak_memory_mib(cuda), "wall_s": time.perf_counter() - t0,
            "trl": trl.__version__}  # fmt: skip


# ---- the comparison ----------------------------------------------------------------------------


def run_side(side: str, args: list[str], timeout: float) -> dict[str, Any]:
    """One side in a fresh process (this interpreter; PYTHONPATH keeps what the caller set, e.g.
    the carried wheels, after the repository); its result JSON, or RuntimeError with its tail."""
    import subprocess

    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        cmd = [sys.executable, str(SCRIPT), "--worker", side, *args, "--result", str(result)]
        path = os.pathsep.join(p for p in (str(C.ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "TOKENIZERS_PARALLELISM": "false"}
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired as exc:
            raise RuntimeError(
                f"{side} stopped after {timeout:.0f} s (--timeout-s / --budget-s)"
            ) from exc
        if proc.returncode != 0:
            tail = (proc.stdout[-2000:] + proc.stderr[-6000:]).strip()
            sys.stderr.write(f"--- {side} failed (rc {proc.returncode}) ---\n{tail}\n")
            last = tail.splitlines()[-1] if tail else "no output"
            raise RuntimeError(f"rc {proc.returncode}: {last}")
        return json.loads(result.read_text())


def summarize(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    timed = result["steps"][warmup:] or result["steps"]
    mean = lambda k: sum(s[k] for s in timed) / len(timed)  # noqa: E731
    mfu = [s["mfu"] for s in timed if s.get("mfu") is not None]
    return {
        "s_per_step": mean("total_s"), "generate_s": mean("generate_s"),
        "update_s": mean("update_s"),
        "generated_tokens_per_s": mean("generated_tokens") / mean("total_s"),
        "completion_len": mean("completion_len"), "peak_mib": result["peak_mib"],
        "mfu": sum(mfu) / len(mfu) if mfu else None, "timed_steps": len(timed),
    }  # fmt: skip


def table(summary: dict[str, dict[str, Any]], cuda: bool) -> str:
    mem = "peak GPU MiB (max_memory_allocated)" if cuda else "peak RSS MiB"
    header = ["framework", "s/step", "generate s", "update s", "generated tok/s", mem,
              "completion len", "MFU"]  # fmt: skip
    rows = []
    for side, s in summary.items():
        if "error" in s:
            rows.append([side, "failed", "-", "-", "-", "-", "-", "-"])
            continue
        mfu = "-" if s["mfu"] is None else f"{100 * s['mfu']:.1f}%"
        rows.append([side, f"{s['s_per_step']:.2f}", f"{s['generate_s']:.2f}",
                     f"{s['update_s']:.2f}", f"{s['generated_tokens_per_s']:.0f}",
                     f"{s['peak_mib']:.0f}", f"{s['completion_len']:.1f}", mfu])  # fmt: skip
    ok = [s for s in summary.values() if "error" not in s]
    if len(ok) == 2:
        g, t = ok
        rows.append(["grouprl/TRL", f"{g['s_per_step'] / t['s_per_step']:.2f}x",
                     f"{g['generate_s'] / t['generate_s']:.2f}x",
                     f"{g['update_s'] / t['update_s']:.2f}x",
                     f"{g['generated_tokens_per_s'] / t['generated_tokens_per_s']:.2f}x",
                     f"{g['peak_mib'] / t['peak_mib']:.2f}x", "", ""])  # fmt: skip
    return C.format_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU-sized: tiny model, 1 step per side")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda (--tiny: cpu)")
    p.add_argument("--frameworks", default="grouprl,trl", help="comma list of: grouprl, trl")
    p.add_argument("--steps", type=int, help="timed steps per side (default 2; --tiny 1)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default 1; --tiny 0)")
    p.add_argument("--prompts", type=int, help="prompts per step (default 64; --tiny 2)")
    p.add_argument("--samples", type=int, help="samples per prompt (default 8; --tiny 4)")
    p.add_argument("--max-new-tokens", type=int, help="(default 512; --tiny 8)")
    p.add_argument("--micro", type=int, help="completions per micro-batch (default 16; --tiny 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=300.0, help="limit per side's process")
    p.add_argument("--budget-s", type=float, default=450.0,
                   help="the whole check's limit: a side gets at most what is left of it")  # fmt: skip
    p.add_argument("--out", type=Path, help="default: $OUT, else benchmarks/results")
    p.add_argument("--worker", choices=["grouprl", "trl"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help="where the replica is built (reused when there)")
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    for k, v in (TINY_SIZES if a.tiny else FULL_SIZES).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.device = a.device or ("cpu" if a.tiny else "cuda")

    if a.worker:  # a fresh process: one side
        C.worker_setup(int(os.environ.get("GPU_CHECK_THREADS", "0")) or os.cpu_count() or 1)
        result = run_grouprl(a) if a.worker == "grouprl" else run_trl(a)
        C.write_json(a.result, result)
        return 0

    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda but torch sees no GPU (use --tiny on a CPU)")
    sides = [s.strip() for s in a.frameworks.split(",") if s.strip()]
    if not sides or set(sides) - {"grouprl", "trl"}:
        raise SystemExit(f"--frameworks: choose from grouprl, trl (got {a.frameworks!r})")
    out = a.out or Path(os.environ.get("OUT") or C.RESULTS)
    start = time.perf_counter()
    default_dir = Path(tempfile.gettempdir()) / f"gpu-check-model-{'tiny' if a.tiny else 'full'}"
    model_dir = build_model_dir(a.model_dir or default_dir, a.tiny, a.seed)
    device = torch.cuda.get_device_name() if a.device == "cuda" else C.cpu_model()
    print(f"gpu_check on {device}, torch {torch.__version__}; replica ready after "
          f"{time.perf_counter() - start:.0f} s; {a.prompts} prompts x {a.samples} samples, "
          f"{a.max_new_tokens} new tokens, {a.warmup} warm-up + {a.steps} timed steps",
          flush=True)  # fmt: skip
    common = ["--model-dir", str(model_dir), "--device", a.device, "--steps", str(a.steps),
              "--warmup", str(a.warmup), "--prompts", str(a.prompts), "--samples",
              str(a.samples), "--max-new-tokens", str(a.max_new_tokens), "--micro", str(a.micro),
              "--seed", str(a.seed)]  # fmt: skip
    results: dict[str, Any] = {"device": device, "torch": torch.__version__,
                               "settings": {k: str(v) for k, v in vars(a).items()}}  # fmt: skip
    summary: dict[str, dict[str, Any]] = {}
    for side in sides:
        t0 = time.perf_counter()
        left = a.budget_s - (t0 - start)
        try:
            if left < 30:
                raise RuntimeError(f"not run: --budget-s {a.budget_s:.0f} spent")
            results[side] = run_side(side, common, min(a.timeout_s, left))
            summary[side] = summarize(results[side], a.warmup)
        except Exception as exc:  # one side failing still reports the other
            summary[side] = {"error": str(exc)}
        print(f"  {side}: {time.perf_counter() - t0:.0f} s", flush=True)
    results["summary"] = summary
    text = table(summary, a.device == "cuda")
    trl_version = results.get("trl", {}).get("trl", "not run")
    engine = results.get("grouprl", {}).get("engine", "-")
    head = f"TRL {trl_version}; grouprl engine {engine!r}; {time.perf_counter() - start:.0f} s"
    errors = "".join(f"\n{side} failed: {s['error']}" for side, s in summary.items()
                     if "error" in s)  # fmt: skip
    print(head)
    print(text + errors)
    C.write_json(out / "gpu_check.json", results)
    (out / "gpu_check.md").write_text(head + "\n\n" + text + "\n" + errors.lstrip("\n"))
    return 0 if all("error" not in s for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
