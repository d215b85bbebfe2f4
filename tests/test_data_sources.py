"""Data as TRL users have it (issue 14 item 7, issue 15): conversational prompt columns through the
chat template, Dataset / DatasetDict objects, CSV files and save_to_disk folders as sources, a
prompt-only task, and data errors that name the file and the row."""

import json

import pytest
from datasets import Dataset, DatasetDict

from grouprl.config.loading import apply_overrides, validate
from grouprl.envs.tasks import build_task
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.engines.base import SamplingParams
from grouprl.rollouts.single_turn import collect
from grouprl.train import train

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
ROWS = [
    {"question": "What is 1+1?", "answer": "2"},
    {"question": "What is 2+2?", "answer": "4"},
    {"question": "What is 3+3?", "answer": "6"},
]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---------------------------------------------------------------- conversational prompts


def test_conversational_question_column_stays_messages(tmp_path):
    # old: the list of messages became its Python repr, fed as plain text
    path = _jsonl(tmp_path / "chat.jsonl", [{"question": CHAT, "answer": "5"}])
    task = build_task("math", source=str(path))
    assert task.train[0]["prompt"] == CHAT
    # the template fills the last user message; a system prompt is not added twice
    task = build_task(
        "math", source=str(path), prompt_template="{question} Answer with a number.",
        system_prompt="ignored: the conversation has one",
    )  # fmt: skip
    assert task.train[0]["prompt"] == [
        CHAT[0],
        {"role": "user", "content": "What is 2+3? Answer with a number."},
    ]


def test_conversational_prompts_go_through_the_chat_template(tmp_path, tiny_model_dir):
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    path = _jsonl(tmp_path / "chat.jsonl", [{"question": CHAT, "answer": "5"}])
    prompt = build_task("math", source=str(path)).train[0]["prompt"]
    rendered = policy.tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=False
    )
    ids = policy.encode_prompts([prompt])[0]
    assert policy.tokenizer.decode(ids) == rendered
    assert "{'role'" not in policy.tokenizer.decode(ids)


def test_reward_sees_message_completions_for_conversational_prompts(tmp_path, tiny_model_dir):
    policy = CausalLMPolicy.from_pretrained(str(tiny_model_dir))
    seen = {}

    def judge(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions)
        return [0.0] * len(completions)

    examples = [{"prompt": CHAT}, {"prompt": "plain text"}]
    collect(policy, examples, 2, SamplingParams(max_new_tokens=3), {"judge": judge})
    assert seen["prompts"][:2] == [CHAT, CHAT]
    first, plain = seen["completions"][0], seen["completions"][2]
    assert isinstance(first, list) and first[0]["role"] == "assistant"
    assert isinstance(first[0]["content"], str) and isinstance(plain, str)


# ---------------------------------------------------------------- sources


def test_dataset_objects_csv_and_save_to_disk(tmp_path):
    expect = [r["question"] for r in ROWS]
    ds = Dataset.from_list(ROWS)
    assert [e["prompt"] for e in build_task("math", source=ds).train] == expect
    dd = DatasetDict({"train": ds, "test": Dataset.from_list(ROWS[:1])})
    task = build_task("math", source=dd, eval_split="test")
    assert len(task.train) == 3 and [e["answer"] for e in task.eval] == ["2"]
    dd.save_to_disk(str(tmp_path / "saved"))
    task = build_task("math", source=str(tmp_path / "saved"), split="test")
    assert [e["prompt"] for e in task.train] == expect[:1]
    ds.save_to_disk(str(tmp_path / "one"))
    assert len(build_task("math", source=str(tmp_path / "one")).train) == 3
    csv = tmp_path / "rows.csv"
    csv.write_text('question,answer\n"What is 1+1?",2\n"Say ""hi"", then 2+2?",4\n')
    task = build_task("math", source=str(csv))
    assert [e["prompt"] for e in task.train] == ["What is 1+1?", 'Say "hi", then 2+2?']
    assert [e["answer"] for e in task.train] == ["2", "4"]
    # the code task reads the same sources; a conversational Dataset column works there too
    code = Dataset.from_list([{"question": [{"role": "user", "content": "Write add(a, b)."}],
                               "tests": ["assert add(1, 2) == 3"]}])  # fmt: skip
    prompt = build_task("code", source=code, prompt_template="{question}").train[0]["prompt"]
    assert prompt == [{"role": "user", "content": "Write add(a, b)."}]


