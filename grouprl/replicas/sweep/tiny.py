"""A tiny random-weight config for any architecture transformers registers, by reading its fields.

`tiny_config(model_type)` takes the config class's defaults (`AutoConfig.for_model`), walks its
dict (sub-configs such as text_config / vision_config included, at any depth) and shrinks each
field by its role, read from the field's name, never from the family:

  width      hidden_size, d_model, n_embd, embed_dim, projection / projector / out hidden sizes -> 128
  heads      any `*heads*` count -> 4; key / value head counts -> 2 (MHA stays MHA: a kv count
             equal to the head count follows it; multi-query stays 1)
  head dims  head_dim, kv_channels, d_kv, `*_head_dim` -> 32 (rotary parts -> 16)
  mlp        `*intermediate_size*`, `*ffn_dim*`, n_inner, d_ff, mlp_dim -> 256
  depth      num_hidden_layers and its aliases (n_layer, num_layers, depth, encoder / decoder
             layers): the shortest prefix of the per-layer lists (layer_types, mlp_layer_types,
             ...) that holds every kind of layer they list, at least 2, at most 8; the per-layer
             lists are cut to it; lists of layer indices keep the indices that still exist
  experts    expert counts -> 4, experts per token -> at most 2, expert groups -> 1, dense
             prefix (first_k_dense_replace) -> at most 1, so layer 2 of 2 is an MoE layer
  MLA        kv / q low-rank sizes -> 32
  vocab      vocab_size -> 1024; the special-token ids the config names (image / video / boi
             tokens ...) at or past 1024 are renumbered below it (small_ids), so every id the
             config uses stays in the table (`shrink` alone keeps vocab_size above them)
  windows    sliding_window, attention_chunk_size -> 8, so the sweep's 16-token rows cross them
  rope       an mrope section list is rescaled to sum to head_dim / 2

What this cannot derive is in EXCEPTIONS: model type -> (fields to set, reason), each a fact of
one config class that the generic rules above get wrong; keep it short and give the reason.
"""

from __future__ import annotations

import copy
from typing import Any

# head_dim 32: the smallest vLLM's CPU attention kernels take (the --vllm check loads these)
WIDTH, HEADS, KV_HEADS, HEAD_DIM, ROPE_DIM, MLP, EXPERTS, TOP_K = 128, 4, 2, 32, 16, 256, 4, 2
MIN_LAYERS, MAX_LAYERS, VOCAB, WINDOW, LOW_RANK, SSM_STATE = 2, 8, 1024, 8, 32, 16

WIDTH_FIELDS = {
    "hidden_size", "n_embd", "d_model", "embed_dim", "dim", "model_dim", "hidden_dim",
    "word_embed_proj_dim", "text_hidden_size", "out_hidden_size", "projection_dim",
    "projector_hidden_size", "encoder_hidden_size", "attention_hidden_size", "embedding_size",
    "vision_output_dim", "projector_input_dim", "projector_output_dim", "output_channels",
}  # fmt: skip
LAYER_FIELDS = {
    "num_hidden_layers", "n_layer", "num_layers", "n_layers", "depth", "encoder_layers",
    "decoder_layers", "num_decoder_layers", "conf_num_hidden_layers",
}  # fmt: skip
MLP_FIELDS = {"n_inner", "d_ff", "mlp_dim", "ffn_hidden_size", "intermediate_size_mlp"}
HEAD_DIM_FIELDS = {"head_dim", "kv_channels", "d_kv", "attention_head_dim", "d_head"}
EXPERT_FIELDS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
TOP_K_FIELDS = {"num_experts_per_tok", "moe_topk", "moe_k", "top_k", "num_selected_experts"}
GROUP_FIELDS = {"n_group", "topk_group"}
WINDOW_FIELDS = {"sliding_window", "attention_chunk_size"}
LOW_RANK_FIELDS = {"kv_lora_rank", "q_lora_rank"}
SSM_STATE_FIELDS = {"state_size", "mamba_d_state", "ssm_state_size"}
# the SSM's inner width is expand * hidden = heads * head_dim: with expand 1 the tiny widths agree
EXPAND_FIELDS = {"expand", "mamba_expand", "n_groups", "mamba_n_groups"}

