"""Scaling out generation: 2 trainer processes + a `grouprl vllm-serve` server vs 1 process + the
in-process vLLM engine vs 1 process + the server, on the arithmetic demo's model and config.

  inproc     1 trainer, rollout.engine vllm (an in-process vllm.LLM, colocated)
  server1    1 trainer, rollout.engine vllm_server (a `grouprl vllm-serve` process, gloo channel)
  server2    2 trainers under `accelerate launch` (DDP, gloo) sharing that server

Model and config: the demo's tiny Qwen2 (grouprl/demos/arithmetic.py MODEL: hidden 128, 2 layers,
4 heads / 2 KV heads, random weights: no warm-up, throughput does not depend on it) and
configs/text/arithmetic_demo.yaml (32 prompts x 8 samples per step, <= 6 new tokens), with
rollout.seeding per_sample, `--steps` steps, no held-out evaluation during the run.

Seconds/step: median over steps 2..N of the gaps between consecutive train rows' "time" stamps in
metrics.jsonl (step 1 holds warm-up). Generate seconds: the main trainer process's wall time inside
its engine's `generate` calls within each step (for server2 that includes waiting behind the other
trainer's request: the server serves one request at a time); rest = step - generate (rewards,
scoring, update, weight push, and for server2 the gather of the other process's groups).
Tokens/s = completion tokens generated per step (both trainers for server2; the main process's
count x 2, the shares being equal) / seconds per step. The engine calls are timed by wrapping
`generate` in a small launcher script (benchmarks only; grouprl itself logs perf/ metrics).

One server serves server1 and server2 (started once, its start-up time reported apart; it idles
during inproc). Each run is its own process; the three settings alternate for `--rounds` rounds
(inproc, server1, server2, inproc, ...) and the medians pool every timed step of every round. Not part of the test suite; nothing here asserts on time.

Run: python benchmarks/server_scaling.py [--steps 6] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C  # noqa: E402

ROOT = C.ROOT
RUNS = ("inproc", "server1", "server2")


def build_model(directory: Path) -> Path:
    from grouprl.demos.arithmetic import MODEL
    from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2

    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=0, **MODEL)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def config(out: Path, model: Path, steps: int, engine: str, url: str, threads: int) -> Path:
    import yaml

    raw = yaml.safe_load((ROOT / "configs" / "text" / "arithmetic_demo.yaml").read_text())
    raw["run"].update(name=engine, output_dir=str(out), console=False, num_threads=threads,
                      device="cpu")  # fmt: skip
    raw["model"]["name_or_path"] = str(model)
    raw["rollout"].update(engine=engine, seeding="per_sample")
    if engine == "vllm_server":
        raw["rollout"]["server"] = {"url": url}
    else:
        raw["rollout"]["vllm"] = {"gpu_memory_utilization": 0.1}
    raw["train"]["steps"] = steps
    raw["eval"] = {"every": 0, "max_examples": 8}
    raw["checkpoint"] = {"every": 0}
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{engine}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


WORKER = """
import atexit, json, os, sys, time
from grouprl.policies.text.engines.server.client import VLLMServerEngine
from grouprl.policies.text.engines.vllm import VLLMEngine
calls = []  # (start, end, completion tokens) of every generate call of this process

def timed(real):
    def generate(self, *a, **k):
        t = time.time()
        out = real(self, *a, **k)
        calls.append((t, time.time(), sum(len(c) for c in out.completion_ids)))
        return out
    return generate

VLLMEngine.generate = timed(VLLMEngine.generate)
VLLMServerEngine.generate = timed(VLLMServerEngine.generate)
rank = os.environ.get("RANK", "0")
atexit.register(lambda: open(os.path.join(sys.argv[1], f"calls_{rank}.json"), "w").write(
    json.dumps(calls)))
