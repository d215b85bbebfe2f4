"""Log-probs through the model's own head path (issue 28: "log-probs skip the model's own output
processing", "silence is a defect").

Families whose forward does more after the decoder than the bare LM head, built from their real
config classes with the real post-processing fields (tiny sizes, float32): Gemma 2 (final-logit
soft-capping 30 and attention soft-capping 50), Cohere (`logit_scale`), Granite
(`logits_scaling`). Their LM heads are scaled so the logits have a real model's spread (|z| up
to ~40; a random tiny model's logits are ~0.1, where soft-capping at 30 is invisible). Checked:
both scoring paths and the engines equal log_softmax(model(...).logits) in values and
gradients; the load-time probe's choice and its fallback; the same on the `gemma2` replica
(hub folder, tied head, float32 and its own bfloat16) and a `grouprl train` of it; the
first-step gap guard stopping a run whose engine samples with other weights, and only warning
with the switch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_runs import arithmetic_run
from transformers import (
    CohereConfig,
    CohereForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

from grouprl.config.loading import validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.engines.fast import FastEngine
from grouprl.policies.text.engines.hf import HFEngine
from grouprl.policies.text.logprobs import completion_logprobs
from grouprl.policies.text.tiny import char_tokenizer
from grouprl.train import Given, train
from grouprl.types import TokenBatch

V = 96
SMALL = dict(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip


def _real_size_logits(model, top: float = 40.0):
    """Scale the LM head (untied) so the model's raw head logits reach |z| ~ top."""
    torch.manual_seed(1)
    with torch.no_grad():
        ids = torch.randint(3, V, (2, 12))
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        head = model.get_output_embeddings()
        factor = top / head(hidden).abs().max()
        model.config.tie_word_embeddings = False
        head.weight = torch.nn.Parameter(head.weight.detach() * factor)
    return model.eval()


def gemma2():
    torch.manual_seed(0)
    cfg = Gemma2Config(**SMALL, final_logit_softcapping=30.0, attn_logit_softcapping=50.0)
    return _real_size_logits(Gemma2ForCausalLM(cfg))


def cohere():
    torch.manual_seed(0)
    return _real_size_logits(CohereForCausalLM(CohereConfig(**SMALL, logit_scale=0.0625)))


def granite():
    torch.manual_seed(0)
    return _real_size_logits(GraniteForCausalLM(GraniteConfig(**SMALL, logits_scaling=8.0)))


def llama():
    torch.manual_seed(0)
    return _real_size_logits(LlamaForCausalLM(LlamaConfig(**SMALL)))


FAMILIES = {"gemma2": gemma2, "cohere": cohere, "granite": granite}


def _batch() -> TokenBatch:
    """4 rows, 2 groups of 2 sharing a prompt; left-padded prompts, right-padded completions."""
    g = torch.Generator().manual_seed(3)
    p = torch.randint(3, V, (2, 6), generator=g).repeat_interleave(2, 0)  # [4, 6]
    p_mask = torch.ones(4, 6, dtype=torch.bool)
    p_mask[2:, :2] = False  # the second group's prompt is 4 tokens
    p = p.masked_fill(~p_mask, 0)
    c = torch.randint(3, V, (4, 5), generator=g)  # [4, 5]
    c_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]])
    c_mask = c_mask.bool()
    return TokenBatch(p, p_mask, c.masked_fill(~c_mask, 0), c_mask, torch.zeros(4, dtype=bool))


def _forward_logp(model, b: TokenBatch, bare_head: bool = False) -> torch.Tensor:
    """log_softmax(model(...).logits) of the completion tokens [N, T], masked slots 0.
    bare_head: the old scoring instead, the plain linear head on the decoder's last hidden states
    (the model's own post-processing skipped)."""
    P = b.prompt_ids.shape[1]
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    mask = torch.cat([b.prompt_mask, b.completion_mask], 1)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    kw = dict(input_ids=ids, attention_mask=mask.long(), position_ids=pos)
    if bare_head:
        logits = model.get_output_embeddings()(model.get_decoder()(**kw).last_hidden_state)
    else:
        logits = model(**kw).logits
    logp = torch.log_softmax(logits[:, P - 1 : -1].float(), -1)
    out = logp.gather(-1, b.completion_ids[..., None])[..., 0]
    return out.masked_fill(~b.completion_mask, 0.0)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("path", ["fast", "plain"])
