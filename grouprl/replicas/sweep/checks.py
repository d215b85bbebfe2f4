"""The sweep's checks of one transformers architecture, each through grouprl's public functions.

`check_architecture(kind, model_type)` builds a tiny random model (tiny.py) and runs, each caught
on its own (a failure is recorded with its reason and the checks that need its result are
skipped, naming it):

  build       the config class's defaults shrunk by tiny.py; AutoModelForCausalLM /
              AutoModelForImageTextToText.from_config, float32, eval mode
  scoring     grouprl's completion log-probs, path "fast" and "plain", equal the model's own
              forward: log_softmax(model(input_ids=[prompt | completion]).logits) of each row
              alone (no padding, the model's default positions), float32, |diff| <= 1e-5 on every
              real completion token. Rows: 2 groups of 2, left-padded prompts, right-padded
              completions, random ids within the vocabulary avoiding every special-token id the
              config names. VLMs: the same text-only rows through the VLM policy's scoring path
              (policies/vision/logprobs.py, no images, nothing banned)
  lora        CausalLMPolicy (VLM: VisionLMPolicy) with the default LoRASettings(); every module
              that got an adapter, and every module that could (Linear, Conv1D, a module with a
              3-D expert parameter) outside the embeddings, the LM head and a VLM's vision tower,
              is classified by the class names of its enclosing modules, nearest first: *attn* /
              *attention* -> attention, *mlp* / *moe* / *expert* / *feedforward* / *ffn* ->
              mlp. Passes when the adapted kinds cover every kind the model has
  train_step  one GRPO step: the policy's log_probs, objectives.total_loss with the default
              AlgorithmConfig (advantages +1 / -1 in each group, on-policy old log-probs), AdamW
              (lr 1e-3): the loss and every gradient finite and the trainable weights changed
  reload      the policy's save_pretrained folder reloads with from_pretrained (float32) and
              scores as the trained model on grouprl's plain path (|diff| <= 1e-4: the merged
              W + BA against the unmerged adapter); the peft adapter (dir/adapter) on a copy of
              the initial base weights scores the same
  vllm        only with vllm=True, where vLLM's ModelRegistry lists the architecture: see
              vllm_check.py; otherwise skip

The tokenizer the policies need (pad / EOS ids, nothing else is read by these checks: the rows
are token ids) is the qwen2.5 replica's (replicas/text.py), built once per process; the VLM
policy's image processor is the qwen2-vl replica's (the checks send no images).
"""

from __future__ import annotations

import copy
import functools
import re
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from grouprl.types import PolicyOutput, TokenBatch

CHECKS = ("build", "scoring", "lora", "train_step", "reload", "vllm")
KINDS = ("causal_lm", "image_text_to_text")
SCORING_TOL = 1e-5
RELOAD_TOL = 1e-4
ATTENTION = re.compile(r"attn|attention", re.I)
MLP = re.compile(r"mlp|moe|expert|feedforward|ffn", re.I)


class CheckFailed(Exception):
    """A check's own finding (not a crash): its message is the reason recorded."""


def reason_of(e: BaseException) -> str:
    """One line for the matrix: the exception type and the first non-empty message line (an
    empty message gets the frame that raised it)."""
    if isinstance(e, CheckFailed):
        return str(e)
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    if lines:
        return f"{type(e).__name__}: {lines[0]}"[:300]
    frame = traceback.extract_tb(e.__traceback__)[-1] if e.__traceback__ else None
    where = f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""
    return f"{type(e).__name__}{where}"


@functools.cache
def _replica_folder(name: str) -> Path:
    from grouprl.replicas import build_replica

    return build_replica(name, Path(tempfile.mkdtemp(prefix=f"sweep-{name}-")))


def tokenizer() -> Any:
    """A fresh copy of the qwen2.5 replica's tokenizer (pad / EOS set)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(_replica_folder("qwen2.5"))


def build(kind: str, model_type: str) -> Any:
    """The tiny random model of `model_type` (float32, eval mode, seed 0)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from grouprl.replicas.sweep.tiny import tiny_config

    torch.manual_seed(0)
    config = tiny_config(model_type, causal=kind == "causal_lm")
    auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForImageTextToText
    return auto.from_config(config, dtype=torch.float32).eval()


