"""Multi-turn rollouts: chat-template deltas, token-in/token-out, records, budgets, logp agreement."""

from __future__ import annotations

import math
import re
from types import SimpleNamespace

import pytest
import torch

from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import GenerationOutput, SamplingParams
from grouprl.policies.text.tiny import char_tokenizer, tiny_qwen2
from grouprl.rollouts.chat_delta import (
    first_messages,
    observation_delta_ids,
    observation_delta_text,
)
from grouprl.rollouts.multi_turn import collect_episodes

# Qwen-style ChatML whose turn-closing marker is the tokenizer's EOS ("<eos>" stands for
# <|im_end|>), with a default system message when none is given, as Qwen2.5's template has.
QWEN_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<eos>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<eos>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
NO_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
    "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
EOS = 1  # the char tokenizer's <eos> id


def ids(text: str) -> list[int]:
    return char_tokenizer()(text, add_special_tokens=False).input_ids


def qwen_tokenizer():
    tok = char_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    return tok


class CounterEnv:
    """Text env: state n (start = seed % 3); "<action>inc</action>" adds 1; done at n == target."""

    system_prompt = "Reach the target. Answer <action>inc</action>."

    def __init__(self, target: int = 3) -> None:
        self.target, self.closed = target, False

    def reset(self, seed=None, options=None):
        self.n = (seed or 0) % 3
        return f"n={self.n}", {"anchor": ("n", self.n)}

    def step(self, action: str):
        m = re.search(r"<action>(.*?)</action>", action)
        valid = m is not None and m.group(1) == "inc"
        self.n += int(valid)
        done = self.n >= self.target
        info = {"valid_action": valid, "anchor": ("n", self.n), "success": done}
        return f"n={self.n}", float(done), done, False, info

    def close(self) -> None:
        self.closed = True


class ScriptedEngine:
    """Replies `reply(turn, context_text)` (+ EOS if `eos(turn)`), cut to max_new_tokens; logp -0.5."""

    def __init__(self, tok, reply=None, eos=None) -> None:
        self.tok, self.calls = tok, []
        self.reply = reply or (lambda turn, ctx: "<action>inc</action>")
        self.eos = eos or (lambda turn: True)

    def generate(self, prompts, params, *, greedy=False) -> GenerationOutput:
        turn = len(self.calls)  # live episodes move in lockstep: call k is turn k
        self.calls.append((len(prompts), params.max_new_tokens))
        out = GenerationOutput([], [], [])
        for p in prompts:
            ctx = self.tok.decode(p)
            full = ids(self.reply(turn, ctx)) + ([EOS] if self.eos(turn) else [])
            cut = full[: params.max_new_tokens]
            out.completion_ids.append(cut)
            out.logprobs.append([-0.5] * len(cut))
            out.truncated.append(len(full) > params.max_new_tokens)
        return out


def scripted_policy(tok=None, **engine_kwargs) -> CausalLMPolicy:
    tok = tok or char_tokenizer()
    return CausalLMPolicy(tiny_qwen2(tok), tok, engine=ScriptedEngine(tok, **engine_kwargs))


def run(policy, seeds=(0,), group_size=2, max_turns=4, envs=None, **kw):
    def make():
        env = CounterEnv()
        if envs is not None:
            envs.append(env)
        return env

    kw.setdefault("max_turn_tokens", 32)
    return collect_episodes(
        policy, make, list(seeds), group_size, SamplingParams(), max_turns=max_turns, **kw
    )


# ---- chat-template deltas ----------------------------------------------------------------------


def test_delta_tiny_template():
    tok = char_tokenizer()
    want = "\n<|user|>\nn=3\n<|assistant|>\n"  # no EOS text in this template: nothing dropped
    assert observation_delta_text(tok, "n=3", False) == want
    assert observation_delta_text(tok, "n=3", True) == want
    assert observation_delta_ids(tok, "n=3", True) == ids(want)


