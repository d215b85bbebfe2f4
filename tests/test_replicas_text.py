"""Text replicas (grouprl/replicas/text.py): hub folder layout, real classes and tokenizer settings,
chat templates that render what the real families' templates render, generation, vLLM loading."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grouprl.replicas.text import TEXT_REPLICAS, build, main

CLASSES = {
    "qwen2.5": ("Qwen2ForCausalLM", "Qwen2Tokenizer"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen2Tokenizer"),
    "llama3": ("LlamaForCausalLM", "PreTrainedTokenizerFast"),
    "mistral": ("MistralForCausalLM", "LlamaTokenizer"),
    "gpt2": ("GPT2LMHeadModel", "GPT2Tokenizer"),
    "gemma2": ("Gemma2ForCausalLM", "GemmaTokenizer"),
    "phi3": ("Phi3ForCausalLM", "LlamaTokenizer"),
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen2Tokenizer"),
    "mixtral": ("MixtralForCausalLM", "LlamaTokenizer"),
}
FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json"}  # fmt: skip
VOCAB_FILES = {
    "qwen2.5",
    "qwen3",
    "qwen3-moe",
    "gpt2",
}  # the families whose hub folders ship vocab / merges
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CALL = {"id": "abcDEF123", "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}  # fmt: skip
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "abcDEF123", "name": "add", "content": "5"},
]
SCHEMA_LINE = (
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", '
    '"parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": '
    '"integer"}}, "required": ["a", "b"]}}}'
)
QWEN_TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    f"{SCHEMA_LINE}\n</tools>\n\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)
QWEN_TURNS = (
    "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
LLAMA_SCHEMA = json.dumps(TOOLS[0], indent=4)
# The strings the real templates render for CHAT with tools=TOOLS and the generation prompt.
RENDERED = {
    "qwen2.5": "<|im_start|>system\nBe brief.\n\n" + QWEN_TOOLS_SYSTEM + QWEN_TURNS,
    "qwen3": "<|im_start|>system\nBe brief.\n\n" + QWEN_TOOLS_SYSTEM + QWEN_TURNS,
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please "
        "respond with a JSON for a function call with its proper arguments that best answers "
        'the given prompt.\n\nRespond in the format {"name": function name, "parameters": '
        "dictionary of argument name and its value}.Do not use variables.\n\n"
        f"{LLAMA_SCHEMA}\n\nWhat is 2+3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
        '\n\n{"name": "add", "parameters": {"a": 2, "b": 3}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"5"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "mistral": (
        f"<s>[AVAILABLE_TOOLS] [{SCHEMA_LINE}][/AVAILABLE_TOOLS][INST] What is 2+3?[/INST]"
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 2, "b": 3}, "id": "abcDEF123"}]</s>'
        '[TOOL_RESULTS] {"content": 5, "call_id": "abcDEF123"}[/TOOL_RESULTS]'
    ),
}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("text_replicas")
    return {family: build(family, root / family) for family in TEXT_REPLICAS}


def test_registry_unknown_family_and_command_line(tmp_path, capsys):
    assert set(TEXT_REPLICAS) == set(CLASSES) | {"qwen2.5-rm"}  # the RM: its own test below
    with pytest.raises(ValueError, match="allowed are qwen2.5, qwen3"):
        build("qwen9", tmp_path)
    assert main(["gpt2", str(tmp_path / "g")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "g")
    assert (tmp_path / "g" / "model.safetensors").is_file()


@pytest.mark.parametrize("family", list(CLASSES))
def test_hub_layout_classes_and_generation(replicas, family):
    path = replicas[family]
    names = {p.name for p in path.iterdir()}
    want = FILES | ({"vocab.json", "merges.txt"} if family in VOCAB_FILES else set())
    assert names == want  # exactly the hub layout: no chat_template.jinja beside the config
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    model_cls, tok_cls = CLASSES[family]
    assert tok_cfg["tokenizer_class"] == tok_cls
    assert ("chat_template" in tok_cfg) == (family != "gpt2")
    assert AutoConfig.from_pretrained(path).architectures == [model_cls]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == model_cls
    with safe_open(str(path / "model.safetensors"), "pt") as f:  # stored in the family's dtype
        dtype = f.get_tensor(next(iter(f.keys()))).dtype
    assert dtype == (torch.float32 if family == "gpt2" else torch.bfloat16)
    assert model.get_input_embeddings().weight.shape[0] >= len(tok)
    text = "Tom has 3 boxes of 12 apples. ÄÖ 中 ✓\n\n  x"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text  # byte-level: lossless
    ids = tok("The answer is", return_tensors="pt")
    torch.manual_seed(0)
    out = model.generate(**ids, max_new_tokens=5, do_sample=True, pad_token_id=tok.eos_token_id)
    n = ids.input_ids.shape[1]
    assert out.shape[0] == 1 and n < out.shape[1] <= n + 5  # stops at 5 tokens or at EOS


def test_reward_model_replica_layout_and_head(replicas):
    from transformers import AutoModelForSequenceClassification

    path = replicas["qwen2.5-rm"]
    assert {p.name for p in path.iterdir()} == FILES | {"vocab.json", "merges.txt"}
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.architectures == ["Qwen2ForSequenceClassification"] and cfg.num_labels == 1
    tok = AutoTokenizer.from_pretrained(path)
    assert cfg.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    policy = json.loads((replicas["qwen2.5"] / "tokenizer_config.json").read_text())
    assert template == policy["chat_template"]
    model = AutoModelForSequenceClassification.from_pretrained(path)
    assert type(model).__name__ == "Qwen2ForSequenceClassification"
    assert model.score.weight.shape == (1, cfg.hidden_size)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("score.weight").dtype == torch.bfloat16


def test_special_tokens_after_the_vocabulary(replicas):
    qwen = AutoTokenizer.from_pretrained(replicas["qwen2.5"])
    base = json.loads((replicas["qwen2.5"] / "vocab.json").read_text())
    ids = [qwen.convert_tokens_to_ids(t) for t in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]]
    assert ids == [len(base), len(base) + 1, len(base) + 2]  # as 151643, 151644, 151645
    assert qwen.convert_tokens_to_ids("<tool_call>") == len(base) + 14  # as 151657
    assert (qwen.eos_token, qwen.pad_token, qwen.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    q3 = AutoTokenizer.from_pretrained(replicas["qwen3"])
    assert q3.convert_tokens_to_ids("<think>") == len(base) + 24  # as 151667
    gen = json.loads((replicas["qwen2.5"] / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids[2], ids[0]] and gen["top_k"] == 20
    llama = AutoTokenizer.from_pretrained(replicas["llama3"])
    bot = llama.convert_tokens_to_ids("<|begin_of_text|>")
    assert [llama.convert_tokens_to_ids(t) - bot for t in ["<|eot_id|>", "<|eom_id|>"]] == [9, 8]
    assert len(llama) == bot + 256  # the 256 reserved special ids close the vocabulary
    assert llama("hi").input_ids[0] == bot  # the BOS post-processor
    mistral = AutoTokenizer.from_pretrained(replicas["mistral"])
    named = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"]
    assert [mistral.convert_tokens_to_ids(t) for t in named] == list(range(7))
    assert mistral.convert_tokens_to_ids("<0x00>") == 771  # byte fallback after the controls
    assert mistral("hi").input_ids[0] == 1
    gpt2 = AutoTokenizer.from_pretrained(replicas["gpt2"])
    assert gpt2.convert_tokens_to_ids("<|endoftext|>") == len(gpt2) - 1  # as 50256


def test_gpt2_keeps_its_dropout(replicas):
    cfg = AutoConfig.from_pretrained(replicas["gpt2"])
    assert (cfg.resid_pdrop, cfg.embd_pdrop, cfg.attn_pdrop) == (0.1, 0.1, 0.1)
    model = AutoModelForCausalLM.from_pretrained(replicas["gpt2"]).train()
    x = torch.tensor([[5, 6, 7, 8]])
    assert not torch.equal(model(x).logits, model(x).logits)  # dropout on in train mode
    model.eval()
    assert torch.equal(model(x).logits, model(x).logits)


@pytest.mark.parametrize("family", list(RENDERED))
def test_templates_render_the_documented_tool_conversation(replicas, family):
    tok = AutoTokenizer.from_pretrained(replicas[family])
    got = tok.apply_chat_template(
        CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=True, date_string="26 Jul 2024"
    )
    assert got == RENDERED[family]


def test_template_branches_without_tools(replicas):
    q25, q3, llama, mistral = (
        AutoTokenizer.from_pretrained(replicas[f])
        for f in ("qwen2.5", "qwen3", "llama3", "mistral")
    )
    user = [{"role": "user", "content": "Hi"}]
    assert q25.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )  # Qwen2.5's default system message
    assert q3.apply_chat_template(user, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert llama.apply_chat_template(
        user, tokenize=False, add_generation_prompt=True, date_string="26 Jul 2024"
    ) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: "
        "December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user"
        "<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    sys_user = [{"role": "system", "content": "Be brief."}, *user]
    assert (
        mistral.apply_chat_template(sys_user, tokenize=False) == "<s>[INST] Be brief.\n\nHi[/INST]"
    )
    chat = [*user, {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert mistral.apply_chat_template(
        [{"role": "system", "content": "S"}, *chat], tokenize=False
    ) == (
        "<s>[INST] Hi[/INST] Hello</s>[INST] S\n\nBye[/INST]"
    )  # the system message moves to the last user message, as Mistral v0.3's template does
    with pytest.raises(Exception, match="alternate"):
        mistral.apply_chat_template([*user, *user], tokenize=False)


def test_qwen3_thinking(replicas):
    tok = AutoTokenizer.from_pretrained(replicas["qwen3"])
    user = [{"role": "user", "content": "Hi"}]
    off = tok.apply_chat_template(
        user, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    on = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert on.endswith("<|im_start|>assistant\n")
    chat = [
        {"role": "user", "content": "A"},
        {"role": "assistant", "content": "<think>\nold thought\n</think>\n\nold answer"},
        {"role": "user", "content": "B"},
        {"role": "assistant", "content": "<think>new thought</think>new answer"},
    ]
    got = tok.apply_chat_template(chat, tokenize=False)
    assert "old thought" not in got and "<|im_start|>assistant\nold answer<|im_end|>" in got
    assert "<|im_start|>assistant\n<think>\nnew thought\n</think>\n\nnew answer<|im_end|>" in got
    assert tok.convert_tokens_to_ids("</think>") in tok(got).input_ids  # one token, as in Qwen3


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_loads_the_qwen25_replica(replicas):
    from vllm import LLM
    from vllm import SamplingParams as VSampling

    path = replicas["qwen2.5"]
    llm = LLM(
        model=str(path), dtype="bfloat16", seed=0, gpu_memory_utilization=0.1,
        max_model_len=1024, enforce_eager=True,
    )  # fmt: skip
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], tools=TOOLS, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    ids = tok(prompt, add_special_tokens=False).input_ids
    out = llm.generate(
        [{"prompt_token_ids": ids}], VSampling(max_tokens=8, temperature=1.0, logprobs=0)
    )[0].outputs[0]
    assert 1 <= len(out.token_ids) <= 8
    # vLLM scores the sampled tokens as transformers does (same weights, same tokenizer)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full = torch.tensor([ids + list(out.token_ids)])
    logp = torch.log_softmax(model(full).logits[0, len(ids) - 1 : -1].float(), -1)
    ours = logp.gather(-1, torch.tensor(out.token_ids)[:, None]).squeeze(-1)
    theirs = torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])
    assert torch.allclose(ours, theirs, atol=0.05)  # bf16 engine vs fp32 reference
