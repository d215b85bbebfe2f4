#!/usr/bin/env bash
# (Was scripts/gpu_check.sh until issue 18; that name is now the grouprl-vs-TRL throughput check.)
# The shipped configs on their replicas (grouprl/replicas), a few training steps each, on one GPU:
# a table of finiteness, seconds per step and peak memory (torch.cuda.max_memory_allocated).
#
#   bash scripts/gpu_configs.sh                      # CUDA, each config in its own dtype
#   bash scripts/gpu_configs.sh --dtypes bfloat16,float16   # every config in each of these dtypes
#   bash scripts/gpu_configs.sh --device cpu --only shapes_flow_grpo,sd3_diffusion_nft
#   options: --device cuda|cpu  --steps N (4)  --only NAME,...  --budget-s S (420: no run starts
#            after S seconds, so the whole check ends within ~8 minutes)  --run-timeout-s S (150)
#
# Each config runs `grouprl train CONFIG` in its own process with only sizes overridden (model path
# to the replica, a few prompts and samples, tiny resolution, reward models to their replicas;
# the same overrides as tests/test_conformance_*.py). Seconds per step: mean wall time between the
# train steps after the first (the first includes warm-up). Finite: every train step's loss and
# gradient finite, no update skipped, every tensor of the final checkpoint finite. A config whose
# replica is not in this build or that needs an engine that is missing (vLLM) is listed as skipped.
#
# The GPU machine has torch, transformers, accelerate and peft but no diffusers and no network: the
# wheels of what it lacks come along in .whl/ (bash scripts/gpu_wheels.sh, here, with network) and
# are installed below into /tmp/site. The table goes to stdout and, when $OUT is set, to
# $OUT/gpu_configs.md.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if ! "$PY" -c "import diffusers, pydantic, gymnasium, datasets, math_verify" 2>/dev/null; then
  if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "gpu_configs: diffusers (or another dependency) is missing and there is no .whl/ folder (bash scripts/gpu_wheels.sh)" >&2
    exit 1
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1 DIFFUSERS_VERBOSITY=error
WORK=${GPU_CHECK_WORK:-/tmp/gpu_configs}
mkdir -p "$WORK"

# ---- one run: `grouprl train` in this process, then the measurements as one JSON line -----------
cat >"$WORK/one_run.py" <<'PYEOF'
import json, math, os, resource, sys, time
from pathlib import Path

import torch

os.environ["GROUPRL_DEBUG"] = "1"  # errors raise (with their type) instead of rc 2
config, device, out = sys.argv[1:4]
over = sys.argv[4:]
result = {"status": "ok", "error": ""}
if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
t0 = time.time()
try:
    from grouprl.cli import main
    from grouprl.config.loading import load_config

    rc = main(["train", config, *over])
    if rc != 0:
        raise RuntimeError(f"grouprl train returned {rc}")
