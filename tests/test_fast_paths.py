"""The fast paths of issue 6 against their plain counterparts: same numbers, same distributions.

- FastEngine (rollouts/engines/fast.py) vs HFEngine: greedy outputs identical; sampled tokens
  from the exact processed distribution (chi-square against softmax of the warped logits);
  log-probs equal a fresh forward; EOS / stop / truncation rules; per-sample seeds.
- sample_tokens: hand-computed choices, zero-mass tokens never chosen.
- fused LM head (policies/fused_head.py): hand-computed values; gradients vs autograd.
- fast scoring path (policies/fast_logprobs.py) vs the plain path: log-probs, entropies, losses
  and parameter gradients, with shared prompts, padding, temperature, entropy gradients, LoRA,
  gradient checkpointing; and one whole training update with each path.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from grouprl.policies.text.engines import HFEngine, SamplingParams, TextEngine
from grouprl.policies.text.engines.fast import BLOCK, FastEngine, _runs, sample_tokens
from grouprl.policies.text.fast_logprobs import prompt_runs
from grouprl.policies.text.fused_head import fused_head_logprobs
from grouprl.policies.text.logprobs import completion_logprobs, token_logp_entropy
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.types import TokenBatch

PROMPTS = ["ab", "hello there, how", "x"]


def _biased(tok, bias: dict[int, float], seed=0):
    """Tiny Qwen2 whose lm_head gets a bias (also: a head with a bias term)."""
    model = tiny_qwen2(tok, seed=seed)
    head = nn.Linear(model.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        for token, b in bias.items():
            head.bias[token] = b
    model.lm_head = head
    return model


def _groups(tok, prompts, g):
    return [tok(p).input_ids for p in prompts for _ in range(g)]


def _fresh_logp(model, prompt, completion, warp=lambda s: s):
    """log-probs of `completion` under the warped softmax, from one fresh forward."""
    ids = torch.tensor([prompt + completion])  # [1, P+T]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [T, V]
    logp = torch.log_softmax(warp(logits), -1)  # [T, V]
    return logp.gather(-1, torch.tensor(completion)[:, None])[:, 0]  # [T]


# ---- sample_tokens ---------------------------------------------------------------------------


def test_sample_tokens_hand_computed_choices():
    p = torch.tensor([[0.5, 0.0, 0.5]])  # one block (padded to BLOCK with zeros)
    logp = p.log()  # [1, 3], -inf at token 1
    pick = lambda u1, u2: int(sample_tokens(logp, torch.tensor([[u1, u2]])))  # noqa: E731
    assert pick(0.0, 0.0) == 0
    assert pick(0.0, 0.4999) == 0
    assert pick(0.0, 0.5) == 2  # cdf = [.5, .5, 1]: first cdf > 0.5 is token 2, never token 1
    assert pick(0.3, 1 - 2**-53) == 2  # the very top never lands on the zero padding
    # two blocks: mass 0.25 on token 5, 0.75 on token BLOCK + 2
    q = torch.zeros(1, BLOCK + 10)
    q[0, 5], q[0, BLOCK + 2] = 0.25, 0.75
    logq = q.log()
    assert int(sample_tokens(logq, torch.tensor([[0.2, 0.9]]))) == 5
    assert int(sample_tokens(logq, torch.tensor([[0.25, 0.0]]))) == BLOCK + 2
    assert int(sample_tokens(logq, torch.tensor([[1 - 2**-53, 1 - 2**-53]]))) == BLOCK + 2


def test_sample_tokens_matches_the_distribution_and_never_picks_zero_mass():
    g = torch.Generator().manual_seed(0)
    V = 2 * BLOCK + 37  # three blocks, the last one padded
    logits = torch.randn(V, generator=g) * 2
    logits[::7] = -float("inf")  # excluded tokens (as after top-k / top-p)
    logp = torch.log_softmax(logits, -1)  # [V]
    n = 40000
    u = torch.rand(n, 2, dtype=torch.float64, generator=g)
    picks = sample_tokens(logp.expand(n, V), u)  # [n]
    assert torch.isfinite(logp[picks]).all()
    counts = torch.bincount(picks, minlength=V).double()  # [V]
    expected = n * logp.double().exp()  # [V]
    big = expected > 5
    chi2 = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    dof = int(big.sum()) - 1
    assert chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)  # ~5 sigma for a chi2(dof)


def test_sample_tokens_rejects_nan_rows():
    with pytest.raises(RuntimeError, match="non-finite"):
        sample_tokens(torch.full((1, 4), float("nan")), torch.zeros(1, 2))


# ---- FastEngine vs HFEngine -------------------------------------------------------------------


def test_runs_groups_consecutive_identical_prompts():
    assert _runs([[1], [1], [2], [1], [1]]) == ([[1], [2], [1]], [2, 1, 2])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_greedy_identical_to_hf_engine_with_eos_and_stop_strings(temperature):
    tok = char_tokenizer()
    model = _biased(tok, {tok.eos_token_id: 1.5, tok("a").input_ids[0]: 1.0})
    prompts = _groups(tok, PROMPTS, 3)
    for params in (
        SamplingParams(temperature=temperature, max_new_tokens=20),
        SamplingParams(temperature=temperature, max_new_tokens=20, stop=["aa", "\n"]),
    ):
        hf = HFEngine(model, tok).generate(prompts, params, greedy=True)
        fast = FastEngine(model, tok).generate(prompts, params, greedy=True)
        assert fast.completion_ids == hf.completion_ids
        assert fast.truncated == hf.truncated
        for a, b in zip(fast.logprobs, hf.logprobs):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=2e-5, rtol=0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.7, max_new_tokens=14),
        SamplingParams(temperature=1.3, top_k=30, top_p=0.8, max_new_tokens=14),
    ],
)
def test_logprobs_equal_a_fresh_forward_under_the_warped_distribution(params):
    """Shared prefill (groups of 4, left padding) and dropped finished rows keep the numbers."""
    tok = char_tokenizer()
    model = _biased(tok, {tok.eos_token_id: 2.5})
    prompts = _groups(tok, PROMPTS, 4)
    torch.manual_seed(0)
    out = FastEngine(model, tok).generate(prompts, params)
    lengths = [len(c) for c in out.completion_ids]
    assert min(lengths) < params.max_new_tokens and max(lengths) > 1  # rows did finish early
    warpers = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))

    def warp(scores):
        for w in warpers:
            scores = w(None, scores)
        return scores

    for p, c, lp in zip(prompts, out.completion_ids, out.logprobs):
        ref = _fresh_logp(model, p, c, warp)
        assert torch.isfinite(ref).all()  # never a token outside top-k / top-p
        torch.testing.assert_close(torch.tensor(lp), ref, atol=2e-5, rtol=0)


def test_first_token_distribution_is_the_processed_softmax():
    """Chi-square of 3000 first tokens against softmax(top-p(top-k(logits / T)))."""
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=3)
    prompt = tok("12+").input_ids
    params = SamplingParams(temperature=0.5, top_k=40, top_p=0.95, max_new_tokens=1)
    with torch.no_grad():
        scores = model(torch.tensor([prompt])).logits[:, -1].float()  # [1, V]
    for w in (TemperatureLogitsWarper(0.5), TopKLogitsWarper(40), TopPLogitsWarper(0.95)):
        scores = w(None, scores)
    probs = torch.softmax(scores, -1)[0].double()  # [V]
    n = 3000
    torch.manual_seed(0)
    out = FastEngine(model, tok).generate([prompt] * n, params)
    counts = torch.bincount(torch.tensor([c[0] for c in out.completion_ids]), minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    expected = n * probs
    big = expected > 5
    chi2 = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    dof = int(big.sum()) - 1
    assert dof >= 5 and chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


def test_eos_stop_and_truncation_rules():
    tok = char_tokenizer()
    eos = tok.eos_token_id
    model = _biased(tok, {eos: 3.0})
    torch.manual_seed(1)
    out = FastEngine(model, tok).generate(
        [tok("ab").input_ids] * 16, SamplingParams(max_new_tokens=12)
    )
    ends = 0
    for ids, trunc in zip(out.completion_ids, out.truncated):
        assert 1 <= len(ids) <= 12 and eos not in ids[:-1]
        if ids[-1] == eos:
            ends += 1
            assert not trunc
        else:
            assert trunc and len(ids) == 12
    assert 0 < ends < 16
    a, b = tok("a").input_ids[0], tok("b").input_ids[0]
    model = _biased(tok, {a: 8.0, b: 8.0})
    torch.manual_seed(0)
    out = FastEngine(model, tok).generate(
        [tok("q").input_ids] * 6, SamplingParams(max_new_tokens=30, stop=["ab"])
    )
    for ids, trunc in zip(out.completion_ids, out.truncated):
        text = tok.decode(ids)
        assert text.endswith("ab") and "ab" not in text[:-1] and not trunc, text


def test_seeded_rows_do_not_depend_on_the_batch():
    tok = char_tokenizer()
    model = _biased(tok, {tok.eos_token_id: 1.0})
    prompts = _groups(tok, PROMPTS, 2)
    seeds = list(range(100, 100 + len(prompts)))
    params = SamplingParams(max_new_tokens=10, top_p=0.9)
    engine = FastEngine(model, tok)
    a = engine.generate(prompts, params, seeds=seeds)
    b = FastEngine(model, tok, batch_size=1).generate(prompts, params, seeds=seeds)
    c = engine.generate(prompts[::-1], params, seeds=seeds[::-1])
    assert a.completion_ids == b.completion_ids == c.completion_ids[::-1]
    assert (
        a.completion_ids != engine.generate(prompts, params, seeds=seeds[1:] + [7]).completion_ids
    )
    with pytest.raises(ValueError, match="seeds"):
        engine.generate(prompts, params, seeds=seeds[:2])


def test_engine_contract_and_training_mode_restored():
    tok = char_tokenizer()
    model = tiny_qwen2(tok).train()
    engine = FastEngine(model, tok)
    assert isinstance(engine, TextEngine)
    engine.load_weights({})
    assert engine.generate([], SamplingParams()).completion_ids == []
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="batch_size"):
        FastEngine(model, tok, batch_size=0)
    engine.generate([tok("a").input_ids], SamplingParams(max_new_tokens=2))
    assert model.training


def test_policy_and_config_select_the_engine(tiny_model_dir):
    from grouprl.config.loading import Config
    from grouprl.policies.text.causal_lm import CausalLMPolicy
    from grouprl.workloads import build_policy

    cfg = Config.model_validate(
        {"model": {"name_or_path": str(tiny_model_dir)}, "task": {"name": "arithmetic"},
         "rollout": {"engine": "fast"}, "run": {"device": "cpu"}}
    )  # fmt: skip
    assert isinstance(build_policy(cfg, torch.device("cpu")).engine, FastEngine)
    with pytest.raises(ValueError, match="unknown local engine"):
        CausalLMPolicy(tiny_qwen2(char_tokenizer()), char_tokenizer(), engine="nope")


def test_engine_log_probs_equal_the_trainers_under_lora():
    """The engine runs the adapters (they are injected into the base model it calls)."""
    from grouprl.policies.text.causal_lm import CausalLMPolicy

    tok = char_tokenizer()
    policy = CausalLMPolicy(
        tiny_qwen2(tok, seed=5), tok, engine="fast",
        lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    )  # fmt: skip
    with torch.no_grad():
        for n, p in policy.model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    torch.manual_seed(0)
    rollout = policy.sample(["ab", "xyz"], 3, SamplingParams(max_new_tokens=8))
    with torch.no_grad():
        trainer = policy.log_probs(rollout.actions, with_entropy=False).logp  # [N, T]
        with policy.model.disable_adapter():
            base = policy.log_probs(rollout.actions, with_entropy=False).logp  # [N, T]
    m = rollout.mask
    torch.testing.assert_close(rollout.engine_logp[m], trainer[m], atol=2e-5, rtol=0)
    assert (rollout.engine_logp[m] - base[m]).abs().max() > 1e-3  # the adapters matter


# ---- fused LM head ----------------------------------------------------------------------------


def test_fused_head_hand_computed():
    head = nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    h = torch.tensor([[math.log(2.0), 0.0]])  # logits [ln 2, 0, 0] -> p = [1/2, 1/4, 1/4]
    logp, ent = fused_head_logprobs(h, head, torch.tensor([1]))
    assert logp.item() == pytest.approx(math.log(0.25), abs=1e-6)
    assert ent.item() == pytest.approx(-(0.5 * math.log(0.5) + 0.5 * math.log(0.25)), abs=1e-6)
    # temperature 1/2 doubles the logits: [2 ln 2, 0, 0] -> p = [4/6, 1/6, 1/6]
    logp, _ = fused_head_logprobs(h, head, torch.tensor([0]), temperature=0.5)
    assert logp.item() == pytest.approx(math.log(4 / 6), abs=1e-6)


@pytest.mark.parametrize("bias,temperature,entropy_grad", [(False, 1.0, False), (True, 0.7, True)])
def test_fused_head_gradients_match_autograd(bias, temperature, entropy_grad):
    g = torch.Generator().manual_seed(0)
    M, H, V = 23, 8, 300
    head = nn.Linear(H, V, bias=bias)
    h = torch.randn(M, H, generator=g, requires_grad=True)
    ids = torch.randint(0, V, (M,), generator=g)
    w_lp, w_en = torch.randn(M, generator=g), torch.randn(M, generator=g)
    params = [h, *head.parameters()]
    lp, en = fused_head_logprobs(
        h, head, ids, temperature=temperature, chunk_size=5, entropy_grad=entropy_grad
    )
    loss = (lp * w_lp).sum() + ((en * w_en).sum() if entropy_grad else 0.0)
    fused = torch.autograd.grad(loss, params)
    lp2, en2 = token_logp_entropy(head(h) / temperature, ids, entropy_grad=entropy_grad)
    loss2 = (lp2 * w_lp).sum() + ((en2 * w_en).sum() if entropy_grad else 0.0)
    plain = torch.autograd.grad(loss2, params)
    torch.testing.assert_close(lp, lp2, atol=1e-5, rtol=0)
    torch.testing.assert_close(en, en2, atol=1e-5, rtol=0)
    for a, b in zip(fused, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert en.requires_grad == entropy_grad


# ---- fast scoring path vs plain ---------------------------------------------------------------


def test_prompt_runs_hand_computed():
    ids = torch.tensor([[0, 5], [0, 5], [4, 5], [0, 5]])
    mask = torch.tensor([[0, 1], [0, 1], [1, 1], [1, 1]]).bool()
    assert prompt_runs(ids, mask).tolist() == [0, 0, 1, 2]  # same ids, other mask: a new run


def _batch(tok, prompts, g, completions_len, seed=0):
    """Groups of g rows with left-padded prompts and right-padded random completions."""
    gen = torch.Generator().manual_seed(seed)
    p_rows = [torch.tensor(tok(p).input_ids) for p in prompts for _ in range(g)]
    P = max(len(r) for r in p_rows)
    N, T = len(p_rows), completions_len
    p_ids = torch.zeros(N, P, dtype=torch.long)
    p_mask = torch.zeros(N, P, dtype=torch.bool)
    for i, r in enumerate(p_rows):
        p_ids[i, P - len(r) :], p_mask[i, P - len(r) :] = r, True
    lengths = torch.randint(1, T + 1, (N,), generator=gen)
    lengths[0] = T
    c_mask = torch.arange(T) < lengths[:, None]  # [N, T]
    c_ids = torch.randint(3, len(tok), (N, T), generator=gen).masked_fill(~c_mask, 0)
    return TokenBatch(p_ids, p_mask, c_ids, c_mask, lengths == T)


def _loss_and_grads(model, batch, path, temperature=1.0, entropy_coef=0.0, chunk_size=None):
    model.zero_grad(set_to_none=True)
    logp, ent = completion_logprobs(
        model, batch, path=path, temperature=temperature, chunk_size=chunk_size,
        entropy_grad=entropy_coef != 0,
    )  # fmt: skip
    adv = torch.linspace(-1, 1, logp.shape[0])[:, None]  # [N, 1]
    m = batch.completion_mask
    loss = -((logp * adv + entropy_coef * ent) * m).sum() / m.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), logp.detach(), ent.detach(), grads


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-6, rtol=1e-5)  # loss
    torch.testing.assert_close(a[1], b[1], atol=2e-5, rtol=0)  # logp
    torch.testing.assert_close(a[2], b[2], atol=5e-5, rtol=0)  # entropy
    assert a[3].keys() == b[3].keys() and len(a[3]) > 0
    for name in a[3]:
        torch.testing.assert_close(a[3][name], b[3][name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "g,temperature,entropy_coef,chunk",
    [(4, 1.0, 0.0, None), (3, 0.7, 0.05, 2), (1, 1.0, 0.0, None)],  # g=1: no prompt repeats
)
def test_fast_path_equals_plain_path(g, temperature, entropy_coef, chunk):
    tok = char_tokenizer()
    model = _biased(tok, {}, seed=1).train()
    batch = _batch(tok, PROMPTS, g, completions_len=9)
    plain = _loss_and_grads(model, batch, "plain", temperature, entropy_coef, chunk)
    fast = _loss_and_grads(model, batch, "fast", temperature, entropy_coef, chunk)
    _assert_same(fast, plain)
    assert (fast[1][~batch.completion_mask] == 0).all()


def test_fast_path_with_one_token_completions_tied_head_and_checkpointing():
    tok = char_tokenizer()
    model = tiny_qwen2(tok, seed=2).train()  # tied embeddings: the head's weight is shared
    batch = _batch(tok, PROMPTS, 2, completions_len=1)
    _assert_same(_loss_and_grads(model, batch, "fast"), _loss_and_grads(model, batch, "plain"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batch = _batch(tok, PROMPTS, 2, completions_len=6)
    _assert_same(_loss_and_grads(model, batch, "fast"), _loss_and_grads(model, batch, "plain"))


def test_fast_path_with_lora_adapters_and_lora_on_the_head():
    from grouprl.policies.text.causal_lm import CausalLMPolicy

    tok = char_tokenizer()
    for targets in (["q_proj", "v_proj"], ["q_proj", "lm_head"]):  # lm_head LoRA: chunked head
        policy = CausalLMPolicy(
            tiny_qwen2(tok, seed=4), tok, lora={"r": 4, "alpha": 8, "target_modules": targets}
        )
        with torch.no_grad():  # non-zero B matrices, so the adapters change the outputs
            for n, p in policy.model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        model = policy.model.get_base_model().train()
        batch = _batch(tok, PROMPTS, 3, completions_len=5)
        _assert_same(_loss_and_grads(model, batch, "fast"), _loss_and_grads(model, batch, "plain"))


def test_unknown_path_is_an_error():
    tok = char_tokenizer()
    with pytest.raises(ValueError, match="log-prob path"):
        completion_logprobs(tiny_qwen2(tok), _batch(tok, ["a"], 1, 2), path="nope")


def test_one_training_update_is_the_same_with_either_path(tiny_model_dir):
    """train.update with model.logprob_path fast vs plain: same loss, same gradients."""
    from grouprl.config.loading import Config
    from grouprl.runtime.build import build_optimizer
    from grouprl.train import update
    from grouprl.types import Rollout
    from grouprl.workloads import build_policy, build_workload

    tok = char_tokenizer()
    batch = _batch(tok, PROMPTS, 4, completions_len=7)
    results = {}
    for path in ("plain", "fast"):
        cfg = Config.model_validate(
            {"model": {"name_or_path": str(tiny_model_dir), "logprob_path": path},
             "task": {"name": "arithmetic"},
             "algorithm": {"kl_coef": 0.0, "entropy_coef": 0.01}, "train": {"lr": 1e-2},
             "run": {"device": "cpu"}}
        )  # fmt: skip
        policy = build_policy(cfg, torch.device("cpu"))
        assert policy.logprob_path == path
        optimizer, scheduler = build_optimizer(cfg, policy)
        rollout = Rollout(
            group_ids=torch.arange(3).repeat_interleave(4), rewards={}, actions=batch,
            old_logp=torch.zeros(12, 7), mask=batch.completion_mask.clone(),
        )  # fmt: skip
        rollout.advantages = torch.linspace(-1, 1, 12)
        metrics = update(
            cfg, build_workload(cfg, policy=policy), policy, optimizer, scheduler, rollout
        )
        # AdamW's first moment after one step is 0.1 x the (clipped) gradient; the weights
        # themselves move by ~lr * sign(g), which amplifies round-off where g ~ 0
        moments = [optimizer.state[p]["exp_avg"] for p in policy.trainable_parameters()]
        results[path] = (metrics, moments)
    (m_plain, w_plain), (m_fast, w_fast) = results["plain"], results["fast"]
    for k in ("loss", "grad_norm"):
        assert m_fast[k] == pytest.approx(m_plain[k], rel=1e-4, abs=1e-7), k
    for a, b in zip(w_fast, w_plain):
        torch.testing.assert_close(a, b, atol=1e-8, rtol=1e-4)


# ---- benchmark helpers ------------------------------------------------------------------------


def test_benchmark_workload_helpers(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import _common

    assert _common.digit_reward(["a1b2", "", "999"]) == [0.5, 0.0, 1.0]
    tok = _common.wide_char_tokenizer(1000)
    assert len(tok) == 1000
    base = char_tokenizer()
    assert tok("12+34=").input_ids == base("12+34=").input_ids  # extra tokens never encoded
    assert tok.decode([base("a").input_ids[0], 999]).startswith("a")
    table = _common.format_table(["x", "y"], [[1, 2.5]])
    assert table.splitlines()[2] == "| 1 | 2.5 |"


def test_hardware_limit_sorts_and_counts_a_steps_matrix_products():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import hardware_limit as H

    lin = nn.Linear(8, 4)
    x = torch.randn(5, 8, requires_grad=True)

    class Engine:
        def generate(self):
            with torch.no_grad():
                return lin(x)  # addmm: bias [4], x [5, 8], W^T [8, 4] (a transposed view)

    engine = Engine()

    def step():
        engine.generate()
        (lin(x).sum() + torch.mm(x, x.t()).sum()).backward()

    calls = H.record_matmuls(step, engine)
    assert engine.generate.__func__ is Engine.generate  # the engine is given back unwrapped
    [(op, operands)] = calls["generate"]
    assert op == "addmm"
    assert [o[:2] for o in operands] == [((4,), (1,)), ((5, 8), (8, 1)), ((8, 4), (1, 8))]
    assert operands[2][2] == lin.weight.data_ptr()
    assert sorted(op for op, _ in calls["update_forward"]) == ["addmm", "mm"]
    assert len(calls["update_backward"]) == 4  # dx and dW of the linear and of x x^T
    # 2 m k n per product: 2*5*8*4 = 320; a batched product counts each batch
    assert H.matmul_gflop(calls["generate"]) == pytest.approx(320e-9)
    bmm = ("bmm", [((3, 2, 5), (10, 5, 1), 1), ((3, 5, 7), (35, 7, 1), 2)])
    assert H.matmul_gflop([bmm]) == pytest.approx(3 * 140e-9)
    floor = H.matmul_floor(step, engine, pairs=2)
    assert floor["calls"] == {"generate": 1, "update_forward": 2, "update_backward": 4}
    assert len(floor["pairs"]) == 2 and floor["step_s"] > 0
    shares = [sum(p["seconds"].values()) / p["step_s"] for p in floor["pairs"]]
    assert floor["share_of_step"] == pytest.approx(sum(shares) / 2)
    assert H.replay_seconds(H.replay_work([bmm])) > 0 and H.replay_work([]) == []
