"""sft: teacher-forced greedy exact match agrees with real greedy decoding; the warm-up learns."""

import pytest
import torch

from grouprl.demos.sft import greedy_exact_match, supervised_warmup
from grouprl.envs.tasks import build_task
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.engines.hf import HFEngine
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2

TASK = build_task("arithmetic", n_train=8, n_eval=8, ops="+", max_value=9)


def _greedy_matches(model, tok, ex) -> bool:
    """Real greedy decoding: does it produce exactly answer + EOS?"""
    target = tok(ex["answer"], add_special_tokens=False).input_ids + [tok.eos_token_id]
    prompt = tok(ex["prompt"], add_special_tokens=False).input_ids
    out = HFEngine(model, tok).generate(
        [prompt], SamplingParams(max_new_tokens=len(target) + 2), greedy=True
    )
    return out.completion_ids[0] == target


@pytest.fixture(scope="module")
def half_trained():
    """A tiny model part-way through memorising the train set (some examples right, some not)."""
    tok = char_tokenizer()
    model = tiny_qwen2(tok)
    supervised_warmup(
        model, tok, TASK.train, max_steps=200, target_accuracy=0.5, check_every=10, batch_size=8
    )
    return model, tok


def test_greedy_exact_match_agrees_with_greedy_generation(half_trained):
    model, tok = half_trained
    learned = [ex for ex in TASK.train if greedy_exact_match(model, tok, [ex]) == 1.0]
    probes = (
        TASK.train
        + TASK.eval
        # near misses of answers the model may produce: a prefix (EOS comes too late) and an
        # extension (EOS comes too early) of the learned answer
        + [{**ex, "answer": ex["answer"][:-1] or "0"} for ex in learned]
        + [{**ex, "answer": ex["answer"] + "7"} for ex in learned]
    )
    fast = [greedy_exact_match(model, tok, [ex]) for ex in probes]
    slow = [float(_greedy_matches(model, tok, ex)) for ex in probes]
    assert fast == slow
    assert 0 < sum(fast) < len(fast)  # the comparison covers both outcomes
    # batched (right padded, mixed lengths) gives the mean of the single-example results
    assert greedy_exact_match(model, tok, probes) == pytest.approx(sum(slow) / len(slow))


def test_greedy_exact_match_restores_training_mode(half_trained):
    model, tok = half_trained
    model.train()
    greedy_exact_match(model, tok, TASK.train[:2])
    assert model.training
    model.eval()


def test_warmup_lowers_loss_and_stops_at_target():
    tok = char_tokenizer()
    model = tiny_qwen2(tok)
    assert greedy_exact_match(model, tok, TASK.train) == 0.0  # random init knows nothing
    checks = []
    losses, acc = supervised_warmup(
        model, tok, TASK.train, max_steps=400, target_accuracy=1.0, check_every=10,
        batch_size=8, on_check=lambda *a: checks.append(a),
    )  # fmt: skip
    assert acc == 1.0
    assert len(losses) < 400 and len(losses) % 10 == 0  # stopped early, at a check
    steps = [s for s, _, _ in checks]
    assert steps == list(range(10, len(losses) + 1, 10))
    assert all(a < 1.0 for _, _, a in checks[:-1]) and checks[-1][2] == 1.0
    assert all(loss == losses[s - 1] for s, loss, _ in checks)
    assert sum(losses[-3:]) / 3 < 0.3 * sum(losses[:3]) / 3
    assert not model.training  # left in eval mode
    assert greedy_exact_match(model, tok, TASK.train) == 1.0
    assert all(_greedy_matches(model, tok, ex) for ex in TASK.train)


def test_warmup_without_target_runs_all_steps():
    tok = char_tokenizer()
    model = tiny_qwen2(tok, hidden_size=32, intermediate=64, layers=1)
    before = [p.detach().clone() for p in model.parameters()]
    losses, acc = supervised_warmup(model, tok, TASK.train, max_steps=5, batch_size=4)
    assert len(losses) == 5 and acc is None
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_warmup_needs_answers():
    tok = char_tokenizer()
    model = tiny_qwen2(tok, hidden_size=32, intermediate=64, layers=1)
    with pytest.raises(ValueError, match="'answer'"):
        supervised_warmup(model, tok, [{"prompt": "1+1="}], max_steps=1)
    with pytest.raises(ValueError, match="'answer'"):
        supervised_warmup(model, tok, [], max_steps=1)