except BaseException as exc:  # reported in the table, the check goes on
    result.update(status="failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                  if str(exc) else type(exc).__name__)
result["wall_s"] = round(time.time() - t0, 1)
if device == "cuda":
    result["peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
else:  # CPU: the process's peak resident set (KiB on Linux)
    result["peak_mib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
try:
    cfg = load_config(config, over)
    result["dtype"] = cfg.model.dtype
    run_dir = Path(cfg.run.output_dir) / cfg.run.name
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["split"] == "train"]
    result["steps"] = len(train)
    # a step with no loss and no update counter is one that dynamic sampling skipped (no group
    # with a reward spread: random weights); it is counted, not taken for a non-finite step
    updated = [r for r in train if r.get("loss") is not None]
    result["no_signal_steps"] = len(train) - len(updated)
    finite = bool(updated) and all(
        r.get("skipped_nonfinite", 0) == 0 and math.isfinite(r["loss"])
        and r.get("grad_norm") is not None and math.isfinite(r["grad_norm"]) for r in updated)
    from safetensors.torch import load_file
    from grouprl.runtime.checkpoint import CheckpointManager

    ckpt = CheckpointManager(run_dir).latest() if (run_dir / "checkpoints").exists() else None
    if ckpt is None:
        finite = False
    else:
        for f in ckpt.rglob("*.safetensors"):
            finite &= all(bool(torch.isfinite(v).all()) for v in load_file(str(f)).values()
                          if v.is_floating_point())
    result["finite"] = finite
    if len(train) >= 2:
        result["s_per_step"] = round((train[-1]["time"] - train[0]["time"]) / (len(train) - 1), 3)
except Exception as exc:
    result.setdefault("finite", False)
    if result["status"] == "ok":
        result.update(status="failed", error=f"metrics: {type(exc).__name__}: {exc}"[:160])
print("GPU_CHECK_RESULT " + json.dumps(result), flush=True)
PYEOF

# ---- the driver: replicas, cases, the table ------------------------------------------------------
cat >"$WORK/driver.py" <<'PYEOF'
import argparse, importlib.util, json, os, subprocess, sys, time
from pathlib import Path

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
p.add_argument("--steps", type=int, default=4)
p.add_argument("--dtypes", default="own", help="'own' or a comma list, e.g. bfloat16,float16")
p.add_argument("--only", default="", help="comma list of config names (file stems)")
p.add_argument("--budget-s", type=float, default=420.0)
p.add_argument("--run-timeout-s", type=float, default=150.0)
p.add_argument("--work", default="/tmp/gpu_configs")
a = p.parse_args()
start = time.time()
work = Path(a.work)

import torch
from grouprl.replicas import REPLICAS, build_replica

if a.device == "cuda" and not torch.cuda.is_available():
    sys.exit("gpu_configs: --device cuda but torch sees no GPU (use --device cpu)")
HAS_VLLM = importlib.util.find_spec("vllm") is not None
D = "configs/diffusion/"
IMG = ["rollout.prompts_per_step=2", "rollout.group_size=2", "train.micro_batch_size=2",
       "diffusion.rollout_steps=3", "diffusion.eval_steps=3", "eval.max_examples=1",
       "eval.every=0", "checkpoint.every=0"]
TXT = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=16",
       "eval.every=0", "eval.max_examples=2", "eval.pass_k=0", "eval.batch_size=4",
       "checkpoint.every=0"]
GSM8K = ["task.options.source={data}", "task.options.eval_source={data}",
         "task.options.config=null", "task.options.eval_config=null", "task.options.split=null",
         "task.options.eval_split=null", "train.micro_batch_size=2"]
PICK = {"name": "pickscore", "replica": "pickscore"}
CLIP = {"name": "clip_score", "replica": "clip-vit-large-patch14"}
# (config, replica of the model or None for the config's own module, overrides, reward replicas,
#  engine it needs)
CASES = [
    (D + "sd3_flow_grpo.yaml", "sd3.5-medium", IMG + ["diffusion.height=64", "diffusion.width=64",
     "model.max_sequence_length=16"], [PICK], None),
    (D + "sd3_diffusion_nft.yaml", "sd3.5-medium", IMG + ["diffusion.height=64",
     "diffusion.width=64", "model.max_sequence_length=16"], [PICK], None),
    (D + "flux_dance_grpo.yaml", "flux.1-dev", IMG + ["diffusion.height=64", "diffusion.width=64",
     "model.max_sequence_length=16", "diffusion.rollout_steps=4"], [CLIP, PICK], None),
    (D + "wan_flow_grpo.yaml", "wan2.1-t2v", IMG + ["diffusion.height=64", "diffusion.width=64",
     "diffusion.num_frames=9", "model.max_sequence_length=16"], [CLIP], None),
    (D + "sd15_ddpo.yaml", "sd1.5", IMG + ["diffusion.height=64", "diffusion.width=64"], [], None),
    (D + "shapes_flow_grpo.yaml", None, IMG + ["model.weights=null", "diffusion.height=16",
     "diffusion.width=16"], [], None),
    ("configs/text/arithmetic_demo.yaml", "qwen2.5", TXT + ["task.options.n_train=16",
     "task.options.n_eval=4"], [], None),
    ("configs/text/countdown_dapo.yaml", "qwen2.5", TXT + ["task.options.n_train=16",
     "task.options.n_eval=4"], [], None),
    ("configs/text/gsm8k_qwen_lora.yaml", "qwen2.5", TXT + GSM8K, [], None),
    ("configs/text/one_shot_rlvr.yaml", "qwen2.5", TXT, [], None),
    ("configs/text/code_synthetic.yaml", "qwen2.5", TXT + ["task.options.workers=2"], [], None),
    ("configs/agents/frozenlake_gigpo.yaml", "qwen2.5", TXT + ["agent.max_turns=2",
     "agent.max_turn_tokens=8", "task.options.n_train=8", "task.options.n_eval=2"], [], None),
    ("configs/text/arithmetic_demo_vllm.yaml", "qwen2.5", TXT + ["task.options.n_train=16",
     "task.options.n_eval=4"], [], "vllm"),
    ("configs/text/gsm8k_qwen_lora_vllm.yaml", "qwen2.5", TXT + GSM8K, [], "vllm"),
]
only = {s for s in a.only.split(",") if s}
cases = [c for c in CASES if not only or Path(c[0]).stem in only]
unknown = only - {Path(c[0]).stem for c in CASES}
if unknown:
    sys.exit(f"gpu_configs: unknown config names {sorted(unknown)}")

data = work / "gsm8k.jsonl"  # the hub dataset replaced by a local file of the same columns
rows = [("What is 2+3?", "2+3=5\n#### 5"), ("What is 4+4?", "#### 8"), ("1+6?", "#### 7"),
        ("What is 9-2?", "#### 7")]
data.write_text("".join(json.dumps({"question": q, "answer": an}) + "\n" for q, an in rows))

built = {}
def replica(name):
    if name not in built:
        built[name] = build_replica(name, work / "replicas" / name)
    return built[name]

results = []
for config, rep, over, rewards, engine in cases:
    dtypes = ["own"] if a.dtypes == "own" else a.dtypes.split(",")
    for dtype in dtypes:
        row = {"config": Path(config).stem, "replica": rep or "(own module)", "dtype": dtype}
        results.append(row)
        missing = [r for r in [rep, *[w["replica"] for w in rewards]] if r and r not in REPLICAS]
        if missing:
            row.update(status="skipped", error=f"replica {missing[0]!r} not in this build")
            continue
        if engine == "vllm" and not HAS_VLLM:
            row.update(status="skipped", error="vllm is not installed")
            continue
        if time.time() - start > a.budget_s:
            row.update(status="skipped", error=f"time budget {a.budget_s:.0f} s spent")
            continue
        out = work / "runs" / f"{row['config']}-{dtype}"
        args = [f"run.output_dir={out}", f"run.device={a.device}", "run.console=false",
                "run.overwrite=true", f"train.steps={a.steps}"]
        args += [o.format(data=data) for o in over]
        if rep is not None:
            args.append(f"model.name_or_path={replica(rep)}")
        if rewards:
            rs = [{"name": w["name"], "options": {"model": str(replica(w["replica"])),
                   "processor": str(replica(w["replica"]))}} for w in rewards]
            args.append("rewards=" + json.dumps(rs))
        if dtype != "own":
            args.append(f"model.dtype={dtype}")
        if engine == "vllm" and a.device == "cuda":
            args += ["run.device=cuda"]
        if engine == "vllm" and a.device == "cpu":
            args += ["rollout.vllm.sleep=off"]  # sleep mode needs a CUDA build of vLLM
        cmd = [sys.executable, str(work / "one_run.py"), config, a.device, str(out), *args]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.run_timeout_s)
            line = [l for l in proc.stdout.splitlines() if l.startswith("GPU_CHECK_RESULT ")]
            if line:
                row.update(json.loads(line[-1].split(" ", 1)[1]))
            else:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
                row.update(status="failed", error=f"rc {proc.returncode}: {tail[0][:160]}")
        except subprocess.TimeoutExpired:
            row.update(status="failed", error=f"timed out after {a.run_timeout_s:.0f} s")
        print(f"[{time.time() - start:6.1f} s] {row['config']} {row.get('dtype')}: "
              f"{row.get('status')} {row.get('error', '')}", file=sys.stderr, flush=True)