def test_scoring_equals_the_models_forward_in_values_and_gradients(family, path):
    model, b = FAMILIES[family](), _batch()
    weights = torch.randn(b.completion_ids.shape, generator=torch.Generator().manual_seed(5))
    ref = _forward_logp(model, b)  # [N, T]
    (ref * weights).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    logp, _ = completion_logprobs(model, b, path=path, chunk_size=1)  # chunked: 1 row per chunk
    assert (logp - ref).abs().max() < 1e-5
    (logp * weights).sum().backward()
    for n, p in model.named_parameters():
        if n in ref_grads:  # relative to the gradient's scale (real-size logits: large grads)
            scale = ref_grads[n].abs().max()
            assert (p.grad - ref_grads[n]).abs().max() <= 1e-5 * scale, n


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_bare_lm_head_is_far_from_the_forward(family):
    """Why the head path matters: the old bare head on these models is off by nats."""
    model, b = FAMILIES[family](), _batch()
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=b.prompt_ids).last_hidden_state
        bare = model.get_output_embeddings()(hidden)
        own = model(input_ids=b.prompt_ids).logits
    assert (bare - own).abs().max() > 1.0


def test_head_kind_is_read_from_the_model():
    from grouprl.policies.text.head import output_head

    for make in FAMILIES.values():
        head = output_head(make())
        assert head.kind == "model" and head.linear is None
    plain = llama()
    assert output_head(plain).linear is plain.get_output_embeddings()
    # the same class without soft-capping is a plain linear head again: read, not listed
    torch.manual_seed(0)
    no_cap = Gemma2ForCausalLM(Gemma2Config(**SMALL, final_logit_softcapping=None))
    assert output_head(no_cap).kind == "linear"
    # a scale of 1 changes nothing, so the fused head may run it
    torch.manual_seed(0)
    unit = GraniteForCausalLM(GraniteConfig(**SMALL, logits_scaling=1.0))
    assert output_head(unit).kind == "linear"


def _engine_gap(model, tok, engine) -> float:
    """max |engine log-prob - scoring log-prob| over the tokens `engine` samples from 4 prompts
    (2 groups of 2)."""
    prompts = [[5, 6, 7, 8]] * 2 + [[9, 10, 11]] * 2
    torch.manual_seed(0)
    out = engine(model, tok).generate(prompts, SamplingParams(max_new_tokens=6))
    P = max(len(p) for p in prompts)
    T = max(len(c) for c in out.completion_ids)
    pid = torch.zeros(4, P, dtype=torch.long)
    pm = torch.zeros(4, P, dtype=torch.bool)
    cid = torch.zeros(4, T, dtype=torch.long)
    cm = torch.zeros(4, T, dtype=torch.bool)
    elp = torch.zeros(4, T)
    for i, (p, c, lp) in enumerate(zip(prompts, out.completion_ids, out.logprobs)):
        pid[i, P - len(p) :], pm[i, P - len(p) :] = torch.tensor(p), True
        cid[i, : len(c)], cm[i, : len(c)], elp[i, : len(c)] = (
            torch.tensor(c),
            True,
            torch.tensor(lp),
        )
    b = TokenBatch(pid, pm, cid, cm, torch.zeros(4, dtype=bool))
    with torch.no_grad():
        logp, _ = completion_logprobs(model, b, with_entropy=False)
    return float((logp - elp).abs()[cm].max())


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("engine", [FastEngine, HFEngine])
def test_engine_logprobs_agree_with_scoring(family, engine):
    assert _engine_gap(FAMILIES[family](), char_tokenizer(), engine) < 1e-4