def test_prompt_only_task(tmp_path):
    joke = [{"role": "user", "content": "Tell a joke."}]
    rows = [{"prompt": CHAT, "topic": "math"}, {"prompt": joke, "topic": "fun"}]
    task = build_task("prompts", source=Dataset.from_list(rows), system_prompt="Be kind.")
    assert [e["prompt"] for e in task.train] == [CHAT, [{"role": "system", "content": "Be kind."},
                                                        *joke]]  # fmt: skip
    assert task.train[1]["topic"] == "fun" and task.reward_fns == {}
    plain = build_task("prompts", source=Dataset.from_list([{"prompt": "Tell a joke."}]))
    assert plain.train[0]["prompt"] == "Tell a joke."


def test_prompt_only_task_trains_with_a_user_reward(tmp_path, tiny_model_dir):
    data = _jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": f"Hi {i}"}]}
                                         for i in range(4)])  # fmt: skip
    reward = tmp_path / "judge.py"
    reward.write_text(
        "def judge(prompts, completions, **kwargs):\n"
        "    return [float(len(c[0]['content']) % 2) for c in completions]\n"
    )
    raw = {
        "run": {"name": "p", "output_dir": str(tmp_path), "device": "cpu", "console": False},
        "model": {"name_or_path": str(tiny_model_dir)},
        "task": {"name": "prompts", "options": {"source": str(data)}},
        "rewards": [{"name": f"{reward}:judge"}],
        "rollout": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 4},
        "train": {"steps": 1},
    }  # fmt: skip
    train(validate(apply_overrides(raw, [])))
    raw.pop("rewards")
    with pytest.raises(ValueError, match="task 'prompts' has no reward of its own"):
        train(validate(apply_overrides(raw, ["run.name=q"])))


# ---------------------------------------------------------------- errors name file and row


def test_data_errors_name_the_file_and_the_row(tmp_path):
    bad_utf8 = tmp_path / "bad.jsonl"
    bad_utf8.write_bytes(
        b'{"question": "ok", "answer": "1"}\n{"question": "\xff", "answer": "2"}\n'
    )
    with pytest.raises(ValueError, match=rf"{bad_utf8}: line 2 is not valid UTF-8"):
        build_task("math", source=str(bad_utf8))
    bad_json = tmp_path / "bad.json"
    bad_json.write_bytes(b'[{"question": "ok", "answer": "1"},\n {"question": "\xfe"}]')
    with pytest.raises(ValueError, match=rf"{bad_json}: line 2 is not valid UTF-8"):
        build_task("math", source=str(bad_json))
    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"question": "ok", "answer": "1"}\n{"question": \n')
    with pytest.raises(ValueError, match=rf"{malformed}: line 2 is not valid JSON"):
        build_task("math", source=str(malformed))
    csv = tmp_path / "short.csv"
    csv.write_text("question,answer\nok,1\nonly one field\n")
    with pytest.raises(ValueError, match=rf"{csv}: line 3 does not have the header's 2 fields"):
        build_task("math", source=str(csv))
    missing = _jsonl(tmp_path / "missing.jsonl", [{"q": "x", "answer": "1"}])
    with pytest.raises(ValueError, match=rf"column 'question' is not in '{missing}'"):
        build_task("math", source=str(missing))
    huge = _jsonl(tmp_path / "huge.jsonl", [ROWS[0], {"question": "x" * 10_000_000, "answer": "1"}])
    with pytest.raises(ValueError, match=rf"row 1 of '{huge}', column 'question': the prompt has"):
        build_task("math", source=str(huge))
    not_chat = _jsonl(tmp_path / "notchat.jsonl", [{"prompt": [1, 2]}])
    with pytest.raises(ValueError, match=rf"row 0 of '{not_chat}', column 'prompt': expected a"):
        build_task("prompts", source=str(not_chat))


def test_a_dataset_object_in_the_config_trains_and_is_recorded(tmp_path, tiny_model_dir):
    ds = Dataset.from_list(ROWS)
    raw = {
        "run": {"name": "ds", "output_dir": str(tmp_path), "device": "cpu", "console": False},
        "model": {"name_or_path": str(tiny_model_dir)},
        "task": {"name": "math", "options": {"source": ds}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "train": {"steps": 1},
    }  # fmt: skip
    cfg = validate(raw)
    train(cfg)
    record = (cfg.run_dir / "config.yaml").read_text()
    assert (
        "python_object: datasets.Dataset" in record and f"fingerprint: {ds._fingerprint}" in record
    )