from grouprl.cli import main
if __name__ == "__main__":
    sys.exit(main(sys.argv[2:]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, env: dict, log: Path) -> tuple[subprocess.Popen, str, float]:
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "grouprl", "vllm-serve", "--model", str(model), "--port", "0",
           "--gpu-memory-utilization", "0.1"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([proc.stdout], [], [], 1.0)[0]:
            line = proc.stdout.readline()
            if "ready at " in line:
                return proc, line.split("ready at ", 1)[1].strip(), time.perf_counter() - t0
    proc.kill()
    raise SystemExit(f"vllm-serve did not start; see {log}")


def run(name: str, out: Path, model: Path, args: dict, env: dict, url: str) -> dict[str, Any]:
    engine = "vllm" if name == "inproc" else "vllm_server"
    cfg = config(out / name, model, args["steps"], engine, url, args["threads"])
    script = out / "worker.py"
    script.write_text(WORKER)
    t0 = time.perf_counter()
    worker = [str(script), str(out / name), "train", str(cfg)]
    if name == "server2":
        cmd = [sys.executable, "-m", "accelerate.commands.launch",
               "--config_file", str(ROOT / "configs" / "accelerate" / "ddp.yaml"),
               "--num_processes", "2", "--main_process_port", str(free_port()), *worker]  # fmt: skip
    else:
        cmd = [sys.executable, *worker]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    rows = [json.loads(x) for x in (out / name / engine / "metrics.jsonl").read_text().splitlines()]
    stamps = [r["time"] for r in rows if r["split"] == "train"]
    steps = [b - a for a, b in zip(stamps, stamps[1:])]  # steps 2..N (step 1 holds warm-up)
    calls = json.loads((out / name / "calls_0.json").read_text())  # the main process's view
    gen, tokens = [], []
    for a, b in zip(stamps, stamps[1:]):
        mine = [c for c in calls if a < c[0] <= b]
        gen.append(sum(c[1] - c[0] for c in mine))
        tokens.append(sum(c[2] for c in mine) * (2 if name == "server2" else 1))
    return {"wall_s": wall, "step_s": steps, "generate_s": gen, "tokens": tokens}


def summarise(name: str, rounds: list[dict]) -> dict[str, Any]:
    """Medians over every timed step of every round."""
    steps = [x for r in rounds for x in r["step_s"]]
    gen = [x for r in rounds for x in r["generate_s"]]
    tokens = [x for r in rounds for x in r["tokens"]]
    step_s, gen_s = statistics.median(steps), statistics.median(gen)
    return {"run": name, "rounds": rounds, "step_s": step_s, "generate_s_per_step": gen_s,
            "rest_s_per_step": step_s - gen_s, "tokens_per_step": statistics.median(tokens),
            "tokens_per_s": statistics.median(tokens) / step_s}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per trainer process")
    ap.add_argument("--rounds", type=int, default=2, help="alternated runs of each setting")
    ap.add_argument("--out", default=str(C.RESULTS), help="folder for the JSON and PNG")
    args = vars(ap.parse_args())
    env = {**os.environ, "OMP_NUM_THREADS": str(args["threads"]), "PYTHONPATH": str(ROOT),
           "VLLM_CPU_KVCACHE_SPACE": "1"}  # fmt: skip
    results: dict[str, Any] = {"settings": args, "machine": C.machine_info(args["threads"])}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model = build_model(out / "model")
        proc, url, start_s = start_server(model, env, out / "server.log")
        results["server_start_s"] = start_s
        rounds: dict[str, list] = {n: [] for n in RUNS}
        try:  # alternated: inproc, server1, server2, inproc, ... (machine drift hits all alike)
            for k in range(args["rounds"]):
                for name in RUNS:
                    where = out / f"round{k}"
                    rounds[name].append(run(name, where, model, args, env, url))
        finally:
            proc.terminate()
            proc.wait(30)
        for name in RUNS:
            results[name] = summarise(name, rounds[name])
    print_table(results)
    path = Path(args["out"])
    print(f"JSON: {C.write_json(path / 'server_scaling.json', results)}")
    png = C.bar_png(
        path / "server_scaling.png",
        [("seconds / step", {n: [results[n]["generate_s_per_step"], results[n]["rest_s_per_step"],
                                 results[n]["step_s"]] for n in RUNS}, ["generate", "rest", "step"]),
         ("completion tokens / s of step", {n: [results[n]["tokens_per_s"]] for n in RUNS},
          ["throughput"])],
        f"arithmetic demo model, {args['steps']} steps, {args['threads']} thread(s) per trainer",
    )  # fmt: skip
    print(f"PNG: {png}")


def print_table(r: dict[str, Any]) -> None:
    print(f"machine: {C.describe_machine(r['machine'])}")
    print(f"server start-up: {r['server_start_s']:.1f} s")
    rows = [[n, f"{r[n]['step_s']:.2f}", f"{r[n]['generate_s_per_step']:.2f}",
             f"{r[n]['rest_s_per_step']:.2f}", f"{r[n]['tokens_per_step']:.0f}",
             f"{r[n]['tokens_per_s']:.0f}", f"{r['inproc']['step_s'] / r[n]['step_s']:.2f}"]
            for n in RUNS]  # fmt: skip
    print(C.format_table(["run", "s/step", "generate s/step", "rest s/step", "tokens/step",
                          "tokens/s", "speed vs inproc"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
