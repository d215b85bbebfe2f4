"""grouprl's scoring on families whose body, cache or router differ from a Llama's.

Each model is a tiny random one built from the family's real transformers config class
(grouprl.replicas.sweep.tiny: the config's own defaults, shrunk), as the architecture sweep
builds it:

- Qwen3.5 (gated delta net layers), Bamba / Mamba-2 / MiniMax (Mamba / lightning-attention
  layers): the fast path's shared prompt cache cannot carry them (a recurrent state overwritten
  in place by transformers' cache on the next pass, or a family's own cache class); the fast
  path runs them in one pass, with the same values and gradients as the plain path.
- Llama 4 / Mllama text: `get_decoder()` returns the causal LM itself; the body is its child
  holding the input embeddings.
- Gemma 3 (image-text-to-text class registered as a causal LM) and Fuyu: the head is derived
  with the inner model stood in (its language model alone does not run the forward).
- Llama 4's router subclasses nn.Linear but returns a tuple: LoRA's all-linear leaves it out.
"""

from __future__ import annotations

import pytest
import torch

from grouprl.policies.lora_targets import linear_layers
from grouprl.policies.text.head import decoder_of, output_head
from grouprl.policies.text.logprobs import completion_logprobs
from grouprl.replicas.sweep.checks import build, forward_logprobs, sweep_batch


def _model(model_type: str):
    return build("causal_lm", model_type)


def _gap(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b).abs()[mask].max())


def test_recurrent_state_layers_train_through_the_fast_path():
    """Qwen3.5's gated delta net: gradients of the fast path equal the plain path's (the shared
    prompt cache made backward fail: the state it read was overwritten in place)."""
    model = _model("qwen3_5_text").train()
    batch = sweep_batch(model, vision=False)  # 2 groups of 2 rows sharing a prompt
    grads = {}
    for path in ("fast", "plain"):
        model.zero_grad()
        logp, _ = completion_logprobs(model, batch, path=path, with_entropy=False)  # [N, T]
        (logp * batch.completion_mask).sum().backward()
        grads[path] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    assert len(grads["fast"]) == len(grads["plain"]) > 0
    for a, b in zip(grads["fast"], grads["plain"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["bamba", "minimax", "mamba2"])
def test_families_with_caches_that_cannot_be_shared_score_on_the_fast_path(family):
    """Bamba's Mamba-layer cache, MiniMax's and Mamba-2's own cache classes: the fast path
    equals the model's forward (it raised on the shared prompt cache, or was 2.4 nats off on
    Mamba-2)."""
    model = _model(family)
    batch = sweep_batch(model, vision=False)
    expected = forward_logprobs(model, batch)  # [N, T]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, path="fast", with_entropy=False)  # [N, T]
    assert _gap(logp, expected, batch.completion_mask) < 1e-5


@pytest.mark.parametrize("family", ["llama4_text", "mllama"])
def test_the_body_of_a_causal_lm_whose_get_decoder_is_itself(family):
    model = _model(family)
    assert model.get_decoder() is model  # what transformers gives for these classes
    assert decoder_of(model) is model.model
    batch = sweep_batch(model, vision=False)
    expected = forward_logprobs(model, batch)  # [N, T]
    with torch.no_grad():
        for path in ("fast", "plain"):
            logp, _ = completion_logprobs(model, batch, path=path, with_entropy=False)
            assert _gap(logp, expected, batch.completion_mask) < 1e-5, path


@pytest.mark.parametrize("family", ["gemma3", "fuyu"])
def test_the_head_of_a_model_whose_inner_model_wraps_the_decoder(family):
    model = _model(family)
    assert decoder_of(model) is not model.model  # the language model inside the inner model
    head = output_head(model)  # raised HeadUnavailable: the forward needs the inner model
    assert head.linear is model.get_output_embeddings()  # these tiny configs do not soft-cap
    batch = sweep_batch(model, vision=False)
    expected = forward_logprobs(model, batch)  # [N, T]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, path="fast", with_entropy=False)
    assert _gap(logp, expected, batch.completion_mask) < 1e-5


def test_all_linear_leaves_a_linear_router_that_returns_a_tuple():
    model = _model("llama4_text")
    names, _ = linear_layers(model)
    assert not any(n.endswith("feed_forward.router") for n in names)
    assert any(n.endswith("self_attn.q_proj") for n in names)
    falcon = _model("falcon")  # FalconLinear: its own forward, a tensor out: still adapted
    names, _ = linear_layers(falcon)
    assert any(n.endswith("query_key_value") for n in names)