def test_delta_qwen_template_drops_sampled_eos():
    tok = qwen_tokenizer()
    after = "\n<|im_start|>user\nn=3<eos>\n<|im_start|>assistant\n"
    assert observation_delta_text(tok, "n=3", False) == "<eos>" + after  # default system absent
    assert observation_delta_text(tok, "n=3", True) == after
    # "<eos>" is one token (the special id), every other character one byte token
    user, assistant = ids("\n<|im_start|>user\nn=3"), ids("\n<|im_start|>assistant\n")
    assert observation_delta_ids(tok, "n=3", False) == [EOS, *user, EOS, *assistant]
    assert observation_delta_ids(tok, "n=3", True) == [*user, EOS, *assistant]


def test_delta_cache_follows_template_changes():
    tok = char_tokenizer()
    assert observation_delta_text(tok, "o", False).startswith("\n<|user|>")
    tok.chat_template = QWEN_TEMPLATE
    assert observation_delta_text(tok, "o", False).startswith("<eos>\n<|im_start|>user")


@pytest.mark.parametrize(
    "template, match",
    [
        (None, "no chat template|has none"),
        ("{{ messages[-1]['content'] }}", "append-only"),  # renders only the last message
        (
            "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] | upper }}"
            "{% else %}{{ m['content'] }}{% endif %}|{% endfor %}",
            "verbatim",
        ),
    ],
)
def test_delta_rejects_unusable_templates(template, match):
    tok = char_tokenizer(chat_template=False)
    tok.chat_template = template
    with pytest.raises(ValueError, match=match):
        observation_delta_text(tok, "x", False)


def test_delta_of_a_trimming_template_strips_the_observation():
    tok = char_tokenizer(chat_template=False)  # Llama 3's templates trim message content
    tok.chat_template = "{% for m in messages %}{{ m['content'] | trim }}|{% endfor %}"
    assert observation_delta_text(tok, "  x y \n", False) == "|x y|"


def test_first_messages_system_role_or_merged():
    tok = char_tokenizer()
    assert first_messages(tok, "S", "o") == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "o"},
    ]
    assert first_messages(tok, "", "o") == [{"role": "user", "content": "o"}]
    tok.chat_template = NO_SYSTEM_TEMPLATE
    assert first_messages(tok, "S", "o") == [{"role": "user", "content": "S\n\no"}]


# ---- records -----------------------------------------------------------------------------------


def test_records_masks_steps_rewards_anchors():
    policy, envs = scripted_policy(), []
    r = run(policy, seeds=(0, 1), group_size=2, max_turns=4, first_group_id=5, envs=envs)
    reply = ids("<action>inc</action>") + [EOS]  # 21 sampled tokens per turn
    delta = [ids(f"\n<|user|>\nn={n}\n<|assistant|>\n") for n in range(3)]
    # seed 0: n 0 -> 3 in three turns; seed 1: n 1 -> 3 in two turns.
    assert r.group_ids.tolist() == [5, 5, 6, 6]
    assert policy.engine.calls == [(4, 32), (4, 32), (2, 32)]  # batched over live episodes
    nan = math.nan
    want_sr = torch.tensor([[0.0, 0.0, 1.0, nan]] * 2 + [[0.0, 1.0, nan, nan]] * 2)
    torch.testing.assert_close(r.step_rewards, want_sr, equal_nan=True)
    assert r.rewards["return"].tolist() == [1.0] * 4
    assert r.anchor_keys == [[("n", 0), ("n", 1), ("n", 2)]] * 2 + [[("n", 1), ("n", 2)]] * 2
    seq0 = reply + delta[1] + reply + delta[2] + reply
    seq1 = reply + delta[2] + reply
    b = r.actions
    assert b.completion_ids[0, : len(seq0)].tolist() == seq0
    assert b.completion_ids[2, : len(seq1)].tolist() == seq1
    assert b.completion_mask.sum(-1).tolist() == [len(seq0)] * 2 + [len(seq1)] * 2
    steps0 = [0] * 21 + [-1] * len(delta[1]) + [1] * 21 + [-1] * len(delta[2]) + [2] * 21
    assert r.step_ids[0, : len(seq0)].tolist() == steps0
    assert (r.step_ids[2, len(seq1) :] == -1).all()
    assert torch.equal(r.mask, r.step_ids >= 0)  # assistant tokens only
    assert torch.equal(r.engine_logp, torch.where(r.mask, -0.5, 0.0))
    assert torch.equal(r.old_logp, r.engine_logp) and r.old_logp is not r.engine_logp
    assert r.info["success"] == [True] * 4 and r.info["turns"] == [3, 3, 2, 2]
    assert r.info["end_reason"] == ["terminated"] * 4 and not b.truncated.any()
    assert r.info["invalid_actions"] == [0] * 4
    assert all(env.closed for env in envs) and len(envs) == 4
    text = r.info["transcript"][0]
    assert "### Episode (group 5, seed 0)" in text and "```text\nn=1\n```" in text
    assert "**end**: terminated, success True, return +1.000, turns 3" in text


