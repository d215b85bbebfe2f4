"""Chat templates probed, not assumed; end of turn from the generation config and the tokenizer
(issue 28, items "chat templates are assumed, not probed" and "end of turn is assumed").

On the replicas of the families that show each class:
  - Gemma 2's template raises on a system message: the shipped GSM8K config folds the system
    prompt into the first user turn (announced once), or refuses naming model.chat_fallback;
    the reward-model reward does the same with its own option;
  - Gemma 2 ends a turn with <end_of_turn> (generation_config eos [1, 107], tokenizer EOS <eos>):
    a multi-turn episode and the gateway hold exactly one end-of-turn token per turn;
  - Phi-3's template drops `tools=` and `tool` messages without a word, Gemma's raises on a tool
    turn: tools are listed in plain text and tool results come back as a user turn;
  - Qwen2.5, Llama 3 and Mistral render everything: their probes say so and nothing changes.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from test_tools_bugs import AnswerEnv, ScriptedEngine, add
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl.cli import main
from grouprl.envs.tools.schemas import ToolSet, template_supports_tools, tools_system_prompt
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.policies.text.loading import encode_prompts
from grouprl.policies.text.stop_ids import stop_ids
from grouprl.replicas.text import build
from grouprl.rollouts import chat_probe
from grouprl.rollouts.chat_probe import (
    ChatTemplateFallbackWarning,
    probe_chat,
    set_chat_fallback,
)
from grouprl.rollouts.multi_turn import collect_episodes

ROOT = Path(__file__).resolve().parents[1]
GSM8K_SYSTEM = "Solve the problem. Put the final answer after '####'."
FAMILIES = ("gemma2", "phi3", "qwen2.5", "llama3", "mistral")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_probe")
    return {f: build(f, root / f) for f in FAMILIES}


@pytest.fixture(autouse=True)
def fresh_announcements(monkeypatch):
    """Each test sees the first announcement of a fallback (they are once per process)."""
    monkeypatch.setattr(chat_probe, "_ANNOUNCED", set())


def _tok(folders, family):
    """A fresh tokenizer object (the fallback mode and the probe cache live per tokenizer)."""
    return AutoTokenizer.from_pretrained(folders[family])


def _fallback_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, ChatTemplateFallbackWarning)]


# ---- the probe -------------------------------------------------------------------------------


def test_probe_reads_what_each_template_renders(folders):
    got = {f: probe_chat(_tok(folders, f)) for f in FAMILIES}
    full = (True, True, True, True)
    for family in ("qwen2.5", "llama3", "mistral"):
        g = got[family]
        assert (g.system, g.tools, g.tool_role, g.tool_calls) == full, family
    g = got["gemma2"]  # raises on a system message and on a tool turn, ignores tools=
    assert (g.system, g.tools, g.tool_role, g.tool_calls) == (False, False, False, False)
    g = got["phi3"]  # renders a system turn; drops tools=, tool messages and tool calls
    assert (g.system, g.tools, g.tool_role, g.tool_calls) == (True, False, False, False)
    assert got["gemma2"].source == str(folders["gemma2"])


def test_a_template_that_mentions_tools_without_rendering_them(folders):
    """The word "tools" in a template is not a tools branch: the old text search said yes and
    the schemas were lost; rendering says no and they are listed in plain text."""
    tok = _tok(folders, "phi3")
    tok.chat_template = "{# tools: see the model card #}" + tok.chat_template
    with pytest.warns(ChatTemplateFallbackWarning, match="does not render tools"):
        assert not template_supports_tools(tok)
    listing = tools_system_prompt(ToolSet([add]), tok)
    assert listing.startswith("You can use the following tools") and '"name": "add"' in listing


def test_call_format_is_read_off_the_render(folders):
    from grouprl.envs.tools.formats import detect_tool_format

    got = {f: detect_tool_format(_tok(folders, f)) for f in FAMILIES}
    assert got == {"gemma2": "hermes", "phi3": "hermes", "qwen2.5": "hermes",
                   "llama3": "llama3_json", "mistral": "mistral"}  # fmt: skip


def test_stop_ids_are_the_generation_config_then_the_tokenizer(folders):
    gemma = _tok(folders, "gemma2")
    model = AutoModelForCausalLM.from_pretrained(folders["gemma2"])
    assert gemma.eos_token_id == 1 and gemma.convert_ids_to_tokens(107) == "<end_of_turn>"
    assert stop_ids(model.generation_config, gemma) == [1, 107]
    phi = _tok(folders, "phi3")
    ids = [phi.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|assistant|>", "<|end|>")]
    gen = json.loads((folders["phi3"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ids and stop_ids(type("G", (), gen), phi) == ids
    # a generation config that does not list the tokenizer's EOS: both, the config's first
    assert stop_ids(type("G", (), {"eos_token_id": 107}), gemma) == [107, 1]
    assert stop_ids(None, gemma) == [1]
    with pytest.raises(ValueError, match="neither"):
        stop_ids(None, None)


# ---- system role: the shipped GSM8K config on Gemma 2 ----------------------------------------


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "gsm8k.jsonl"
    rows = [("What is 2+3?", "2+3=5\n#### 5"), ("What is 4+4?", "#### 8"), ("1+6?", "#### 7")]
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in rows))
    return path


def _gsm8k(folders, data, out, *extra):
    return main(
        ["train", str(ROOT / "configs/text/gsm8k_qwen_lora.yaml"),
         f"model.name_or_path={folders['gemma2']}", f"run.output_dir={out}", "train.steps=1",
         "rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=4",
         "eval.every=0", "checkpoint.every=0", "run.console=false", "train.micro_batch_size=2",
         "model.gradient_checkpointing=false", f"task.options.source={data}",
         f"task.options.eval_source={data}", "task.options.config=null",
         "task.options.eval_config=null", "task.options.split=null",
         "task.options.eval_split=null", *extra]
    )  # fmt: skip


def test_gsm8k_config_on_gemma2_folds_the_system_prompt_once(folders, gsm8k_file, tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _gsm8k(folders, gsm8k_file, tmp_path / "out") == 0
    announced = _fallback_warnings(record)
    assert len(announced) == 1, announced  # once, however many prompts were rendered
    assert "has no system role" in announced[0] and str(folders["gemma2"]) in announced[0]
    assert "model.chat_fallback" in announced[0]


def test_gsm8k_config_on_gemma2_refuses_naming_the_option(folders, gsm8k_file, tmp_path, capsys):
    rc = _gsm8k(folders, gsm8k_file, tmp_path / "out", "model.chat_fallback=error")
    assert rc == 2
    err = capsys.readouterr().err
    assert "has no system role" in err and "set model.chat_fallback: announce" in err
    assert not list((tmp_path / "out").rglob("config.yaml"))  # refused before the run directory


def test_folded_prompt_is_the_first_user_turn(folders):
    tok = _tok(folders, "gemma2")
    chat = [{"role": "system", "content": GSM8K_SYSTEM}, {"role": "user", "content": "2+3?"}]
    with pytest.warns(ChatTemplateFallbackWarning):
        ids = encode_prompts(tok, [chat])[0]
    assert tok.decode(ids) == (
        f"<bos><start_of_turn>user\n{GSM8K_SYSTEM}\n\n2+3?<end_of_turn>\n<start_of_turn>model\n"
    )


# ---- the reward model's template -------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_rm(folders, tmp_path_factory):
    """A Gemma 2 reward model: Gemma2ForSequenceClassification (num_labels 1) on the replica's
    config, with Gemma's tokenizer and template."""
    from transformers import AutoConfig, Gemma2ForSequenceClassification

    out = tmp_path_factory.mktemp("rm") / "gemma2-rm"
    cfg = AutoConfig.from_pretrained(folders["gemma2"], num_labels=1, pad_token_id=0)
    torch.manual_seed(0)
    Gemma2ForSequenceClassification(cfg).to(torch.bfloat16).save_pretrained(out)
    _tok(folders, "gemma2").save_pretrained(out)
    return str(out)