def test_load_time_probe_keeps_the_fast_path_and_names_the_head():
    policy = CausalLMPolicy(gemma2(), char_tokenizer(), logprob_path="fast")
    assert policy.logprob_path == "fast"
    assert "Gemma2ForCausalLM" in policy.head_note and "own head function" in policy.head_note
    plain = CausalLMPolicy(llama(), char_tokenizer())
    assert "plain linear LM head (fused head)" in plain.head_note


class _OuterEmbeddingLM(LlamaForCausalLM):
    """A user's own class (as trust_remote_code brings) whose forward embeds the tokens with a
    module of its own, outside the decoder: grouprl's fast / plain paths (the decoder run on
    token ids, then the head) then differ from the model's forward."""

    def __init__(self, config):
        super().__init__(config)
        self.outer_embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None:
            inputs_embeds = self.outer_embed(input_ids)
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


class _DecoderInForwardLM(LlamaForCausalLM):
    """A forward that reaches into its decoder's modules itself: its head function cannot be
    derived by standing in for the decoder."""

    def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
        if inputs_embeds is None and input_ids is not None:
            inputs_embeds = self.model.embed_tokens(input_ids) * 3.0
        return super().forward(inputs_embeds=inputs_embeds, **kwargs)


@pytest.mark.parametrize(
    ("cls", "said"),
    [
        (_OuterEmbeddingLM, r"_OuterEmbeddingLM: the fast scoring path differs from the model's "
         r"own forward by .* nats \(bound 0.0001 for float32"),
        (_DecoderInForwardLM, r"_DecoderInForwardLM: its head function cannot be derived"),
    ],
)  # fmt: skip
def test_load_time_probe_falls_back_to_the_forward_path_and_says_so(cls, said):
    torch.manual_seed(0)
    model = _real_size_logits(cls(LlamaConfig(**SMALL)))
    with pytest.warns(UserWarning, match=said):
        policy = CausalLMPolicy(model, char_tokenizer(), logprob_path="fast")
    assert policy.logprob_path == "forward" and "full forward" in policy.head_note
    b = _batch()
    out = policy.log_probs(b, with_entropy=False)
    assert (out.logp - _forward_logp(model, b)).abs().max() < 1e-5  # exact, via the forward
    out.logp.sum().backward()  # differentiable (chunked, checkpointed)
    assert model.lm_head.weight.grad is not None


# ---- the first-step engine / trainer gap guard ------------------------------------------------


def _stale_engine_policy(model_dir):
    """The trained policy's FastEngine samples with a copy of the model whose weights differ
    (a push that never happened): a real gap between engine and trainer log-probs."""

    def build(cfg, device):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(model_dir)
        stale = copy.deepcopy(model)
        with torch.no_grad():
            for p in stale.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        return CausalLMPolicy(model, tok, engine=FastEngine(stale, tok))

    return Given(policy=build)


def test_first_step_gap_stops_a_run_with_stale_engine_weights(tmp_path, tiny_model_dir):
    from grouprl.runtime.logp_gap import LogpGapError

    cfg = validate(arithmetic_run(tmp_path, tiny_model_dir, "eval.every=0", "workload.type=text"))
    with pytest.raises(LogpGapError, match=r"differ by .* nats on average .*bound 0.001.*stale"):
        train(cfg, _stale_engine_policy(tiny_model_dir))


def test_first_step_gap_is_checked_again_after_a_resume(tmp_path, tiny_model_dir, capsys):
    """Step 1 runs sound and is checkpointed; the resumed run's engine is stale: its first step
    (step 2) stops."""
    from grouprl.runtime.logp_gap import LogpGapError

    base = (tiny_model_dir, "eval.every=0", "workload.type=text", "checkpoint.every=1")
    train(validate(arithmetic_run(tmp_path, *base)))
    resumed = validate(arithmetic_run(tmp_path, *base, "train.steps=2", "run.resume=true"))
    with pytest.raises(LogpGapError, match=r"differ by .* nats on average"):
        train(resumed, _stale_engine_policy(tiny_model_dir))
    assert "resumed from" in capsys.readouterr().out and "step-00000001" in str(
        sorted((tmp_path / "run").rglob("step-*"))
    )