def test_group_starts_identical_and_prompt_layout():
    r = run(scripted_policy(), seeds=(0, 1), group_size=3, max_turns=1)
    b = r.actions
    tok = char_tokenizer()
    for g in range(2):
        rows = b.prompt_ids[3 * g : 3 * g + 3][b.prompt_mask[3 * g : 3 * g + 3]].view(3, -1)
        assert (rows == rows[0]).all()
        text = tok.decode(rows[0])
        assert text == (f"<|system|>\n{CounterEnv.system_prompt}\n<|user|>\nn={g}\n<|assistant|>\n")
    assert r.info["end_reason"] == ["max_turns"] * 6 and b.truncated.all()


def test_group_with_different_starts_fails_and_closes_envs():
    made, resets = [], []

    def make():
        env = CounterEnv()

        def reset(seed=None, options=None):  # every reset starts somewhere else
            resets.append(seed)
            return f"n={len(resets)}", {}

        env.reset = reset
        made.append(env)
        return env

    with pytest.raises(ValueError, match="different states"):
        collect_episodes(scripted_policy(), make, [0], 2, SamplingParams(), max_turns=2)
    assert len(made) == 2 and all(env.closed for env in made)


def test_gymnasium_wrapped_env_system_prompt_and_env_truncation():
    import string

    import gymnasium as gym

    class GymCounter(CounterEnv, gym.Env):
        observation_space = gym.spaces.Text(16, charset=string.printable)
        action_space = gym.spaces.Text(64, charset=string.printable)

        def reset(self, seed=None, options=None):
            gym.Env.reset(self, seed=seed)
            return CounterEnv.reset(self, seed)

    # TimeLimit does not forward attributes: the system prompt is found under the wrapper
    make = lambda: gym.wrappers.TimeLimit(GymCounter(target=9), max_episode_steps=2)  # noqa: E731
    r = collect_episodes(scripted_policy(), make, [0], 1, SamplingParams(), max_turns=5)
    assert r.info["messages"][0][0] == {"role": "system", "content": CounterEnv.system_prompt}
    assert r.info["end_reason"] == ["env_truncated"] and r.info["turns"] == [2]
    assert r.actions.truncated.tolist() == [True] and r.info["success"] == [False]


def test_non_text_observation_fails():
    class ArrayEnv(CounterEnv):
        def reset(self, seed=None, options=None):
            return [0, 1], {}

    with pytest.raises(TypeError, match="str observations"):
        collect_episodes(scripted_policy(), ArrayEnv, [0], 1, SamplingParams(), max_turns=1)


def test_invalid_actions_are_penalised_and_counted():
    reply = lambda turn, ctx: "<action>jump</action>" if turn % 2 else "<action>inc</action>"  # noqa: E731
    r = run(scripted_policy(reply=reply), seeds=(0,), group_size=1, max_turns=4)
    # turns: inc (n=1), jump (invalid), inc (n=2), jump (invalid) -> stopped by max_turns
    torch.testing.assert_close(r.step_rewards, torch.tensor([[0.0, -0.1, 0.0, -0.1]]))
    torch.testing.assert_close(r.rewards["return"], torch.tensor([-0.2]))
    assert r.info["invalid_actions"] == [2] and r.info["end_reason"] == ["max_turns"]
    assert "invalid action" in r.info["transcript"][0]
    r = run(scripted_policy(reply=reply), seeds=(0,), group_size=1, invalid_penalty=0.5)
    assert r.rewards["return"].tolist() == [-1.0]


