"""Text conformance (issue 14, item 2): every shipped text and agent config runs 2 steps on the
replica of its model through the real entry point (`grouprl train`), in the config's own dtype,
with only sizes, the model path and (hub-only) data sources overridden. Then:
  - every tensor the run saved is finite (model weights, adapter, trainer state);
  - the checkpoint loads where its ecosystem loads it: transformers (the full weights; under LoRA
    the merged folder) and peft (`PeftModel.from_pretrained` of the adapter on the base replica),
    and gives the log-probs of the policy grouprl trained (the in-memory policy of the run);
  - a new run starts from the checkpoint folder;
  - the vLLM configs (group `vllm`) run and their checkpoints load in vLLM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

import grouprl.train as train_mod
from grouprl.cli import main
from grouprl.types import TokenBatch

ROOT = Path(__file__).resolve().parents[1]
SIZES = [
    "train.steps=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
    "rollout.max_new_tokens=8", "eval.every=0", "eval.max_examples=2", "eval.pass_k=0",
    "eval.batch_size=4", "checkpoint.every=0", "run.console=false",
]  # fmt: skip
GSM8K_LOCAL = [  # the hub dataset replaced by a local file of the same columns
    "task.options.source={data}", "task.options.eval_source={data}", "task.options.config=null",
    "task.options.eval_config=null", "task.options.split=null", "task.options.eval_split=null",
    "train.micro_batch_size=2",
]  # fmt: skip


@dataclass
class Case:
    config: str
    family: str
    overrides: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return Path(self.config).stem


CASES = [
    Case(
        "text/arithmetic_demo.yaml", "qwen2.5", ["task.options.n_train=16", "task.options.n_eval=4"]
    ),
    Case("text/code_synthetic.yaml", "qwen2.5", ["task.options.workers=2"]),
    Case(
        "text/countdown_dapo.yaml", "qwen2.5", ["task.options.n_train=16", "task.options.n_eval=4"]
    ),
    Case("text/gsm8k_qwen_lora.yaml", "qwen2.5", GSM8K_LOCAL),
    Case("text/one_shot_rlvr.yaml", "qwen2.5"),
    Case(
        "agents/frozenlake_gigpo.yaml",
        "qwen2.5",
        [
            "agent.max_turns=2",
            "agent.max_turn_tokens=8",
            "task.options.n_train=8",
            "task.options.n_eval=2",
        ],
    ),  # fmt: skip
]
FROZENLAKE_SMALL = CASES[-1].overrides
# the other families through the same entry point: the agent config on the chat replicas (their
# templates in multi-turn episodes) and the arithmetic config on GPT-2 (a model with dropout)
FAMILY_CASES = [
    Case("agents/frozenlake_gigpo.yaml", "qwen3", FROZENLAKE_SMALL),
    Case("agents/frozenlake_gigpo.yaml", "llama3", FROZENLAKE_SMALL),
    Case("text/arithmetic_demo.yaml", "gpt2", CASES[0].overrides),
]
VLLM_CASES = [
    Case(
        "text/arithmetic_demo_vllm.yaml",
        "qwen2.5",
        ["task.options.n_train=16", "task.options.n_eval=4"],
    ),
    # a GPU config: on this CPU build of vLLM its CUDA-only settings get their CPU values
    Case(
        "text/gsm8k_qwen_lora_vllm.yaml",
        "qwen2.5",
        [*GSM8K_LOCAL, "run.device=cpu", "rollout.vllm.sleep=off"],
    ),  # fmt: skip
]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def test_every_shipped_text_config_has_a_case():
    shipped = {p.relative_to(ROOT / "configs").as_posix() for d in ("text", "agents")
               for p in (ROOT / "configs" / d).glob("*.yaml")}  # fmt: skip
    assert shipped == {c.config for c in CASES + VLLM_CASES}


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    rows = [("What is 2+3?", "2+3=5\n#### 5"), ("What is 4+4?", "#### 8"), ("1+6?", "#### 7")]
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return path


def run_config(case: Case, model: Path, out: Path, data: Path, monkeypatch, *extra: str):
    """`grouprl train CONFIG overrides` in this process; returns (run dir, trained policy)."""
    trained = []
    real = train_mod.build_policy

    def keep(cfg, device):  # the run's own policy object, to compare with what it saved
        trained.append(real(cfg, device))
        return trained[-1]

    monkeypatch.setattr(train_mod, "build_policy", keep)
    overrides = [o.format(data=data) for o in case.overrides]
    rc = main(["train", str(ROOT / "configs" / case.config), f"model.name_or_path={model}",
               f"run.output_dir={out}", *SIZES, *overrides, *extra])  # fmt: skip
    assert rc == 0
    run_dir = next(p.parent for p in out.rglob("config.yaml"))
    return run_dir, trained[-1]


def saved_tensors(run_dir: Path):
    for path in sorted(run_dir.rglob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                yield f"{path.relative_to(run_dir)}:{key}", f.get_tensor(key)
    for path in sorted(run_dir.rglob("*.pt")):
        state = torch.load(path, map_location="cpu", weights_only=False)  # our own run's file
        stack = [(str(path.relative_to(run_dir)), state)]
        while stack:
            name, obj = stack.pop()
            if isinstance(obj, torch.Tensor):
                yield name, obj
            elif isinstance(obj, dict):
                stack += [(f"{name}/{k}", v) for k, v in obj.items()]
            elif isinstance(obj, (list, tuple)):
                stack += [(f"{name}/{i}", v) for i, v in enumerate(obj)]


def probe_batch(tok) -> TokenBatch:
    """Two prompts with completions of different lengths (padding on both sides)."""
    prompts = [
        tok("What is 2+3?", add_special_tokens=False).input_ids,
        tok("Hi", add_special_tokens=False).input_ids,
    ]
    comps = [tok(" It is 5.", add_special_tokens=False).input_ids + [tok.eos_token_id],
             tok(" ok", add_special_tokens=False).input_ids]  # fmt: skip
    p, t = max(map(len, prompts)), max(map(len, comps))
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    pids = torch.tensor([[pad] * (p - len(x)) + x for x in prompts])
    pmask = torch.tensor([[False] * (p - len(x)) + [True] * len(x) for x in prompts])
    cids = torch.tensor([x + [pad] * (t - len(x)) for x in comps])
    cmask = torch.tensor([[True] * len(x) + [False] * (t - len(x)) for x in comps])
    return TokenBatch(pids, pmask, cids, cmask, torch.zeros(2, dtype=torch.bool))


def hf_logprobs(model, batch: TokenBatch) -> torch.Tensor:
    """Completion log-probs [N, T] of a transformers / peft model, computed the plain way."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)  # [N, P + T]
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    p = batch.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : -1], -1)  # [N, T, V]
    return logp.gather(-1, batch.completion_ids[..., None]).squeeze(-1) * batch.completion_mask


