"""Peak memory and wall time of completion log-probs + entropy: chunked (grouprl) vs naive.

Both methods score the same completion tokens of the same TokenBatch under the same randomly
initialised Qwen2 (built from a config in code, float32, CPU), forward AND backward:
loss = sum_{n,t} mask * logp[n, t] * advantage[n], then loss.backward().

  chunked  grouprl.policies.logprobs.completion_logprobs (what CausalLMPolicy.log_probs calls):
           decoder hidden states, then the LM head + log-softmax + gather + entropy one chunk of
           rows at a time under activation checkpointing.
  naive    model(...).logits for the whole batch [N, P+T, V], cast to float32, log_softmax over
           the vocabulary, gather the taken tokens, entropy from the full log-probs (no grad).

Each method runs in its own fresh process (multiprocessing "spawn"), so one method's allocations
never count against the other. Peak memory = ru_maxrss after the first forward+backward minus the
RSS measured just before it (the kernel's high-water mark is reset first through
/proc/self/clear_refs where allowed). That first run is also the warm-up; wall time is the median
of the next 3 runs. Linux only (/proc and ru_maxrss in KiB).

Run: .venv/bin/python benchmarks/logprob_memory.py [--vocab 32000 --hidden 256 --n 8 ...]
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
    from grouprl.policies.logprobs import completion_logprobs

    return completion_logprobs(model, batch, temperature=temperature, chunk_size=chunk_size)


METHODS = {"naive": _naive, "chunked": _chunked}


def _worker(method: str, args: dict[str, Any]) -> dict[str, Any]:
    """Runs in a fresh spawned process: one measured run (also the warm-up), then timed runs."""
    import gc

    import torch

    from grouprl.policies.logprobs import DEFAULT_CHUNK_ELEMENTS

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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--n", type=int, default=8, help="sequences in the batch")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--completion-len", type=int, default=512)
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="rows per chunk (default: grouprl's sizing)"
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after the warm-up")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    a = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("this benchmark reads /proc and ru_maxrss in KiB: Linux only")
    for name in ("vocab", "hidden", "layers", "n", "prompt_len", "completion_len", "repeats"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    args = vars(a)

    N, P, T, V = a.n, a.prompt_len, a.completion_len, a.vocab
    print(
        f"Qwen2 fp32 CPU: vocab {V}, hidden {a.hidden}, layers {a.layers}; batch N={N}, "
        f"prompt {P} + completion {T} tokens; temperature {a.temperature}"
    )
    res = {}
    for method in ("naive", "chunked"):
        t0 = time.perf_counter()
        res[method] = _run_fresh(method, args)
        print(f"  {method}: done in {time.perf_counter() - t0:.1f} s (fresh process)", flush=True)

    nv, ch = res["naive"], res["chunked"]
    rows = a.chunk_size or ch["default_rows"]
    print(
        f"chunk = {rows} rows{'' if a.chunk_size else ' (grouprl default)'}; "
        f"full logits [N, P+T, V] fp32 = {N * (P + T) * V * 4 / MIB:.0f} MiB; "
        f"one chunk [rows, T, V] fp32 = {rows * T * V * 4 / MIB:.0f} MiB"
    )
    med = {m: statistics.median(r["times_s"]) for m, r in res.items()}
    print()
    print(f"{'method':<16}{'peak MiB':>12}{'median s':>12}{'runs s':>26}{'RSS before MiB':>17}")
    for m, r in res.items():
        runs = ", ".join(f"{t:.2f}" for t in r["times_s"])
        print(f"{m:<16}{r['peak_mib']:>12.0f}{med[m]:>12.2f}{runs:>26}{r['rss_before_mib']:>17.0f}")
    print(
        f"{'naive/chunked':<16}{nv['peak_mib'] / ch['peak_mib']:>11.2f}x"
        f"{med['naive'] / med['chunked']:>11.2f}x"
    )
    print()
    grad_scale = float(np.abs(nv["grads"]).max())
    print(
        f"agreement: max |logp diff| {np.abs(nv['logp'] - ch['logp']).max():.2e}, "
        f"max |entropy diff| {np.abs(nv['entropy'] - ch['entropy']).max():.2e}, "
        f"max |grad diff| {np.abs(nv['grads'] - ch['grads']).max():.2e} "
        f"(max |grad| {grad_scale:.2e})"
    )
    print(f"torch {nv['torch']}, {nv['threads']} threads; peak = ru_maxrss - RSS before the run")
    for m, r in res.items():
        if not r["peak_raised"] or not r["peak_reset"]:
            print(
                f"warning: {m}: peak mark reset {'ok' if r['peak_reset'] else 'not allowed'}, "
                f"raised by the run: {r['peak_raised']}; its peak may be over- or under-stated"
            )


if __name__ == "__main__":
    main()