# ---- budgets -----------------------------------------------------------------------------------


def test_turn_token_budget_cuts_turns():
    policy = scripted_policy()
    r = run(policy, seeds=(0,), group_size=1, max_turns=2, max_turn_tokens=10)
    assert policy.engine.calls == [(1, 10), (1, 10)]
    assert r.mask.sum().item() == 20 and r.info["cut_turns"] == [2]
    assert r.info["invalid_actions"] == [2]  # "<action>in" does not parse
    # without EOS sampled, the delta keeps the template's full closing text
    first = r.actions.completion_ids[0, :10].tolist() + r.actions.completion_ids[0, 10:13].tolist()
    assert first == ids("<action>in") + ids("\n<|")


def test_context_overflow_ends_episode_cleanly():
    policy = scripted_policy()
    prompt = len(policy.encode_prompts([first_messages(policy.tokenizer, CounterEnv.system_prompt, "n=0")])[0])  # fmt: skip
    delta = len(ids("\n<|user|>\nn=1\n<|assistant|>\n"))
    # room for exactly two turns: prompt + 21 + delta + worst-case 32, but not a third
    limit = prompt + 21 + delta + 32
    r = run(policy, seeds=(0,), group_size=2, max_turns=5, max_total_tokens=limit)
    assert r.info["turns"] == [2, 2] and r.info["end_reason"] == ["context"] * 2
    assert r.actions.truncated.all() and not any(r.info["success"])
    total = r.actions.prompt_mask.sum(-1) + r.actions.completion_mask.sum(-1)
    assert (total <= limit).all()
    with pytest.raises(ValueError, match="no room"):
        run(policy, seeds=(0,), group_size=1, max_total_tokens=prompt + 31)


def test_argument_errors():
    with pytest.raises(ValueError, match="seed"):
        run(scripted_policy(), seeds=())
    with pytest.raises(ValueError, match="invalid_penalty"):
        run(scripted_policy(), invalid_penalty=-1.0)


# ---- token-in / token-out ----------------------------------------------------------------------


@pytest.mark.parametrize("template", ["tiny", "qwen"])
def test_no_retokenisation_drift_over_five_turns(template):
    tok = qwen_tokenizer() if template == "qwen" else char_tokenizer()
    # turns end with EOS, without EOS (as after a stop string), and one with text that a
    # re-tokeniser could merge differently at its boundaries ("n=" like the observations)
    replies = ["<action>noop</action>", "n=<action>", "x\ny", "<|user|>", "ok"]
    policy = scripted_policy(
        tok, reply=lambda turn, ctx: replies[turn], eos=lambda turn: turn % 2 == 0
    )
    r = run(policy, seeds=(0,), group_size=1, max_turns=5)
    assert r.info["turns"] == [5] and r.info["invalid_actions"] == [5]
    sampled = [ids(t) + ([EOS] if k % 2 == 0 else []) for k, t in enumerate(replies)]
    want = list(policy.encode_prompts([r.info["prompt"][0]])[0])
    assert r.actions.prompt_ids[0].tolist() == want
    for k in range(5):
        want += sampled[k]
        if k < 4:
            want += observation_delta_ids(tok, "n=0", k % 2 == 0)
    got = r.actions.prompt_ids[0].tolist() + r.actions.completion_ids[0].tolist()
    assert got == want
    got_sampled = r.actions.completion_ids[0][r.mask[0]].tolist()
    assert got_sampled == [t for s in sampled for t in s]
    # decoding equals the chat rendering of the conversation (the last observation is not fed)
    messages = r.info["messages"][0]
    assert [m["content"] for m in messages[2::2]] == replies
    rendered = tok.apply_chat_template(messages[:-2], add_generation_prompt=True, tokenize=False)
    if template == "qwen":  # the sampled EOS is the turn's closing marker: visible in the text
        assert tok.decode(got) == rendered + replies[-1] + "<eos>"
    else:  # this template has no EOS text: the sampled EOS is the only extra
        assert tok.decode(got, skip_special_tokens=True) == rendered + replies[-1]