@pytest.mark.parametrize(
    "case", CASES + FAMILY_CASES, ids=lambda c: c.id if c in CASES else f"{c.id}-{c.family}"
)
def test_config_runs_on_its_replica_and_the_checkpoint_loads(
    case, replica, gsm8k_file, tmp_path, monkeypatch
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = replica(case.family)
    run_dir, policy = run_config(case, base, tmp_path / "out", gsm8k_file, monkeypatch)
    cfg = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    dtype = DTYPES[cfg["model"]["dtype"]]
    bad = [
        name
        for name, t in saved_tensors(run_dir)
        if t.is_floating_point() and not torch.isfinite(t).all()
    ]
    assert not bad, f"non-finite saved tensors: {bad[:5]}"
    ckpt = max((run_dir / "checkpoints").glob("step-*"))
    assert ckpt.name == "step-00000002"
    tok = AutoTokenizer.from_pretrained(ckpt / "model")
    batch = probe_batch(tok)
    policy.model.eval()
    with torch.no_grad():
        ours = policy.log_probs(batch, with_entropy=False).logp.float() * batch.completion_mask
    tol = 1e-5 if dtype == torch.float32 else 5e-3  # bf16: measured 1.3e-3 (rounding of a pass)
    full = AutoModelForCausalLM.from_pretrained(ckpt / "model", dtype=dtype).eval()
    assert torch.allclose(hf_logprobs(full, batch), ours, atol=tol, rtol=0)
    if cfg["model"].get("lora"):  # the adapter on the base replica, as peft users load it
        base_model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)
        peft_model = PeftModel.from_pretrained(base_model, ckpt / "model" / "adapter").eval()
        assert torch.allclose(hf_logprobs(peft_model, batch), ours, atol=tol, rtol=0)
    # a new run starts from the saved folder
    again, _ = run_config(case, ckpt / "model", tmp_path / "again", gsm8k_file, monkeypatch,
                          "train.steps=1", "run.name=from-checkpoint")  # fmt: skip
    assert (again / "checkpoints" / "step-00000001" / "model" / "config.json").is_file()


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.parametrize("case", VLLM_CASES, ids=lambda c: c.id)
def test_vllm_config_runs_and_its_checkpoint_loads_in_vllm(case, replica, gsm8k_file, tmp_path):
    """Each config in its own `python -m grouprl train` process (vLLM allows one engine per
    process and these configs set it up differently); the checkpoint then loads in vLLM and
    scores a sequence as transformers does."""
    import gc

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM
    from vllm import SamplingParams as VSampling

    out = tmp_path / "out"
    overrides = [o.format(data=gsm8k_file) for o in case.overrides]
    cmd = [sys.executable, "-m", "grouprl", "train", str(ROOT / "configs" / case.config),
           f"model.name_or_path={replica(case.family)}", f"run.output_dir={out}", *SIZES,
           *overrides, "rollout.vllm.gpu_memory_utilization=0.1"]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = next(p.parent for p in out.rglob("config.yaml"))
    bad = [
        name
        for name, t in saved_tensors(run_dir)
        if t.is_floating_point() and not torch.isfinite(t).all()
    ]
    assert not bad, f"non-finite saved tensors: {bad[:5]}"
    ckpt = max((run_dir / "checkpoints").glob("step-*")) / "model"
    tok = AutoTokenizer.from_pretrained(ckpt)
    batch = probe_batch(tok)
    ref = hf_logprobs(AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32), batch)
    llm = LLM(model=str(ckpt), dtype="float32", seed=0, gpu_memory_utilization=0.1,
              max_model_len=256, enforce_eager=True)  # fmt: skip
    try:
        ids = batch.prompt_ids[0][batch.prompt_mask[0]].tolist() + batch.completion_ids[0].tolist()
        res = llm.generate([{"prompt_token_ids": ids}], VSampling(max_tokens=1, prompt_logprobs=0))
        n = int(batch.completion_mask[0].sum())
        lps = res[0].prompt_logprobs[-n:]
        theirs = torch.tensor([lp[t].logprob for lp, t in zip(lps, ids[-n:])])
        assert torch.allclose(theirs, ref[0, :n], atol=1e-3)
    finally:
        del llm
        gc.collect()