def test_first_step_gap_only_warns_with_the_switch(tmp_path, tiny_model_dir, capsys):
    cfg = validate(
        arithmetic_run(
            tmp_path,
            tiny_model_dir,
            "eval.every=0",
            "workload.type=text",
            "rollout.logp_gap_check=warn",
        )
    )
    with pytest.warns(UserWarning, match=r"differ by .* nats on average"):
        train(cfg, _stale_engine_policy(tiny_model_dir))
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_first_step_gap_passes_a_sound_run_and_says_so(tmp_path, tiny_model_dir, capsys):
    train(validate(arithmetic_run(tmp_path, tiny_model_dir, "eval.every=0", "workload.type=text")))
    out = capsys.readouterr().out
    assert "first-step log-prob gap: mean |trainer - engine|" in out
    assert "log-prob head path: Qwen2ForCausalLM: the plain linear LM head" in out


# ---- the gemma2 replica: hub layout, tied soft-capped head, bfloat16 on disk ------------------


@pytest.fixture(scope="module")
def gemma2_folder(tmp_path_factory):
    """The `gemma2` replica with its tied embedding / head scaled so the head's raw logits reach
    |z| ~ 60 on random ids (a real model's spread, where soft-capping at 30 matters; at 40 the
    train test's chat prompts stay under the cap: the old bare head's first-step gap was 0.009
    nats there, 15.5 at 60), saved again as the hub folder it was (tokenizer, template,
    generation config untouched)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from grouprl.replicas import build_replica

    root = tmp_path_factory.mktemp("gemma2")
    folder = shutil.copytree(build_replica("gemma2", root / "replica"), root / "scaled")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    head = model.get_output_embeddings()
    assert head.weight is model.get_input_embeddings().weight  # tied: scaled together
    with torch.no_grad():
        ids = torch.randint(3, V, (2, 12), generator=torch.Generator().manual_seed(1))
        raw = head(model.get_decoder()(input_ids=ids).last_hidden_state)  # [2, 12, vocab]
        head.weight.mul_(60.0 / raw.abs().max())
    model.to(torch.bfloat16).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("path", ["fast", "plain"])
def test_gemma2_replica_scoring_equals_its_forward(gemma2_folder, dtype, path):
    from grouprl.policies.text.scoring_probe import PROBE_BOUNDS

    policy = CausalLMPolicy.from_pretrained(str(gemma2_folder), dtype=dtype, logprob_path=path)
    assert policy.logprob_path == path  # the load-time probe kept the path: it reproduces
    assert "Gemma2ForCausalLM" in policy.head_note and "own head function" in policy.head_note
    b = _batch()
    with torch.no_grad():
        ref = _forward_logp(policy.model, b)  # [N, T]
        logp = policy.log_probs(b, with_entropy=False).logp
        bare = _forward_logp(policy.model, b, bare_head=True)
    assert (logp - ref).abs().max() < PROBE_BOUNDS[getattr(torch, dtype)]  # 1e-4 / 0.1
    # the contrast: the old bare-head scoring of the same rows is off by nats
    assert (bare - ref).abs().max() > 1.0


@pytest.mark.parametrize("engine", [FastEngine, HFEngine])
def test_gemma2_replica_engines_agree_with_scoring(gemma2_folder, engine):
    policy = CausalLMPolicy.from_pretrained(str(gemma2_folder))
    assert _engine_gap(policy.model, policy.tokenizer, engine) < 1e-4


def test_grouprl_train_on_the_gemma2_replica(gemma2_folder, tmp_path, capsys):
    """`grouprl train` of the shipped GSM8K config (LoRA, bfloat16, a system prompt) on the
    replica, 2 steps: the first-step gap guard passes (a trainer without soft-capping is ~1 nat
    off here) and the system prompt is folded into the first user turn, announced once."""
    import json
    import warnings

    from test_chat_probe import _fallback_warnings, _gsm8k

    from grouprl.rollouts import chat_probe

    data = tmp_path / "gsm8k.jsonl"
    rows = [("What is 2+3?", "#### 5"), ("What is 4+4?", "#### 8"), ("1+6?", "#### 7")]
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    chat_probe._ANNOUNCED.clear()  # announcements are once per process
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rc = _gsm8k({"gemma2": gemma2_folder}, data, tmp_path / "out", "train.steps=2")
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "first-step log-prob gap: mean |trainer - engine|" in out and "bfloat16" in out
    assert "Gemma2ForCausalLM: " in out and "own head function" in out
    announced = _fallback_warnings(record)
    assert len(announced) == 1 and "has no system role" in announced[0], announced
    (metrics,) = (tmp_path / "out").rglob("metrics.jsonl")
    steps = {json.loads(line).get("step") for line in metrics.read_text().splitlines()}
    assert {1, 2} <= steps


# ---- vision-language models: the head after the inner model -----------------------------------

VLM_SPECIAL = dict(boi_token_id=120, eoi_token_id=121, image_token_id=122, video_token_id=123,
                   boa_token_id=124, eoa_token_index=125, audio_token_id=126)  # fmt: skip
BANNED = [122, 123, 126]  # the placeholders the VLM policy never samples


def gemma4_vlm():
    """Gemma 4 (image-text-to-text) with final-logit soft-capping 30, applied by the
    ForConditionalGeneration forward after its inner model."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
        final_logit_softcapping=30.0, vocab_size_per_layer_input=128,
        hidden_size_per_layer_input=8, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0, eos_token_id=1,
        bos_token_id=2,
    )  # fmt: skip
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16)  # fmt: skip
    cfg = Gemma4Config(text_config=text, vision_config=vision, audio_config=None, **VLM_SPECIAL)
    return _real_size_logits(Gemma4ForConditionalGeneration(cfg))