def test_engine_logp_matches_policy_log_probs(tiny_model_dir):
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    torch.manual_seed(0)
    r = collect_episodes(
        policy,
        CounterEnv,
        [0, 1],
        2,
        SamplingParams(temperature=1.0),
        max_turns=3,
        max_turn_tokens=6,
    )
    assert r.mask.sum() > 0 and (~r.mask & r.actions.completion_mask).any()  # env tokens exist
    logp = policy.log_probs(r.actions, with_entropy=False).logp.detach()
    torch.testing.assert_close(logp[r.mask], r.engine_logp[r.mask], atol=1e-5, rtol=0)
    assert (r.engine_logp[~r.mask] == 0).all()


def test_per_sample_seeds_make_episodes_independent_of_batching(tiny_model_dir):
    """seed=S: turn t of episode j of group g samples from generator (S, g, j, t), so the same
    groups collected together or one at a time (as on two processes) give the same tokens, and
    the global RNG plays no part; without a seed the global RNG does."""
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    params = SamplingParams(temperature=1.0)
    kw = dict(max_turns=3, max_turn_tokens=6)

    def tokens(r):
        return [row[m].tolist() for row, m in zip(r.actions.completion_ids, r.mask)]

    torch.manual_seed(0)
    together = collect_episodes(policy, CounterEnv, [0, 1], 3, params, seed=7, **kw)
    torch.manual_seed(1)
    first = collect_episodes(policy, CounterEnv, [0], 3, params, seed=7, **kw)
    second = collect_episodes(policy, CounterEnv, [1], 3, params, seed=7, first_group_id=1, **kw)
    assert tokens(together) == tokens(first) + tokens(second)
    assert len({str(t) for t in tokens(together)}) > 1  # the episodes do differ
    other = collect_episodes(policy, CounterEnv, [0, 1], 3, params, seed=8, **kw)
    assert tokens(other) != tokens(together)
    torch.manual_seed(0)
    a = collect_episodes(policy, CounterEnv, [0, 1], 3, params, **kw)
    torch.manual_seed(1)
    b = collect_episodes(policy, CounterEnv, [0, 1], 3, params, **kw)
    assert tokens(a) != tokens(b)


def test_turn_seeds_hand_checked():
    import hashlib

    from grouprl.rollouts.seeds import turn_seed

    digest = hashlib.blake2b(b"7:1:2:3", digest_size=8).digest()
    assert turn_seed(7, 1, 2, 3) == int.from_bytes(digest, "little") & (2**63 - 1)
    seeds = {turn_seed(7, g, j, t) for g in range(2) for j in range(3) for t in range(4)}
    assert len(seeds) == 24 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize(
    "seeding, greedy, want",
    [("per_sample", False, 5), ("global", False, None), ("per_sample", True, None)],
)
def test_config_seeding_reaches_the_episodes(monkeypatch, seeding, greedy, want):
    from grouprl.config.loading import validate
    from grouprl.workloads import agent as episodes

    seen = {}

    def fake_collect(*args, **kw):
        seen.update(kw)
        return SimpleNamespace(info={"env_made": []})  # no env made

    monkeypatch.setattr(episodes, "collect_episodes", fake_collect)
    monkeypatch.setattr(episodes, "_make_env", lambda ex: CounterEnv)
    cfg = validate({"model": {"name_or_path": "m"},
                    "task": {"name": "env", "options": {"env_id": "x"}},
                    "run": {"seed": 5}, "rollout": {"seeding": seeding}})  # fmt: skip
    examples = [{"env_id": "x", "seed": 0}]
    episodes.collect(cfg, None, examples, SamplingParams(), group_size=2, greedy=greedy)
    assert seen["seed"] == want
