"""reward_model on a faithful Qwen2.5 RM replica (Qwen2ForSequenceClassification in hub layout)."""

from __future__ import annotations

import pytest
import torch

from grouprl.envs.rewards import build_reward
from grouprl.replicas.text import build

PROMPTS = [
    [{"role": "user", "content": "What is 2+2?"}],
    "Name a colour.",
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
]
COMPLETIONS = [
    [{"role": "assistant", "content": "4"}],
    "Blue, like the sky over the sea on a clear day.",
    "Hello there!",
]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return str(build("qwen2.5-rm", tmp_path_factory.mktemp("rm")))


def _hand_scores(rm_dir, dtype=torch.float32):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(rm_dir)
    net = AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=dtype).eval()
    out = []
    for p, c in zip(PROMPTS, COMPLETIONS):
        msgs = [{"role": "user", "content": p}] if isinstance(p, str) else p
        text = c if isinstance(c, str) else c[-1]["content"]
        rendered = tok.apply_chat_template(
            [*msgs, {"role": "assistant", "content": text}], tokenize=False
        )
        assert rendered.endswith(text + "<|im_end|>\n")
        ids = tok(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"]  # [1, T]
        with torch.no_grad():
            out.append(net(input_ids=ids).logits[0, 0].float().item())  # one sequence: no pads
    return out


def test_score_is_the_rm_logit_of_the_rendered_conversation(rm_dir):
    fn = build_reward("reward_model", model=rm_dir, batch_size=3)
    got = fn(completions=COMPLETIONS, prompts=PROMPTS)
    want = _hand_scores(rm_dir)
    assert got == pytest.approx(want, abs=1e-4)
    assert max(want) - min(want) > 1e-3  # the samples are told apart
    scaled = build_reward("reward_model", model=rm_dir, scale=2.0, shift=-1.0)
    assert scaled(completions=COMPLETIONS, prompts=PROMPTS) == pytest.approx(
        [2 * w - 1 for w in want], abs=1e-4
    )


def test_batching_and_padding_side_do_not_change_scores(rm_dir):
    ref = build_reward("reward_model", model=rm_dir, batch_size=1)(
        completions=COMPLETIONS, prompts=PROMPTS
    )
    for batch_size, side in [(3, "right"), (3, "left"), (2, "left")]:
        fn = build_reward("reward_model", model=rm_dir, batch_size=batch_size, padding_side=side)
        assert fn(completions=COMPLETIONS, prompts=PROMPTS) == pytest.approx(ref, abs=1e-4)


def test_dtype_option_is_honoured(rm_dir):
    from grouprl.envs.rewards.reward_model import load_reward_model

    fn = build_reward("reward_model", model=rm_dir, dtype="bfloat16", batch_size=3)
    got = fn(completions=COMPLETIONS, prompts=PROMPTS)
    net, _ = load_reward_model(rm_dir, "cpu", "bfloat16")
    assert net.score.weight.dtype == torch.bfloat16
    assert got == pytest.approx(_hand_scores(rm_dir, torch.bfloat16), abs=2e-2)


def test_max_length_truncates_from_the_left_and_warns_once(rm_dir):
    fn = build_reward("reward_model", model=rm_dir, max_length=8)
    with pytest.warns(UserWarning, match="max_length=8") as record:
        a = fn(completions=COMPLETIONS, prompts=PROMPTS)
        fn(completions=COMPLETIONS, prompts=PROMPTS)
    assert sum("max_length" in str(w.message) for w in record) == 1
    assert a != pytest.approx(_hand_scores(rm_dir), abs=1e-4)
    with pytest.raises(ValueError, match="dtype"):
        build_reward("reward_model", model=rm_dir, dtype="int8")


def test_render_without_a_chat_template_concatenates(rm_dir):
    from transformers import AutoTokenizer

    from grouprl.envs.rewards.reward_model import render

    tok = AutoTokenizer.from_pretrained(rm_dir)
    assert render(tok, "What is 2+2?", "4").startswith("<|im_start|>system\n")
    tok.chat_template = None
    assert render(tok, "Q: 2+2=", " 4") == "Q: 2+2= 4"
    assert render(
        tok, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "c"
    ) == ("a\nbc")
    assert render(tok, None, [{"role": "assistant", "content": "x"}]) == "x"
