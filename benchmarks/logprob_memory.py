"""Peak memory and wall time of completion log-probs + entropy: grouprl's paths vs naive.

Every method scores the same completion tokens of the same TokenBatch under the same randomly
initialised Qwen2 (built from a config in code, float32, CPU), forward AND backward:
loss = sum_{n,t} mask * logp[n, t] * advantage[n], then loss.backward(). One table per vocabulary
size (default 32k and 152k, Qwen's).

  fast     grouprl.policies.text.logprobs.completion_logprobs(path="fast"), CausalLMPolicy's default:
           each distinct prompt once, then the fused LM head (policies/fused_head.py) over the
           real completion tokens only, one token chunk of logits at a time, forward and back.
  chunked  completion_logprobs(path="plain"): decoder hidden states for [prompt | completion],
           then the LM head + log-softmax + gather + entropy one chunk of rows at a time under
           activation checkpointing.
  naive    model(...).logits for the whole batch [N, P+T, V], cast to float32, log_softmax over
           the vocabulary, gather the taken tokens, entropy from the full log-probs (no grad).

Each method runs in its own fresh process (multiprocessing "spawn"), so one method's allocations
never count against the other. Peak memory = ru_maxrss after the first forward+backward minus the
RSS measured just before it (the kernel's high-water mark is reset first through
/proc/self/clear_refs where allowed). That first run is also the warm-up; wall time is the median
of the next 3 runs. Linux only (/proc and ru_maxrss in KiB).

Run: .venv/bin/python benchmarks/logprob_memory.py [--vocab 32000,152000 --hidden 256 --n 4 ...]
(or `grouprl bench logprob-memory`). Writes logprob_memory.json and logprob_memory.png into --out.
Not part of the test suite; nothing here asserts on time.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

MIB = 2**20


def _rss_bytes() -> int:
    """Resident set size of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_peak() -> bool:
    """Set the high-water RSS mark to the current RSS (Linux >= 4.0); False if not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _build(args: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The same model, batch and advantages in every process (fixed seeds)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grouprl.types import TokenBatch

    torch.manual_seed(0)
    H = args["hidden"]
    config = Qwen2Config(
        vocab_size=args["vocab"],
        hidden_size=H,
        intermediate_size=4 * H,
        num_hidden_layers=args["layers"],
        num_attention_heads=max(1, H // 64),
        num_key_value_heads=max(1, H // 128),
        max_position_embeddings=args["prompt_len"] + args["completion_len"] + 8,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config).float().train()

    N, P, T, V = args["n"], args["prompt_len"], args["completion_len"], args["vocab"]
    g = torch.Generator().manual_seed(1)
    # Realistic padding: prompts left padded to P, completions right padded to T (one row full).
    p_len = torch.randint(P // 2, P + 1, (N,), generator=g)  # [N]
    c_len = torch.randint(T // 4, T + 1, (N,), generator=g)  # [N]
    c_len[0] = T
    prompt_mask = torch.arange(P) >= (P - p_len)[:, None]  # [N, P]
    completion_mask = torch.arange(T) < c_len[:, None]  # [N, T]
    prompt_ids = torch.randint(0, V, (N, P), generator=g).masked_fill(~prompt_mask, 0)  # [N, P]
    completion_ids = torch.randint(0, V, (N, T), generator=g).masked_fill(~completion_mask, 0)
    batch = TokenBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, c_len == T)
    advantages = torch.randn(N, generator=g)  # [N]
    return model, batch, advantages


def _naive(model: Any, batch: Any, temperature: float, chunk_size: int | None) -> tuple:
    """Full-vocabulary float32 logits for the whole batch, then log_softmax / gather / entropy.

    chunk_size is ignored (one "chunk" = the whole batch)."""
    import torch

    P = batch.prompt_ids.shape[1]
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)  # [N, P+T]
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)  # [N, P+T]
    position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)  # [N, P+T], as grouprl does
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=position_ids).logits
    logits = logits[:, P - 1 : -1].float() / temperature  # [N, T, V]: predict completion tokens
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, T, V]
    logp = logp_all.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)  # [N, T]
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [N, T]
    cmask = batch.completion_mask  # [N, T]
    return logp.masked_fill(~cmask, 0.0), entropy.masked_fill(~cmask, 0.0)


def _chunked(model: Any, batch: Any, temperature: float, chunk_size: int | None) -> tuple:
    from grouprl.policies.text.logprobs import completion_logprobs

    return completion_logprobs(
        model, batch, temperature=temperature, chunk_size=chunk_size, path="plain"
    )


def _fast(model: Any, batch: Any, temperature: float, chunk_size: int | None) -> tuple:
    from grouprl.policies.text.logprobs import completion_logprobs

    return completion_logprobs(
        model, batch, temperature=temperature, chunk_size=chunk_size, path="fast"
    )


METHODS = {"naive": _naive, "chunked": _chunked, "fast": _fast}


def _worker(method: str, args: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh spawned process: one measured run (also the warm-up), then timed runs."""
    import gc

    import torch

    from grouprl.policies.text.logprobs import DEFAULT_CHUNK_ELEMENTS

    torch.set_num_threads(args["threads"] or torch.get_num_threads())
    model, batch, advantages = _build(args)

    def step() -> tuple[Any, Any]:
        model.zero_grad(set_to_none=True)
        logp, entropy = METHODS[method](model, batch, args["temperature"], args["chunk_size"])
        loss = (logp * advantages[:, None] * batch.completion_mask).sum()  # scalar
        loss.backward()
        return logp.detach(), entropy.detach()

    gc.collect()
    reset = _reset_peak()
    rss_before, peak_before = _rss_bytes(), _peak_bytes()
    t0 = time.perf_counter()
    logp, entropy = step()
    first_s = time.perf_counter() - t0
    peak_after = _peak_bytes()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # [n_params]
    result = {
        "peak_mib": (peak_after - rss_before) / MIB,
        "rss_before_mib": rss_before / MIB,
        "peak_raised": peak_after > peak_before,
        "peak_reset": reset,
        "first_s": first_s,
        "logp": logp.numpy(),
        "entropy": entropy.numpy(),
        "grads": grads.numpy(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # Rows per chunk as completion_logprobs sizes them when --chunk-size is not given.
        "default_rows": max(
            1, min(args["n"], DEFAULT_CHUNK_ELEMENTS // (args["completion_len"] * args["vocab"]))
        ),
    }
    del logp, entropy, grads
    times = []
    for _ in range(args["repeats"]):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    result["times_s"] = times
    return result


def _run_fresh(method: str, args: dict[str, Any]) -> dict[str, Any]:
    with ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn")) as pool:
        return pool.submit(_worker, method, args).result()


def _one_vocab(args: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Every method in its own fresh process for one vocabulary size; prints its table."""
    args = {**args, "vocab": vocab}
    N, P, T = args["n"], args["prompt_len"], args["completion_len"]
    print(
        f"Qwen2 fp32 CPU: vocab {vocab}, hidden {args['hidden']}, layers {args['layers']}; batch "
        f"N={N}, prompt {P} + completion {T} tokens; temperature {args['temperature']}"
    )
    res = {}
    for method in METHODS:
        t0 = time.perf_counter()
        res[method] = _run_fresh(method, args)
        print(f"  {method}: done in {time.perf_counter() - t0:.1f} s (fresh process)", flush=True)
    nv, ch = res["naive"], res["chunked"]
    rows = args["chunk_size"] or ch["default_rows"]
    print(
        f"chunked: {rows} rows per chunk{'' if args['chunk_size'] else ' (default)'}; full logits "
        f"[N, P+T, V] fp32 = {N * (P + T) * vocab * 4 / MIB:.0f} MiB; one chunk [rows, T, V] fp32 "
        f"= {rows * T * vocab * 4 / MIB:.0f} MiB"
    )
    med = {m: statistics.median(r["times_s"]) for m, r in res.items()}
    print()
    print(f"{'method':<16}{'peak MiB':>12}{'median s':>12}{'runs s':>26}{'RSS before MiB':>17}")
    for m, r in res.items():
        runs = ", ".join(f"{t:.2f}" for t in r["times_s"])
        print(f"{m:<16}{r['peak_mib']:>12.0f}{med[m]:>12.2f}{runs:>26}{r['rss_before_mib']:>17.0f}")
    for m in ("chunked", "fast"):
        print(
            f"{'naive/' + m:<16}{nv['peak_mib'] / res[m]['peak_mib']:>11.2f}x"
            f"{med['naive'] / med[m]:>11.2f}x"
        )
    grad_scale = float(np.abs(nv["grads"]).max())
    for m in ("chunked", "fast"):
        r = res[m]
        print(
            f"agreement {m} vs naive: max |logp diff| {np.abs(nv['logp'] - r['logp']).max():.2e}, "
            f"max |entropy diff| {np.abs(nv['entropy'] - r['entropy']).max():.2e}, "
            f"max |grad diff| {np.abs(nv['grads'] - r['grads']).max():.2e} "
            f"(max |grad| {grad_scale:.2e})"
        )
    print(f"torch {nv['torch']}, {nv['threads']} threads; peak = ru_maxrss - RSS before the run")
    for m, r in res.items():
        if not r["peak_raised"] or not r["peak_reset"]:
            print(
                f"warning: {m}: peak mark reset {'ok' if r['peak_reset'] else 'not allowed'}, "
                f"raised by the run: {r['peak_raised']}; its peak may be over- or under-stated"
            )
    print()
    return {
        m: {
            "peak_mib": r["peak_mib"],
            "median_s": med[m],
            "times_s": r["times_s"],
            "max_abs_logp_diff_vs_naive": float(np.abs(nv["logp"] - r["logp"]).max()),
            "max_abs_grad_diff_vs_naive": float(np.abs(nv["grads"] - r["grads"]).max()),
        }
        for m, r in res.items()
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", default="32000,152000", help="comma list of vocabulary sizes")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--n", type=int, default=4, help="sequences in the batch")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="rows per chunk (default: grouprl's sizing)"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    a = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("this benchmark reads /proc and ru_maxrss in KiB: Linux only")
    vocabs = [int(v) for v in a.vocab.split(",") if v.strip()]
    for name in ("hidden", "layers", "n", "prompt_len", "completion_len", "repeats"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if not vocabs or min(vocabs) < 2:
        raise SystemExit(f"--vocab must list sizes >= 2, got {a.vocab!r}")
    args = {k: v for k, v in vars(a).items() if k not in ("vocab", "out")}
    results = {str(v): _one_vocab(args, v) for v in vocabs}
    _write(a.out, results, args)


def _write(out: Path, results: dict[str, Any], args: dict[str, Any]) -> None:
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "logprob_memory.json").write_text(
        json.dumps({"settings": args, "results": results}, indent=2) + "\n"
    )
    vocabs = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(8.4, 3.6))
    for ax, key, label in ((axes[0], "peak_mib", "peak MiB"), (axes[1], "median_s", "median s")):
        for j, m in enumerate(METHODS):
            xs = [i + (j - 1) * 0.27 for i in range(len(vocabs))]
            ax.bar(xs, [results[v][m][key] for v in vocabs], 0.27, label=m)
        ax.set_xticks(range(len(vocabs)), [f"vocab {v}" for v in vocabs])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"completion log-probs fwd+bwd, N={args['n']}, prompt {args['prompt_len']} + completion "
        f"{args['completion_len']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out / "logprob_memory.png", dpi=110)
    plt.close(fig)
    print(f"wrote {out / 'logprob_memory.json'} and {out / 'logprob_memory.png'}")


if __name__ == "__main__":
    main()
