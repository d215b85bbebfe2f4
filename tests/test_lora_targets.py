"""LoRA targets read from the module tree (policies/lora_targets.py): peft's all-linear by
default (fused projections covered, the output head left out), MoE expert stacks through peft's
parameter targeting, the language model only in a VLM; explicit lists checked entry by entry;
MoE replicas train, checkpoint, reload in transformers / peft and resume."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from grouprl.config.loading import apply_overrides, validate
from grouprl.policies.text.causal_lm import CausalLMPolicy
from grouprl.policies.text.tiny import char_tokenizer
from grouprl.replicas.text import build
from grouprl.runtime.checkpoint import CheckpointManager
from grouprl.train import train
from grouprl.types import TokenBatch

TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def _model(kind: str):
    """A tiny random model of each layout that matters: separate q/k/v and gate/up (Qwen2,
    Llama), fused qkv_proj / gate_up_proj (Phi-3), stacked 3-D experts (Qwen3-MoE, Mixtral)."""
    import transformers as tf

    torch.manual_seed(0)
    vocab = len(char_tokenizer())
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(vocab_size=vocab, intermediate_size=64, **TINY))
    if kind == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=vocab, intermediate_size=64, **TINY))
    if kind == "phi3":
        cfg = tf.Phi3Config(vocab_size=vocab, intermediate_size=64, pad_token_id=0, **TINY)
        return tf.Phi3ForCausalLM(cfg)
    if kind == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            vocab_size=vocab, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
            num_experts_per_tok=2, head_dim=16, **TINY,
        )  # fmt: skip
        return tf.Qwen3MoeForCausalLM(cfg)
    cfg = tf.MixtralConfig(
        vocab_size=vocab, intermediate_size=16, num_local_experts=4, head_dim=16, **TINY
    )
    return tf.MixtralForCausalLM(cfg)


def _trainable_leaves(policy) -> set[str]:
    """Leaf names of the weights that got an adapter ("q_proj", "gate_up_proj", ...)."""
    out = set()
    for name, p in policy.model.named_parameters():
        if p.requires_grad and ".lora_A." in name:
            path = [s for s in name.split(".lora_A.")[0].split(".") if s != "base_layer"]
            out.add(path[-1])
    return out


# leaf names the default must adapt in each layout (attention and MLP, fused ones included)
WANT = {
    "qwen2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "qwen3_moe": {"q_proj", "k_proj", "v_proj", "o_proj", "experts"},
    "mixtral": {"q_proj", "k_proj", "v_proj", "o_proj", "experts"},
}


@pytest.mark.parametrize("kind", list(WANT))
def test_default_targets_cover_attention_and_mlp_never_the_head(kind):
    policy = CausalLMPolicy(_model(kind), char_tokenizer(), lora={"r": 2, "alpha": 4})
    leaves = _trainable_leaves(policy)
    # a ParamWrapper's adapter sits on the experts module (one per targeted parameter)
    assert leaves == WANT[kind]
    assert all("lm_head" not in n for n, p in policy.model.named_parameters() if p.requires_grad)
    targets = policy.lora_targets
    assert all(not n.endswith("lm_head") for n in targets.modules)
    if kind in ("qwen3_moe", "mixtral"):
        # both expert stacks of every layer, by parameter; the router (a custom module with a
        # 2-D weight) stays frozen
        assert targets.summary()["parameters"] == {
            "model.layers.*.mlp.experts.down_proj": 2,
            "model.layers.*.mlp.experts.gate_up_proj": 2,
        }
        assert not any(".gate." in n or n.endswith(".gate") for n in targets.modules)
    else:
        assert targets.parameters == ()


def test_unmatched_names_fail_with_the_listing_and_lists_keep_working():
    with pytest.raises(ValueError, match=r"\['q_proj'\] match no linear layer.*qkv_proj"):
        CausalLMPolicy(_model("phi3"), char_tokenizer(), lora={"target_modules": ["q_proj"]})
    # on an MoE model the listing points at the expert parameters and the option to use
    with pytest.raises(ValueError, match=r"gate_proj.*down_proj, gate_up_proj.*target_parameters"):
        CausalLMPolicy(
            _model("qwen3_moe"), char_tokenizer(), lora={"target_modules": ["gate_proj"]}
        )
    with pytest.raises(ValueError, match=r"target_parameters \['nothing'\] match no"):
        CausalLMPolicy(_model("mixtral"), char_tokenizer(), lora={"target_parameters": ["nothing"]})
    policy = CausalLMPolicy(
        _model("phi3"), char_tokenizer(),
        lora={"r": 2, "target_modules": ["qkv_proj", "lm_head"], "target_parameters": "none"},
    )  # fmt: skip
    assert _trainable_leaves(policy) == {"qkv_proj", "lm_head"}  # the head when asked by name
    routed = CausalLMPolicy(
        _model("mixtral"), char_tokenizer(),
        lora={"r": 2, "target_modules": ["o_proj"], "target_parameters": ["mlp.gate.weight"]},
    )  # fmt: skip
    assert routed.lora_targets.summary()["parameters"] == {"model.layers.*.mlp.gate.weight": 2}


def test_expert_lora_refuses_dropout_before_any_step():
    with pytest.raises(ValueError, match=r"lora.dropout=0.1.*set lora.dropout: 0 or lora.target_"):
        CausalLMPolicy(_model("qwen3_moe"), char_tokenizer(), lora={"dropout": 0.1})
    dense = CausalLMPolicy(_model("qwen2"), char_tokenizer(), lora={"r": 2, "dropout": 0.1})
    assert dense.lora_targets.parameters == ()  # no expert stack: dropout is fine
    off = CausalLMPolicy(
        _model("mixtral"), char_tokenizer(), lora={"dropout": 0.1, "target_parameters": "none"}
    )
    assert off.lora_targets.parameters == () and "experts" not in _trainable_leaves(off)


def test_config_fields_typed_and_described():
    from grouprl.config.model import LoRAConfig

    assert LoRAConfig().target_modules == "all-linear"
    assert LoRAConfig().target_parameters == "experts"
    assert LoRAConfig(target_modules=["q_proj"], target_parameters="none").target_parameters
    with pytest.raises(ValueError):
        LoRAConfig(target_parameters="all")
    for name in ("target_modules", "target_parameters"):
        assert "peft" in LoRAConfig.model_fields[name].description


def test_vlm_targets_stay_in_the_language_model(tmp_path):
    from grouprl.policies.vision.policy import VisionLMPolicy
    from grouprl.replicas.vision import build_llava

    folder = build_llava(tmp_path / "llava")  # a CLIP tower with its own q_proj / v_proj / fc1
    policy = VisionLMPolicy.from_pretrained(str(folder), lora={"r": 2, "alpha": 4})
    adapted = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert adapted and all(".language_model." in n for n in adapted)
    assert _trainable_leaves(policy) == WANT["llama"]  # attention and MLP of the decoder
    assert all(".language_model." in n for n in policy.lora_targets.modules)
    with pytest.raises(ValueError, match=r"\['fc1'\] match no linear layer"):  # tower only
        VisionLMPolicy.from_pretrained(str(folder), lora={"target_modules": ["fc1"]})


# ---- MoE replicas: one step, a checkpoint, reload and resume -------------------------------


CONTRAST = '''
def contrast(completions, **_):
    """1 for the second sample of each group of 2, else 0: every group has signal."""
    return [float(j % 2) for j in range(len(completions))]
'''


def _cfg(out_dir, model_dir, *overrides):
    rewards = out_dir / "rewards.py"
    rewards.write_text(CONTRAST)
    raw = {
        "workload": {"type": "text"},
        "run": {"name": "run", "output_dir": str(out_dir), "seed": 0, "device": "cpu",
                "console": False},
        "model": {"name_or_path": str(model_dir), "lora": {"r": 4, "alpha": 8}},
        "task": {"name": "arithmetic",
                 "options": {"n_train": 8, "n_eval": 0, "ops": "+", "max_value": 9}},
        "rewards": [{"name": f"{rewards}:contrast"}],
        "rollout": {"prompts_per_step": 1, "group_size": 2, "max_new_tokens": 3},
        "train": {"steps": 1, "lr": 1e-2},
        "eval": {"every": 0},
        "checkpoint": {"every": 1},
    }  # fmt: skip
    return validate(apply_overrides(raw, list(overrides)))


def _rows(tok) -> TokenBatch:
    prompts = [tok("What is 2+3?").input_ids, tok("Count to four:").input_ids]
    completions = [tok(" 5, then 6").input_ids, tok(" one two three four").input_ids]
    P, T = max(map(len, prompts)), max(map(len, completions))
    pid, pm = torch.zeros(2, P, dtype=torch.long), torch.zeros(2, P, dtype=torch.bool)
    cid, cm = torch.zeros(2, T, dtype=torch.long), torch.zeros(2, T, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        pid[i, P - len(p) :], pm[i, P - len(p) :] = torch.tensor(p), True
        cid[i, : len(c)], cm[i, : len(c)] = torch.tensor(c), True
    return TokenBatch(pid, pm, cid, cm, torch.zeros(2, dtype=torch.bool))


def _train_save_reload(tmp_path, family: str) -> tuple:
    """One LoRA step (default targets) of the replica `family` with a checkpoint; checks the
    checkpoint's adapters trained (every lora_B moved) and that its merged folder (transformers)
    and its adapter folder (peft, onto the replica) score as the trained policy.
    Returns (replica folder, run directory, checkpoint, its lora_targets.json)."""
    from peft import PeftModel

    replica = build(family, tmp_path / family)
    train(_cfg(tmp_path, replica))
    run = tmp_path / "run"
    ckpt = CheckpointManager(run).latest()
    assert ckpt is not None
    saved = json.loads((ckpt / "model" / "lora_targets.json").read_text())
    assert saved == json.loads((run / "lora_targets.json").read_text())

    # the trained policy as the checkpoint holds it: the replica plus the saved adapters
    trained = CausalLMPolicy.from_pretrained(str(replica), lora={"r": 4, "alpha": 8})
    adapter = CheckpointManager.load(ckpt)["adapter"]
    moved = [v for k, v in adapter.items() if "lora_B" in k]
    assert moved and all(v.abs().max() > 0 for v in moved)  # every adapter trained
    trained.load_state_dict(adapter)
    batch = _rows(trained.tokenizer)
    want = trained.log_probs(batch).logp.detach()  # [2, T]
    base = CausalLMPolicy.from_pretrained(str(replica)).log_probs(batch).logp.detach()
    assert (want - base).abs().max() > 1e-4  # the update is visible in the scores

    # merged folder: a plain transformers model under the hub's names
    merged = CausalLMPolicy(AutoModelForCausalLM.from_pretrained(ckpt / "model"), trained.tokenizer)
    torch.testing.assert_close(merged.log_probs(batch).logp, want, atol=2e-5, rtol=0)
    # peft adapter folder onto the replica
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(replica, dtype=torch.float32), ckpt / "model/adapter"
    )
    on_peft = CausalLMPolicy(peft_model, trained.tokenizer)
    torch.testing.assert_close(on_peft.log_probs(batch).logp, want, atol=2e-5, rtol=0)
    return replica, run, ckpt, saved


@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_moe_lora_trains_saves_reloads_and_resumes(tmp_path, family, capsys):
    replica, run, ckpt, saved = _train_save_reload(tmp_path, family)  # the first save crashed
    said = capsys.readouterr().out
    assert said.count("LoRA targets: modules model.layers.*.self_attn.k_proj x2") == 1  # once
    assert "parameters model.layers.*.mlp.experts.down_proj x2" in said
    assert saved["parameters"] == {
        "model.layers.*.mlp.experts.down_proj": 2,
        "model.layers.*.mlp.experts.gate_up_proj": 2,
    }
    assert saved["modules"]["model.layers.*.self_attn.q_proj"] == 2
    adapter = CheckpointManager.load(ckpt)["adapter"]
    assert any("experts" in k and "lora_B" in k for k in adapter)  # the experts' adapters

    # resume: the run goes on from the checkpoint to step 2 and saves again
    train(_cfg(tmp_path, replica, "train.steps=2", "run.resume=true"))
    assert CheckpointManager.load(CheckpointManager(run).latest())["step"] == 2


def test_phi3_lora_on_its_fused_projections_trains_saves_and_reloads(tmp_path):
    """The phi3 replica (fused qkv_proj / gate_up_proj, untied head, bfloat16 on disk): the
    default targets are its four projections per layer, never lm_head, and the trained adapters
    reload in transformers (merged) and peft (adapter) to the same scores."""
    _, _, ckpt, saved = _train_save_reload(tmp_path, "phi3")
    layer = "model.layers.*."
    assert saved["modules"] == {
        f"{layer}self_attn.qkv_proj": 2, f"{layer}self_attn.o_proj": 2,
        f"{layer}mlp.gate_up_proj": 2, f"{layer}mlp.down_proj": 2,
    }  # fmt: skip
    assert saved["parameters"] == {}  # no expert stacks
    adapter = CheckpointManager.load(ckpt)["adapter"]
    assert not any("lm_head" in k for k in adapter)


def test_flow_targets_checked_against_the_tree_and_saved(tmp_path):
    from grouprl.policies.flow.policy import FlowPolicy
    from grouprl.policies.flow.tiny import tiny_sd3_transformer

    with pytest.raises(ValueError, match=r"\['to_qq'\] match no linear layer.*to_q"):
        FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8),
                   lora={"target_modules": ["to_qq"]})  # fmt: skip
    with pytest.raises(ValueError, match="target_parameters.*flow / unet LoRA adapts modules"):
        FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8),
                   lora={"target_parameters": ["proj_out.weight"]})  # fmt: skip
    with pytest.warns(UserWarning, match=r"\['to_qq'\] match no linear layer"):  # the rest do
        pol = FlowPolicy(tiny_sd3_transformer(), latent_shape=(4, 8, 8),
                         lora={"r": 2, "alpha": 4, "target_modules": ["to_q", "to_qq"]})  # fmt: skip
    adapted = {n for n, m in pol.model.named_modules() if hasattr(m, "lora_A")}
    assert set(pol.lora_targets.modules) == adapted and adapted
    assert all(n.endswith(".to_q") for n in adapted)
    pol.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "lora_targets.json").read_text()) == pol.lora_targets.summary()


def test_peft_name_conversion_is_refused_by_name_before_any_step():
    """peft 0.21 rewrites a DeepSeek-V3 dense layer's gate_proj / up_proj / down_proj (real
    nn.Linear) into expert-stack targets (its v4 -> v5 MoE map): grouprl names what would go
    unadapted instead of training another set; a list without those layers works."""
    import transformers as tf

    cfg = tf.DeepseekV3Config(
        vocab_size=len(char_tokenizer()), hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"not adapted \['model.layers.0.mlp.down_proj'.*lora.t"):
        CausalLMPolicy(tf.DeepseekV3ForCausalLM(cfg), char_tokenizer(), lora={"r": 2})
    attention = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
    policy = CausalLMPolicy(
        tf.DeepseekV3ForCausalLM(cfg), char_tokenizer(), lora={"r": 2, "target_modules": attention}
    )
    assert _trainable_leaves(policy) == set(attention) | {"experts"}


FLOW_GRPO_NAMES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                   "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")  # fmt: skip


@pytest.mark.parametrize("name", ["sd3.5-medium", "wan2.1-t2v", "sana-1.6b"])
def test_attention_targets_follow_the_denoisers_classes(tmp_path, name):
    """target_modules "attention" (the flow presets') adapts every linear layer inside a
    diffusers attention module, whatever the family calls its blocks: Flow-GRPO's SD3 names
    ("attn.to_q", ...) match nothing in Wan's or SANA's attn1 / attn2, the classes do."""
    import diffusers
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention

    from grouprl.policies.flow.policy import FlowPolicy
    from grouprl.policies.lora_targets import resolve_targets
    from grouprl.policies.text.lora import LoRASettings
    from grouprl.replicas import build_replica

    folder = build_replica(name, tmp_path / name)
    index = json.loads((folder / "model_index.json").read_text())
    net = getattr(diffusers, index["transformer"][1]).from_pretrained(folder / "transformer")
    found = resolve_targets(net, LoRASettings(target_modules="attention"), every_entry=False)
    owners = [n for n, m in net.named_modules() if isinstance(m, AttentionModuleMixin | Attention)]
    linears = {n for n, m in net.named_modules() if isinstance(m, torch.nn.Linear)}
    want = {n for n in linears if any(n.startswith(o + ".") for o in owners)}
    assert set(found.modules) == want and want
    by_name = {n for n in linears if any(n == e or n.endswith("." + e) for e in FLOW_GRPO_NAMES)}
    if name == "sd3.5-medium":  # the names' set, plus the dual-attention blocks' attn2
        assert by_name < want and all(".attn2." in n for n in want - by_name)
    else:
        assert not by_name  # the old fixed list adapted nothing here
    shape = (net.config.in_channels, 2, 8, 8) if name.startswith("wan") else (4, 8, 8)
    pol = FlowPolicy(net, latent_shape=shape, lora={"r": 2, "alpha": 4,
                                                    "target_modules": "attention"})  # fmt: skip
    adapted = {n for n, m in pol.model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == want


def test_attention_targets_refused_on_a_model_without_diffusers_attention():
    from grouprl.policies.lora_targets import resolve_targets
    from grouprl.policies.text.lora import LoRASettings

    with pytest.raises(ValueError, match="'attention' selects the linear layers of diffusers"):
        resolve_targets(_model("qwen2"), LoRASettings(target_modules="attention"))
