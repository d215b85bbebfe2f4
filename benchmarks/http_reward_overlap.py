"""Wall-clock gain of overlapping a remote (`http`) reward with generation in single-turn collect.

Workload: the Qwen2.5-Instruct replica of grouprl.replicas (random weights, tiny), CausalLMPolicy
with per-sample seeding, `--prompts` prompts x `--group` samples of `--tokens` new tokens; the
scorer is a stdlib HTTP server on 127.0.0.1 that sleeps `--sleep-per-sample` seconds per scored
completion (a stand-in for a remote reward model) and returns the completion lengths.
Serial: `http` with overlap_chunks 1 (generate all, then score). Overlapped: overlap_chunks
`--chunks` (chunk k is scored in a background thread while chunk k + 1 generates). The two
alternate over `--reps` repetitions in one process; reported: the median time of each and the
ratio serial / overlapped, after checking both gave the same completions and rewards.

    .venv/bin/python benchmarks/http_reward_overlap.py
    .venv/bin/python benchmarks/http_reward_overlap.py --chunks 4 --sleep-per-sample 0.02
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from grouprl.envs.rewards import build_reward
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.replicas.text import build
from grouprl.rollouts.single_turn import collect


def start_scorer(sleep_per_sample: float) -> tuple[str, ThreadingHTTPServer]:
    class Scorer(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            time.sleep(sleep_per_sample * len(body["completions"]))
            raw = json.dumps({"rewards": [float(len(c)) for c in body["completions"]]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--sleep-per-sample", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=0, help="0: the replica's own width (64)")
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build("qwen2.5", tmp)
        if args.hidden:  # a wider decoder on the replica's tokenizer: decoding that costs compute
            from transformers import AutoConfig, AutoModelForCausalLM

            cfg = AutoConfig.from_pretrained(folder)
            cfg.hidden_size, cfg.intermediate_size = args.hidden, 4 * args.hidden
            cfg.num_attention_heads, cfg.num_key_value_heads = args.hidden // 64, 2
            cfg.num_hidden_layers, cfg.max_window_layers = args.layers, args.layers
            cfg.layer_types = ["full_attention"] * args.layers
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
        policy = CausalLMPolicy.from_pretrained(str(folder))
    url, server = start_scorer(args.sleep_per_sample)
    examples = [{"prompt": f"What is {a} + {a}?"} for a in range(args.prompts)]
    params = SamplingParams(max_new_tokens=args.tokens)
    modes = {"serial": 1, "overlapped": args.chunks}
    times: dict[str, list[float]] = {m: [] for m in modes}
    results = {}
    collect(policy, examples[:1], 2, params, {}, seed=0)  # warm-up
    for _ in range(args.reps):
        for mode, chunks in modes.items():
            fns = {"http": build_reward("http", url=url, overlap_chunks=chunks)}
            t0 = time.perf_counter()
            rollout, _ = collect(policy, examples, args.group, params, fns, seed=0)
            times[mode].append(time.perf_counter() - t0)
            results[mode] = (rollout.info["completion"], rollout.rewards["http"].tolist())
    server.shutdown()
    assert results["serial"] == results["overlapped"], "overlap changed the samples or rewards"
    n = args.prompts * args.group
    print(f"{n} samples, {args.tokens} tokens, scorer {args.sleep_per_sample}s/sample "
          f"({n * args.sleep_per_sample:.2f}s per rollout), chunks {args.chunks}")  # fmt: skip
    med = {m: statistics.median(t) for m, t in times.items()}
    for m, t in times.items():
        print(f"{m:>10}: median {med[m]:.3f}s  runs {[round(x, 3) for x in t]}")
    print(f"ratio serial/overlapped: {med['serial'] / med['overlapped']:.2f}")


if __name__ == "__main__":
    main()