def _vision_batch() -> TokenBatch:
    """_batch() as text-only VLM rows: each group's rows share one vision dict object."""
    b, first, second = _batch(), {}, {}
    return TokenBatch(
        b.prompt_ids, b.prompt_mask, b.completion_ids, b.completion_mask, b.truncated,
        vision=[first, first, second, second],
    )  # fmt: skip


def _vlm_forward_logp(model, b: TokenBatch) -> torch.Tensor:
    """log_softmax of the model's own forward, the placeholders out of the action space."""
    P = b.prompt_ids.shape[1]
    ids = torch.cat([b.prompt_ids, b.completion_ids], 1)
    mask = torch.cat([b.prompt_mask, b.completion_mask], 1)
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=pos).logits
    logits = logits[:, P - 1 : -1].float()
    logits[..., BANNED] = float("-inf")
    out = torch.log_softmax(logits, -1).gather(-1, b.completion_ids[..., None])[..., 0]
    return out.masked_fill(~b.completion_mask, 0.0)


@pytest.mark.parametrize("path", ["fast", "plain"])
def test_vlm_scoring_equals_the_models_forward(path):
    from grouprl.policies.vision.logprobs import vision_completion_logprobs

    model, b = gemma4_vlm(), _vision_batch()
    weights = torch.randn(b.completion_ids.shape, generator=torch.Generator().manual_seed(5))
    ref = _vlm_forward_logp(model, b)
    (ref * weights).sum().backward()
    ref_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    logp, _ = vision_completion_logprobs(model, b, path=path, banned=BANNED)
    assert (logp - ref).abs().max() < 1e-5
    (logp * weights).sum().backward()
    assert (model.lm_head.weight.grad - ref_grad).abs().max() <= 1e-5 * ref_grad.abs().max()