def test_reward_model_with_a_template_without_system_role(gemma_rm):
    from grouprl.envs.rewards.reward_model import reward_model

    prompt = [{"role": "system", "content": GSM8K_SYSTEM}, {"role": "user", "content": "2+3?"}]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        scores = reward_model(gemma_rm)(["#### 5", "#### 6"], [prompt, prompt])
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)
    assert len(_fallback_warnings(record)) == 1  # once for both rows
    with pytest.raises(ValueError, match="reward_model option chat_fallback"):
        reward_model(gemma_rm, chat_fallback="error")(["#### 5"], [prompt])


# ---- end of turn: multi-turn episodes and the gateway -----------------------------------------


class TwoQuestions:
    """Two turns: a question, then a follow-up; reward 1 at the end."""

    system_prompt = GSM8K_SYSTEM

    def reset(self, seed=None, options=None):
        self.t = 0
        return "What is 2+3?", {"anchor": 0}

    def step(self, action: str):
        self.t += 1
        done = self.t == 2
        return "And 4+4?", float(done), done, False, {"anchor": self.t}


def _policy(folders, family, replies, end_token):
    tok = _tok(folders, family)
    model = AutoModelForCausalLM.from_pretrained(folders[family])
    end = [tok.convert_tokens_to_ids(end_token)]
    return CausalLMPolicy(model, tok, engine=ScriptedEngine(tok, replies, end))