# model type -> (fields merged into the shrunk config dict, why the rules cannot derive them)
_MROPE_WHY = (
    "its model code defaults mrope_section (absent from the config) to the full-size split of "
    "the rotary half; the tiny head needs a split of its own rotary half (the sum the code checks)"
)
EXCEPTIONS: dict[str, tuple[dict[str, Any], str]] = {
    **{t: ({"text_config": {"rope_parameters": {"mrope_section": [4, 6, 6]}}}, _MROPE_WHY)
       for t in ("qwen2_vl", "qwen2_5_vl", "qwen2_5_omni_thinker", "paddleocr_vl", "glm4v",
                 "glm46v", "glm_ocr", "glmga")},
    "glm4v_moe": ({"text_config": {"rope_parameters": {"mrope_section": [2, 3, 3]}}}, _MROPE_WHY),
}  # fmt: skip


def _merge(d: dict, fields: dict) -> dict:
    """d with `fields` merged in (nested dicts merged, other values replaced)."""
    out = dict(d)
    for k, v in fields.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else copy.deepcopy(v)
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def special_token_ids(d: dict) -> list[int]:
    """Every special-token id a config dict names (any depth)."""
    ids = []
    for k, v in d.items():
        if isinstance(v, dict):
            ids += special_token_ids(v)
        elif isinstance(k, str) and k.endswith(("token_id", "token_index", "token_ids")):
            ids += (
                [v] if _is_int(v) else [x for x in v if _is_int(x)] if isinstance(v, list) else []
            )
    return ids


def _depth(d: dict) -> tuple[int | None, int]:
    """(the config's layer count, the shrunk one): the shortest prefix of its per-layer lists that
    holds every kind of layer they list."""
    old = next((d[k] for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "depth")
                if _is_int(d.get(k))), None)  # fmt: skip
    if old is None:
        return None, MIN_LAYERS
    need = MIN_LAYERS
    for v in d.values():
        if isinstance(v, list) and len(v) == old and v and not all(_is_int(x) for x in v):
            kinds = [repr(x) for x in v]
            need = max(need, max(kinds.index(k) for k in set(kinds)) + 1)
    return old, min(max(need, MIN_LAYERS), MAX_LAYERS, old)