def test_vlm_engine_logprobs_agree_with_scoring():
    from grouprl.policies.vision.engines.fast import VisionFastEngine
    from grouprl.policies.vision.logprobs import vision_completion_logprobs
    from grouprl.policies.vision.processing import VisionPrompt

    model = gemma4_vlm()
    shared = [VisionPrompt([5, 6, 7, 8], [], {}), VisionPrompt([9, 10, 11], [], {})]
    prompts = [shared[0], shared[0], shared[1], shared[1]]
    torch.manual_seed(0)
    engine = VisionFastEngine(model, char_tokenizer(), banned=BANNED)
    out = engine.generate(prompts, SamplingParams(max_new_tokens=6))
    P, T = 4, max(len(c) for c in out.completion_ids)
    pid, pm = torch.zeros(4, P, dtype=torch.long), torch.zeros(4, P, dtype=torch.bool)
    cid, cm = torch.zeros(4, T, dtype=torch.long), torch.zeros(4, T, dtype=torch.bool)
    elp = torch.zeros(4, T)
    for i, (p, c, lp) in enumerate(zip(prompts, out.completion_ids, out.logprobs)):
        n = len(p.token_ids)
        pid[i, P - n :], pm[i, P - n :] = torch.tensor(p.token_ids), True
        cid[i, : len(c)], cm[i, : len(c)], elp[i, : len(c)] = (
            torch.tensor(c),
            True,
            torch.tensor(lp),
        )
    vision = [prompts[i].vision for i in range(4)]
    b = TokenBatch(pid, pm, cid, cm, torch.zeros(4, dtype=bool), vision=vision)
    with torch.no_grad():
        logp, _ = vision_completion_logprobs(model, b, with_entropy=False, banned=BANNED)
        own = _vlm_forward_logp(model, b)
    assert (logp - elp).abs()[cm].max() < 1e-4
    assert (own - elp).abs()[cm].max() < 1e-4  # the sampler's head is the forward's


@pytest.fixture(scope="module")
def qwen2_vl_folder(tmp_path_factory):
    from grouprl.replicas.vision import build_qwen2_vl

    return build_qwen2_vl(tmp_path_factory.mktemp("qwen2vl"))


def test_vlm_load_time_probe_names_the_head_path(qwen2_vl_folder):
    from grouprl.policies.vision.policy import VisionLMPolicy

    policy = VisionLMPolicy.from_pretrained(str(qwen2_vl_folder))
    assert policy.head_note.startswith(
        "log-prob head path: Qwen2VLForConditionalGeneration: the plain linear LM head"
    )


def test_vlm_load_time_probe_refuses_a_forward_it_cannot_reproduce(qwen2_vl_folder):
    from transformers import Qwen2VLForConditionalGeneration

    from grouprl.policies.vision.policy import VisionLMPolicy
    from grouprl.policies.vision.processing import VisionProcessor

    class _OuterEmbeddingVLM(Qwen2VLForConditionalGeneration):
        """Embeds its tokens with a module of its own, outside the inner model."""

        def __init__(self, config):
            super().__init__(config)
            self.outer_embed = torch.nn.Embedding(
                config.text_config.vocab_size, config.text_config.hidden_size
            )

        def forward(self, input_ids=None, inputs_embeds=None, **kwargs):
            if inputs_embeds is None:
                inputs_embeds = self.outer_embed(input_ids) * 5.0
            return super().forward(inputs_embeds=inputs_embeds, **kwargs)

    torch.manual_seed(0)
    model = _OuterEmbeddingVLM.from_pretrained(qwen2_vl_folder, dtype=torch.float32)
    processor = VisionProcessor.from_pretrained(str(qwen2_vl_folder), False)
    with pytest.raises(ValueError, match=r"_OuterEmbeddingVLM: grouprl's fast scoring path "
                       r"differs from the model's own forward by .* nats \(bound 0.0001"):  # fmt: skip
        VisionLMPolicy(model, processor)
