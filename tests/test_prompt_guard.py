"""rollout.max_prompt_tokens / rollout.prompt_overflow (issue 14): a prompt longer than the limit
or than the model's context minus max_new_tokens is filtered (count warned), truncated from the
left, or an error naming the row; the same guard runs for every engine, vLLM included."""

import json
import warnings

import pytest

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.rollouts.prompt_guard import guard_prompts, prompt_limit
from grouprl.train import train

# the tiny Qwen2 has a context of 256 positions and one token per character
LONG = "Count the apples. " * 20 + "How many?"  # 369 characters: over 256 - 4


@pytest.fixture
def data(tmp_path):
    rows = [{"question": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(3)]
    rows.insert(1, {"question": LONG, "answer": "1"})
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path, model_dir, data, *overrides):
    raw = {
        "run": {"name": "g", "output_dir": str(tmp_path), "device": "cpu", "console": False},
        "model": {"name_or_path": str(model_dir)},
        "task": {"name": "math", "options": {"source": str(data)}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "train": {"steps": 1},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def test_an_over_long_prompt_is_filtered_with_a_count(tmp_path, tiny_model_dir, data):
    # old: the 369-token prompt went past the 256-position context without a word
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(_cfg(tmp_path, tiny_model_dir, data))
    text = [str(w.message) for w in caught]
    assert any("1 of 4 train prompts are longer than 252 tokens" in t and "row 1" in t
               for t in text), text  # fmt: skip


def test_an_over_long_prompt_is_an_error_naming_the_row(tmp_path, tiny_model_dir, data):
    cfg = _cfg(tmp_path, tiny_model_dir, data, "rollout.prompt_overflow=error",
               "rollout.max_prompt_tokens=100")  # fmt: skip
    with pytest.raises(ValueError, match=r"train example 1 \(row 1 .*369 tokens, over the limit "
                                         r"of 100 \(rollout.max_prompt_tokens=100\)"):  # fmt: skip
        train(cfg)


def test_truncate_keeps_the_last_tokens(tmp_path, tiny_model_dir, data):
    cfg = _cfg(tmp_path, tiny_model_dir, data, "rollout.prompt_overflow=truncate",
               "rollout.max_prompt_tokens=30")  # fmt: skip
    with pytest.warns(UserWarning, match="1 of 4 train prompts are longer than 30 tokens"):
        train(cfg)
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    policy.prompt_token_limit = 30
    ids = policy.encode_prompts([LONG, "short"])
    assert policy.tokenizer.decode(ids[0]) == LONG[-30:] and len(ids[0]) == 30
    assert policy.tokenizer.decode(ids[1]) == "short"


def test_the_limit_for_each_engine(tmp_path, tiny_model_dir, data):
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    cfg = _cfg(tmp_path, tiny_model_dir, data)
    assert prompt_limit(cfg, policy)[0] == 256 - 4  # fast / hf: the model's context
    cfg = _cfg(tmp_path, tiny_model_dir, data, "rollout.max_prompt_tokens=500")
    assert prompt_limit(cfg, policy)[0] == 252  # the context still bounds it
    cfg = _cfg(tmp_path, tiny_model_dir, data, "rollout.engine=vllm",
               "rollout.vllm.max_model_len=64")  # fmt: skip
    limit, why = prompt_limit(cfg, policy)
    assert limit == 60 and "rollout.vllm.max_model_len" in why  # what vLLM would refuse
    with pytest.warns(UserWarning, match="1 of 2 train prompts .* left out, e.g. row 0"):
        kept, over = guard_prompts([{"prompt": "x" * 61}, {"prompt": "y" * 60}],
                                   policy.encode_prompts, limit, "filter", "train", why)  # fmt: skip
    assert over == 1 and kept == [{"prompt": "y" * 60}]