def special_ids(config: Any) -> set[int]:
    from grouprl.replicas.sweep.tiny import special_token_ids

    return set(special_token_ids(config.to_dict()))


def sweep_batch(model: Any, vision: bool, seed: int = 0) -> TokenBatch:
    """2 groups of 2 rows: prompts of 6 and 4 real tokens (left padded), completions of 5, 3, 4
    and 2 real tokens (right padded); ids drawn from the vocabulary minus the special ids."""
    vocab = model.config.get_text_config().vocab_size
    allowed = torch.tensor(sorted(set(range(vocab)) - special_ids(model.config)))  # [V']
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> torch.Tensor:
        return allowed[torch.randint(len(allowed), (n,), generator=g)]  # [n]

    prompts = [ids(6), ids(4)]
    P, T = 6, 5
    lengths = [5, 3, 4, 2]
    p_ids = torch.zeros(4, P, dtype=torch.long)  # [N, P]; pad id 0 (masked)
    p_mask = torch.zeros(4, P, dtype=torch.bool)
    c_ids = torch.zeros(4, T, dtype=torch.long)  # [N, T]
    c_mask = torch.zeros(4, T, dtype=torch.bool)
    for row in range(4):
        p = prompts[row // 2]
        p_ids[row, P - len(p) :], p_mask[row, P - len(p) :] = p, True
        c_ids[row, : lengths[row]], c_mask[row, : lengths[row]] = ids(lengths[row]), True
    views = None
    if vision:  # text-only rows: one empty vision dict per group, shared by its rows
        shared = [{}, {}]
        views = [shared[row // 2] for row in range(4)]
    return TokenBatch(p_ids, p_mask, c_ids, c_mask, torch.zeros(4, dtype=torch.bool), views)


@torch.no_grad()
def forward_logprobs(model: Any, batch: TokenBatch) -> torch.Tensor:
    """The model's own log-probs of the completion tokens, row by row without padding: [N, T]."""
    out = torch.zeros(batch.completion_ids.shape)  # [N, T]
    for row in range(len(batch.prompt_ids)):
        p = batch.prompt_ids[row][batch.prompt_mask[row]]  # [p]
        c = batch.completion_ids[row][batch.completion_mask[row]]  # [c]
        ids = torch.cat([p, c])[None]  # [1, p+c]
        logits = model(input_ids=ids, use_cache=False).logits.float()  # [1, p+c, V]
        logp = torch.log_softmax(logits[0, len(p) - 1 : -1], -1)  # [c, V]
        out[row, : len(c)] = logp.gather(-1, c[:, None])[:, 0]  # [c]
    return out


def grouprl_logprobs(model: Any, batch: TokenBatch, path: str) -> torch.Tensor:
    """grouprl's scoring of the batch on one path: [N, T] (masked slots 0)."""
    if batch.vision is not None:
        from grouprl.policies.vision.logprobs import vision_completion_logprobs

        return vision_completion_logprobs(model, batch, path=path, with_entropy=False)[0]
    from grouprl.policies.text.logprobs import completion_logprobs

    return completion_logprobs(model, batch, path=path, with_entropy=False)[0]


def max_gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs()[mask].max())


def check_scoring(model: Any, batch: TokenBatch) -> str:
    expected = forward_logprobs(model, batch)  # [N, T]
    gaps = {}
    with torch.no_grad():
        for path in ("fast", "plain"):
            gaps[path] = max_gap(grouprl_logprobs(model, batch, path), expected,
                                 batch.completion_mask)  # fmt: skip
    bad = {p: g for p, g in gaps.items() if not g <= SCORING_TOL}
    text = ", ".join(f"{p} {g:.1e}" for p, g in gaps.items())
    if bad:
        raise CheckFailed(f"log-probs differ from the model's forward by {text} (tol 1e-5)")
    return f"max |diff| {text}"


def _kind_of(path: list[Any]) -> str | None:
    """attention / mlp from the enclosing modules' class names, nearest first."""
    for module in reversed(path):
        name = type(module).__name__
        if ATTENTION.search(name):
            return "attention"
        if MLP.search(name):
            return "mlp"
    return None


def module_kinds(model: Any, skip: set[int]) -> tuple[dict[str, int], dict[str, int]]:
    """({kind: modules that could get an adapter}, {kind: modules that got one}) of a
    (peft-wrapped) model, outside the modules whose id is in `skip`."""
    from peft.tuners.lora import LoraLayer
    from transformers.pytorch_utils import Conv1D

    could: dict[str, int] = {}
    got: dict[str, int] = {}

    def walk(module: Any, path: list[Any]) -> None:
        if id(module) in skip:
            return
        if isinstance(module, LoraLayer):
            kind = _kind_of(path) or "other"
            got[kind] = got.get(kind, 0) + 1
            could[kind] = could.get(kind, 0) + 1
            return
        direct = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if isinstance(module, (torch.nn.Linear, Conv1D)) or direct:
            kind = _kind_of(path + ([module] if direct else [])) or "other"
            could[kind] = could.get(kind, 0) + 1
        for child in module.children():
            walk(child, path + [module])

    walk(model, [])
    return could, got


def check_lora(policy_model: Any, hf: Any, vision: bool) -> str:
    skip = {id(m) for m in (hf.get_input_embeddings(), hf.get_output_embeddings()) if m is not None}
    if vision:
        inner = hf.model
        skip |= {id(m) for name, m in inner.named_children() if m is not inner.language_model}
    could, got = module_kinds(policy_model, skip)
    need = {k for k in ("attention", "mlp") if could.get(k)}
    missing = sorted(need - set(got))
    text = f"adapted {got or 'none'} of {could}"
    if missing:
        raise CheckFailed(f"no adapter on the {' / '.join(missing)} modules: {text}")
    return text


def make_policy(kind: str, model: Any) -> Any:
    from grouprl.policies.text.lora import LoRASettings

    if kind == "causal_lm":
        from grouprl.policies.text.causal_lm import CausalLMPolicy

        return CausalLMPolicy(model, tokenizer(), lora=LoRASettings(), logprob_path="fast")
    from transformers import AutoImageProcessor

    from grouprl.policies.vision.policy import VisionLMPolicy
    from grouprl.policies.vision.processing import VisionProcessor

    image_processor = AutoImageProcessor.from_pretrained(_replica_folder("qwen2-vl"))
    processor = VisionProcessor(tokenizer(), image_processor, model.config)
    return VisionLMPolicy(model, processor, lora=LoRASettings(), logprob_path="fast")


def policy_logprobs(policy: Any, batch: TokenBatch) -> torch.Tensor:
    return policy.log_probs(batch, with_entropy=False).logp  # [N, T]


def check_train_step(policy: Any, batch: TokenBatch) -> str:
    from grouprl.config.algorithm import AlgorithmConfig
    from grouprl.objectives import count_tokens, total_loss

    params = policy.trainable_parameters()
    if not params:
        raise CheckFailed("the policy has no trainable parameters")
    before = [p.detach().clone() for p in params]
    policy.train()
    out = policy.log_probs(batch, with_entropy=True)
    logp = out.logp  # [N, T]
    mask = batch.completion_mask  # [N, T]
    advantages = torch.tensor([1.0, -1.0, 1.0, -1.0])  # [N]
    algo = AlgorithmConfig()
    loss = total_loss(
        PolicyOutput(logp=logp, entropy=out.entropy), old_logp=logp.detach(),
        advantages=advantages, mask=mask, algo=algo, counts=count_tokens(mask),
    ).loss  # fmt: skip
    if not torch.isfinite(loss):
        raise CheckFailed(f"the loss is {float(loss.detach())}")
    opt = torch.optim.AdamW(params, lr=1e-3)
    loss.backward()
    bad = [i for i, p in enumerate(params) if p.grad is not None and not p.grad.isfinite().all()]
    if bad:
        raise CheckFailed(f"{len(bad)} of {len(params)} trainable tensors got non-finite gradients")
    opt.step()
    policy.eval()
    moved = max(float((p.detach() - b).abs().max()) for p, b in zip(params, before))
    if not moved > 0:
        raise CheckFailed("one AdamW step left every trainable weight unchanged")
    return f"loss {float(loss.detach()):.4f}, max weight change {moved:.1e}"


def check_reload(kind: str, policy: Any, base: Any, batch: TokenBatch) -> str:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from grouprl.policies.text.engines.base import unwrap_peft

    auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForImageTextToText
    with torch.no_grad():  # the trained model (adapter active), scored as the reload will be:
        # the VLM policy's own log_probs leave its image placeholders out of the softmax
        expected = grouprl_logprobs(unwrap_peft(policy.model), batch, "plain")  # [N, T]
    with tempfile.TemporaryDirectory(prefix="sweep-ckpt-") as tmp:
        policy.save_pretrained(tmp)
        reloaded = auto.from_pretrained(tmp, dtype=torch.float32).eval()
        with torch.no_grad():
            gap = max_gap(
                grouprl_logprobs(reloaded, batch, "plain"), expected, batch.completion_mask
            )
        text = f"merged {gap:.1e}"
        if not gap <= RELOAD_TOL:
            raise CheckFailed(f"the reloaded checkpoint scores {gap:.1e} away (tol 1e-4)")
        if (Path(tmp) / "adapter").is_dir():
            peft_model = PeftModel.from_pretrained(base, str(Path(tmp) / "adapter")).eval()
            with torch.no_grad():
                got = grouprl_logprobs(unwrap_peft(peft_model), batch, "plain")
            gap = max_gap(got, expected, batch.completion_mask)
            text += f", peft adapter {gap:.1e}"
            if not gap <= RELOAD_TOL:
                raise CheckFailed(f"the reloaded peft adapter scores {gap:.1e} away (tol 1e-4)")
    return text


def check_architecture(
    kind: str, model_type: str, *, vllm: bool = False, results: dict | None = None
) -> dict[str, dict]:
    """{check: {"status": pass | fail | skip, "reason": str}} for one architecture; `results`:
    the dict filled in check by check (so a caller that stops it early keeps what ran)."""
    results = {} if results is None else results

    def record(name: str, fn: Any) -> Any:
        try:
            value = fn()
        except Exception as e:  # one check's failure is a row of the matrix, never a crash
            results[name] = {"status": "fail", "reason": reason_of(e)}
            return None
        if isinstance(value, tuple):
            reason, value = value
        else:
            reason = value if isinstance(value, str) else ""
        results[name] = {"status": "pass", "reason": reason}
        return value

    def skip_rest(after: str, reason: str) -> dict[str, dict]:
        for name in CHECKS[CHECKS.index(after) + 1 :]:
            results.setdefault(name, {"status": "skip", "reason": reason})
        return results

    from grouprl.policies.text.engines.base import unwrap_peft

    vision = kind == "image_text_to_text"
    model = record("build", lambda: ("", build(kind, model_type)))
    if model is None:
        return skip_rest("build", "the model did not build")
    batch = sweep_batch(model, vision)
    record("scoring", lambda: check_scoring(model, batch))
    base = copy.deepcopy(model)  # the initial weights, for the peft adapter's reload
    policy = record("policy", lambda: ("", make_policy(kind, model)))
    if policy is not None:  # the adapter's coverage is its own check; the policy trains anyway
        results.pop("policy")
        hf = unwrap_peft(policy.model)
        record("lora", lambda: check_lora(policy.model, hf, vision))
        stepped = record("train_step", lambda: check_train_step(policy, batch))
        if stepped is None:
            results["reload"] = {"status": "skip", "reason": "the training step failed"}
        else:
            record("reload", lambda: check_reload(kind, policy, base, batch))
    else:
        results["lora"] = results.pop("policy")
        for name in ("train_step", "reload"):
            results[name] = {"status": "skip", "reason": "the policy did not build (lora)"}
    if not vllm:
        results["vllm"] = {"status": "skip", "reason": "not run (--vllm not given)"}
    else:
        from grouprl.replicas.sweep.vllm_check import NotApplicable, check_vllm

        try:
            results["vllm"] = {"status": "pass", "reason": check_vllm(kind, model_type)}
        except NotApplicable as e:
            results["vllm"] = {"status": "skip", "reason": str(e)}
        except Exception as e:
            results["vllm"] = {"status": "fail", "reason": reason_of(e)}
    return results