def _rescale(section: list[int], total: int) -> list[int]:
    """An mrope section (ints summing to head_dim / 2) rescaled to sum to `total`."""
    s = sum(section)
    out = [max(1, x * total // s) for x in section]
    out[-1] += total - sum(out)
    return out


def shrink(d: dict) -> dict:
    """A shrunk copy of one config dict (sub-config dicts recursively), by field roles."""
    d = copy.deepcopy(d)
    old_layers, layers = _depth(d)
    heads = d.get("num_attention_heads", d.get("n_head", d.get("num_heads")))
    rope_dim = d.get("qk_rope_head_dim")
    for k, v in list(d.items()):
        if not isinstance(k, str):  # id2label's keys
            continue
        if isinstance(v, dict) and v and old_layers and all(str(i).isdigit() for i in v):
            # per-layer overrides keyed by layer index: the layers that still exist
            d[k] = {i: shrink(x) if isinstance(x, dict) else x
                    for i, x in v.items() if int(i) < layers}  # fmt: skip
            continue
        if isinstance(v, dict):
            d[k] = shrink(v) if k not in ("rope_parameters", "rope_scaling") else v
            continue
        if v is None:
            # "derive it" defaults that the tiny sizes must set (None head_dim / kv heads / expert
            # counts mean: from the full-size fields, or not at all)
            if k in HEAD_DIM_FIELDS:
                d[k] = HEAD_DIM
            elif "heads" in k and ("key" in k or "kv" in k) and heads:
                d[k] = HEADS
            elif k in EXPERT_FIELDS:
                d[k] = EXPERTS
            elif k in TOP_K_FIELDS:
                d[k] = TOP_K
            continue
        if isinstance(v, list) and old_layers and len(v) == old_layers and v:
            d[k] = v[:layers]
            if k == "intermediate_size":
                d[k] = [MLP if _is_int(x) and x else x for x in d[k]]
            continue
        if (
            isinstance(v, list)
            and v
            and all(_is_int(x) for x in v)
            and old_layers
            and ("layer" in k or "index" in k or "idx" in k)
        ):
            kept = [x for x in v if x < layers]
            d[k] = kept or [layers - 1]
            continue
        if not _is_int(v) or v <= 0:
            continue
        if k in WIDTH_FIELDS:
            d[k] = WIDTH
        elif k in LAYER_FIELDS:
            d[k] = layers if v == old_layers else min(v, MIN_LAYERS)
        elif "heads" in k or k in ("n_head", "num_head"):
            if "key" in k or "kv" in k:
                d[k] = 1 if v == 1 else HEADS if v == heads else KV_HEADS
            else:
                d[k] = HEADS
        elif k == "multi_query_group_num":
            d[k] = KV_HEADS
        elif k in HEAD_DIM_FIELDS or k.endswith(("_head_dim", "_d_head")):
            # a head dim equal to the rotary part's (MLA: head_dim is the rope dim) stays equal
            rope = ("rope" in k or "nope" in k) or v == rope_dim
            d[k] = ROPE_DIM if rope else HEAD_DIM
        elif k == "rotary_dim":  # the rotated part of each head, at most the head dim
            d[k] = min(v, ROPE_DIM)
        elif "intermediate_size" in k or "ffn_dim" in k or k in MLP_FIELDS:
            d[k] = MLP
        elif k in EXPERT_FIELDS:
            d[k] = EXPERTS
        elif k in TOP_K_FIELDS:
            d[k] = min(v, TOP_K)
        elif k in GROUP_FIELDS:
            d[k] = 1
        elif k == "first_k_dense_replace":
            d[k] = min(v, 1)
        elif k in ("max_window_layers",):
            d[k] = min(v, layers)
        elif k in WINDOW_FIELDS:
            d[k] = min(v, WINDOW)
        elif k in LOW_RANK_FIELDS:
            d[k] = LOW_RANK
        elif k in SSM_STATE_FIELDS:
            d[k] = min(v, SSM_STATE)
        elif k in EXPAND_FIELDS:
            d[k] = 1
        elif k in ("time_step_rank", "mamba_dt_rank"):
            d[k] = min(v, ROPE_DIM)
        elif "vocab" in k and "vocab_size" not in k and v > VOCAB:
            d[k] = VOCAB
    for key in ("rope_parameters", "rope_scaling"):
        rope = d.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):
            rope = d[key] = dict(rope)
            rope["mrope_section"] = _rescale(rope["mrope_section"], HEAD_DIM // 2)
    for k in [k for k in d if isinstance(k, str) and "vocab_size" in k]:
        if _is_int(d[k]) and d[k] > VOCAB:
            d[k] = max(VOCAB, max(special_token_ids(d), default=0) + 1)
    return d


def _remap_ids(d: Any, mapping: dict[int, int]) -> Any:
    """A copy of a config dict tree with its special-token ids renumbered by `mapping`."""
    if isinstance(d, dict):
        return {k: mapping.get(v, v) if _is_id_field(k, v) else
                [mapping.get(x, x) for x in v] if _is_id_list(k, v) else _remap_ids(v, mapping)
                for k, v in d.items()}  # fmt: skip
    return d


def _is_id_field(k: Any, v: Any) -> bool:
    return isinstance(k, str) and k.endswith(("token_id", "token_index")) and _is_int(v)


def _is_id_list(k: Any, v: Any) -> bool:
    return isinstance(k, str) and k.endswith(("token_id", "token_ids")) and isinstance(v, list)


def small_ids(d: dict) -> dict:
    """Special-token ids at or past VOCAB renumbered from VOCAB - 1 down (distinct ids stay
    distinct, every field naming the same id gets the same new one), so a family whose image /
    control tokens sit at the end of a 150k-260k vocabulary keeps a vocabulary of VOCAB."""
    ids = set(special_token_ids(d))
    big = sorted(i for i in ids if i >= VOCAB)
    free = [i for i in range(VOCAB - 1, -1, -1) if i not in ids]
    return _remap_ids(d, dict(zip(big, free))) if big else d


def tiny_config(model_type: str, causal: bool = True) -> Any:
    """The config class of `model_type` with its defaults shrunk by `shrink` (and EXCEPTIONS).
    causal: built as a causal LM, so a config that is also an encoder's (BERT-style) is set up as
    a decoder (`is_decoder`), as its *ForCausalLM / *LMHeadModel class expects."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    d = shrink(small_ids(base.to_dict()))
    if causal and "is_decoder" in d and not d.get("is_encoder_decoder"):
        d["is_decoder"] = True
    # a sub-config's vocabulary must hold the ids its parent config names (image tokens ...)
    top = max(special_token_ids(d), default=0) + 1
    for sub in d.values():
        if not isinstance(sub, dict):
            continue
        for k, v in sub.items():
            if isinstance(k, str) and "vocab_size" in k and _is_int(v) and VOCAB <= v < top:
                sub[k] = top
    fields, _ = EXCEPTIONS.get(model_type, ({}, ""))
    d = _merge(d, fields)
    d.pop("transformers_version", None)
    config = type(base).from_dict(d)
    config.torch_dtype = None  # build in float32 whatever the family ships
    return config