def _signal_note(r):
    n = r.get("no_signal_steps", 0)
    return f"{n} of {r['steps']} steps without an informative group (no update)" if n else ""


name = torch.cuda.get_device_name() if a.device == "cuda" else "CPU"
mem = "peak MiB (cuda max_memory_allocated)" if a.device == "cuda" else "peak MiB (process RSS)"
lines = [f"gpu_configs on {name}, torch {torch.__version__}, {a.steps} steps per config, "
         f"{time.time() - start:.0f} s in all", "",
         f"| config | replica | dtype | status | finite | s / step | {mem} | note |",
         "|---|---|---|---|---|---|---|---|"]
for r in results:
    fin = {True: "yes", False: "NO"}.get(r.get("finite"), "-")
    lines.append(f"| {r['config']} | {r['replica']} | {r.get('dtype', '-')} | {r['status']} | "
                 f"{fin} | {r.get('s_per_step', '-')} | {r.get('peak_mib', '-')} | "
                 f"{r.get('error', '') or _signal_note(r)} |")
table = "\n".join(lines)
print(table)
if os.environ.get("OUT"):
    Path(os.environ["OUT"], "gpu_configs.md").write_text(table + "\n")
PYEOF

exec "$PY" "$WORK/driver.py" --work "$WORK" "$@"