def test_gemma2_turns_end_with_one_end_of_turn_token(folders):
    """The sampled <end_of_turn> closes the turn; the template's closing text is not appended
    again. The episode's tokens are the template's render of its chat (system folded)."""
    policy = _policy(folders, "gemma2", ["It is 5.", "It is 8."], "<end_of_turn>")
    tok = policy.tokenizer
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        r = collect_episodes(
            policy, TwoQuestions, [0], 1, SamplingParams(max_new_tokens=32), max_turns=2
        )
    ids = r.actions.prompt_ids[0][r.actions.prompt_mask[0]].tolist()
    ids += r.actions.completion_ids[0][r.actions.completion_mask[0]].tolist()
    eot = tok.convert_tokens_to_ids("<end_of_turn>")
    assert all(a != eot or b != eot for a, b in zip(ids, ids[1:]))  # never doubled
    assert ids.count(eot) == 4  # user, model, user, model
    assert ["no system role" in w for w in _fallback_warnings(record)] == [True]
    chat = [
        {"role": "user", "content": f"{GSM8K_SYSTEM}\n\nWhat is 2+3?"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And 4+4?"},
        {"role": "assistant", "content": "It is 8."},
    ]
    want = tok.apply_chat_template(chat, tokenize=False)
    assert tok.decode(ids) == want.removesuffix("\n")  # the last turn ends at its sampled token


def test_gateway_extends_a_gemma2_turn_without_a_second_end_of_turn(folders):
    from grouprl.rollouts.gateway.record import Call, EpisodeLog, chat_prompt

    policy = _policy(folders, "gemma2", [], "<end_of_turn>")
    tok, log = policy.tokenizer, EpisodeLog("g")
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        p, segment = chat_prompt(tok, log, first, None, "hermes", policy.stop_ids)
    assert segment == 0 and tok.decode(p).startswith("<bos><start_of_turn>user\nBe brief.\n\n2+3?")
    assert len(_fallback_warnings(record)) == 1
    out = tok("5", add_special_tokens=False).input_ids + [107]
    message = {"role": "assistant", "content": "5"}
    log.calls.append(Call("chat", p, out, [0.0] * len(out), 0, "stop", 0, messages=first,
                          tools=None, message=message))  # fmt: skip
    history = [*first, message, {"role": "user", "content": "And 4+4?"}]
    ids, segment = chat_prompt(tok, log, history, None, "hermes", policy.stop_ids)
    assert segment == 0 and ids[: len(p) + len(out)] == p + out
    assert tok.decode(ids[len(p) + len(out) :]) == (
        "\n<start_of_turn>user\nAnd 4+4?<end_of_turn>\n<start_of_turn>model\n"
    )


# ---- tools and tool results on templates without them -----------------------------------------

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.mark.parametrize(
    ("family", "end_token", "result_turn"),
    [
        ("phi3", "<|end|>", "<|user|><tool_response>\n5\n</tool_response><|end|><|assistant|>"),
        (
            "gemma2",
            "<end_of_turn>",
            "\n<start_of_turn>user\n<tool_response>\n5\n</tool_response><end_of_turn>\n"
            "<start_of_turn>model\n",
        ),
    ],
)
def test_tools_listed_in_plain_text_and_results_sent_as_a_user_turn(
    folders, family, end_token, result_turn
):
    policy = _policy(folders, family, [CALL, "It is 5."], end_token)
    tok = policy.tokenizer
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        r = collect_episodes(
            policy, AnswerEnv, [0], 1, SamplingParams(max_new_tokens=64), max_turns=3,
            toolset=ToolSet([add]), tool_format="auto",
        )  # fmt: skip
    assert r.info["success"] == [True]
    prompt = tok.decode(r.actions.prompt_ids[0][r.actions.prompt_mask[0]].tolist())
    assert "You can use the following tools" in prompt and '{"name": "add"' in prompt
    completion = tok.decode(r.actions.completion_ids[0][r.actions.completion_mask[0]].tolist())
    assert result_turn in completion  # the result reaches the model, as a user turn
    eot = tok.convert_tokens_to_ids(end_token)
    ids = r.actions.completion_ids[0][r.actions.completion_mask[0]].tolist()
    assert all(a != eot or b != eot for a, b in zip(ids, ids[1:]))
    announced = _fallback_warnings(record)
    assert sum("does not render tools" in w for w in announced) == 1
    assert sum("no tool role" in w for w in announced) == 1


def test_disallowed_fallback_refuses_a_tool_turn_naming_the_option(folders):
    policy = _policy(folders, "phi3", [CALL, "It is 5."], "<|end|>")
    set_chat_fallback(policy.tokenizer, "error")
    with pytest.raises(ValueError, match=re.escape("set model.chat_fallback: announce")):
        collect_episodes(
            policy, AnswerEnv, [0], 1, SamplingParams(max_new_tokens=64), max_turns=3,
            toolset=ToolSet([add]),
        )  # fmt: skip


# ---- the families that render everything: nothing changes --------------------------------------


@pytest.mark.parametrize("family", ["qwen2.5", "llama3", "mistral"])
def test_full_templates_render_as_before_without_a_fallback(folders, family):
    tok = _tok(folders, family)
    set_chat_fallback(tok, "error")  # any fallback would raise
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    assert (
        encode_prompts(tok, [chat])[0]
        == tok(
            tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        ).input_ids
    )
    assert template_supports_tools(tok) and tools_system_prompt(ToolSet([add]), tok) == ""


def test_a_fresh_render_of_a_tool_conversation_on_gemma2(folders):
    """What the gateway renders when a program's history starts a new segment: the system text
    folded, the assistant's calls written in the call format, consecutive results in one user
    turn (Gemma's roles must alternate)."""
    from grouprl.rollouts.chat_probe import adapt_messages

    tok = _tok(folders, "gemma2")
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c1", "content": "6"},
    ]
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        adapted = adapt_messages(tok, chat, "hermes")
    assert len(_fallback_warnings(record)) == 3  # system, tool role, tool calls
    assert [m["role"] for m in adapted] == ["user", "assistant", "user"]
    one = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    assert tok.apply_chat_template(adapted, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief.\n\n2+3?<end_of_turn>\n<start_of_turn>model\n"
        f"{one}\n{one}<end_of_turn>\n<start_of_turn>user\n<tool_response>\n5\n</tool_response>\n"
        "<tool_response>\n6\n</tool_response><end_of_turn>\n<start_of_turn>model\n"
    )
    assert chat[2]["tool_calls"] and chat[0]["role"] == "system"  # the caller's list is untouched


def test_agent_tools_on_phi3_refused_before_the_run_directory(folders, tmp_path, capsys):
    rc = main(
        ["train", str(ROOT / "configs/agents/frozenlake_gigpo.yaml"),
         f"model.name_or_path={folders['phi3']}", f"run.output_dir={tmp_path / 'out'}",
         f"agent.tools=[{ROOT / 'tests/test_tools_bugs.py'}:add]", "model.chat_fallback=error",
         "train.steps=1", "run.console=false", "task.options.n_train=2", "task.options.n_eval=1"]
    )  # fmt: skip
    assert rc == 2
    err = capsys.readouterr().err
    assert "does not render tools" in err and "set model.chat_fallback: announce" in err
    assert not list((tmp_path / "out").rglob("config.yaml"))
